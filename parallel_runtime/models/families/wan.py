"""Wan 2.1 / 2.2 video DiTs (text-to-video 1.3B / 14B, image-to-video 14B) in ComfyUI's key layout.

A Wan block runs self-attention over the video's tokens (frames x rows x columns of 1x2x2 patches, 3-D RoPE),
then cross-attention from its rows to the umT5 prompt, which every rank holds whole (no communication), then
the MLP; six modulation rows per block come from one timestep embedding. Like PixArt the prompt is not in the
attention sequence, so Ulysses and Ring split the video tokens alone and PipeFusion's patches are runs of
them (whole rows, frame after frame). Image-to-video files read WanImageToVideo's start-frame latent and mask as
c_concat channels beside the latent (split with its tokens); 2.1's also cross-attend the start image's CLIP-vision
tokens with their own keys and values, which ride with the timestep embedding because every stage needs them.
Wan 2.1 FLF2V 14B is that shape plus `img_emb.emb_pos`: WanFirstLastFrameToVideo hands it both images' CLIP-vision
tokens (2 x 257), each plus its learned position before img_emb's projection (ComfyUI's MLPProj).

The module tree keeps ComfyUI's parameter names (comfy/ldm/wan/model.py), so ComfyUI-layout files map one to one
and a LoRA's ComfyUI keys land without translation; the forward pieces mirror ComfyUI's op for op, in its
dtypes: the patch embedding in float32, the sinusoid in float32 then the model dtype, modulation added in the
model dtype. Sampling is ModelSamplingDiscreteFlow (shift 8, multiplier 1000) on the Wan 2.1 latent format.

VideoX-Fun's variants load as ComfyUI loads them (comfy/supported_models.py WAN21_FunControl2V, WAN21_Camera,
WAN22_Camera): Fun inpaint is the image-to-video shape (WanFunInpaintToVideo's start and end frames through the
same concat), Fun control reads the control video's latent beside the start frame's (32 channels; 2.2's with the
mask between them, 36). Fun camera adds `control_adapter` (WanCamAdapter): the Plücker embedding of
WanCameraEmbedding, [24, frames, 8H, 8W] per video, pixel-unshuffled and patch-convolved to one row per token,
refined by 3x3 convolutions within each frame and added to the patch embedding. Each rank runs the adapter on the
frames its tokens lie in (the convolutions never cross a frame), so the embedding splits with the tokens. 2.2 Fun
control's reference image (Wan22FunControlToVideo's ref_image) enters through `ref_conv` as one frame of tokens
that ComfyUI puts before the video at RoPE frame 0 (the video then at frames 1..T); here they follow the video's
rows as reference tokens (the strategies' reference rows, split like them), with the same RoPE ids, and leave
before the head.

VACE files (Wan 2.1 VACE 1.3B / 14B, Wan 2.2 VACE-Fun A14B; ComfyUI's VaceWanModel) add `vace_patch_embedding` and
`vace_blocks`: WanVaceToVideo's context (per input, its inactive and reactive latents and the 8x8-unshuffled mask, 96
channels at the latent's size) is patch-embedded like the video, and VACE block n, a Wan block over the context's
tokens, runs after main block n x (layers / vace_layers), its after_proj times the input's strength added to the
video's tokens. The context tokens have the video's layout, so they split with it: a rank's image stream is its
video rows followed by the same rows of each context input, and every rank runs the VACE blocks on its own rows
through the strategy's attention (Ulysses' all-to-all, Ring's passes, displaced patch's and PipeFusion's stale K/V
under layer ids after the main blocks'), never on a replicated context. Under PipeFusion the context rows ride with
the video rows from stage to stage, and a stage owns (loads and runs) the VACE blocks whose hints its own main
blocks add: the VACE chain only reads the video's embedded tokens at block 0 (on the first stage), so no hint
crosses a stage and the VACE blocks' work is spread like the main blocks' (each message is 1 + inputs times the
video rows). A reference image (WanVaceToVideo's reference_image) is a latent frame in front of the video and of
its context, sampled like the others (TrimVideoLatent cuts it after).

Wan 2.2 Animate (AnimateWanModel: the 2.1 I2V shape plus `pose_patch_embedding`, `motion_encoder`, `face_encoder`
and `face_adapter`) reads WanAnimateToVideo's pose latent, added to the video's tokens one frame behind, and face
video, whose motion tokens a face block after every 5th block attends frame by frame; models/families/wan_animate.py
holds those parts and says how each splits. The face blocks ride with their main blocks (`riders`) like VACE's.

Wan 2.2 Bernini (the A14B text-to-video experts fine-tuned for in-context editing) reads BerniniConditioning's
context_latents: the source video's, the reference video's and each reference image's latent, each of its own size.
ComfyUI 2026's WanModel embeds each with the video's patch_embedding, appends its tokens after the video's for one
joint self-attention, and cuts the head's output back to the video's; each stream has its own rope_encode grid from
0, which `source_id` (1, 2, ... in order) turns by one more rotation over the whole head dim. Here they are reference
rows of the in-context kind (spec.IN_CONTEXT_METHOD), so every strategy splits them like the video's; `rope` builds
their grids and in_context_rotation turns them.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelFileError
from ...sampling import WAN21_LATENT, WAN22_LATENT
from ...sampling.flow import FluxModelSampling
from ...spec import IN_CONTEXT_METHOD, REFERENCE_METHODS, kept_key
from ...weights.keymap import Source, block_count, has_block, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import BlockKind, DiTFamily, JointAttentionConfig, Match
from ..patchify import PatchTokens, rows_cached
from ..rope import rope_table, video_grid_ids
from ..shapes import shapes_of_model
from .flux import BFL_PREFIXES
from .flux_adapter import channels_first
from . import wan_animate

# Latent channels -> ComfyUI's format: Wan 2.1's VAE (every 2.1 file, 2.2's 14B experts), 2.2's VAE (TI2V 5B).
LATENT_FORMATS = {16: WAN21_LATENT, 48: WAN22_LATENT}
HEAD_DIM = 128  # every Wan: ComfyUI's detection sets num_heads = dim // 128
EPS = 1e-6
# img_emb projects the start image's CLIP-vision tokens (2.1 I2V) with the timestep, on every stage (temb).
# Wan Animate's motion and face encoders make what its face blocks read, which every stage reads like the timestep.
ALWAYS_OWNED = ("time_embedding.", "time_projection.", "img_emb.", "motion_encoder.", "face_encoder.")
CAMERA_UNSHUFFLE = 8  # WanCamAdapter's PixelUnshuffle: the Plücker embedding is at pixel size, 8x the latent's
# The bench's face video: its frames cost the motion encoder once per run (~45 GFLOP each: 1.4 s a frame on one CPU
# thread), not per step; a release's 81 would add minutes per row on a CPU without changing a step's time.
BENCH_FACE_FRAMES = 9
FACE_INPUTS_KEPT = 4  # Wan Animate face inputs whose motion tokens a worker keeps (a run's two and the last run's)
CLIP_TOKENS = 257  # clip_vision_h's penultimate hidden states: 16 x 16 patches and the class token
CLIP_VISION_WIDTH = 1280  # CLIP ViT-H/14's hidden size: clip_vision_h, the CLIP vision file Wan 2.1 I2V reads
FIRST_STAGE = ("patch_embedding.", "text_embedding.", "control_adapter.", "ref_conv.", "vace_patch_embedding.",
               "pose_patch_embedding.")
LAST_STAGE = ("head.",)
BLOCK_LISTS = ("blocks",)
WAN_BLOCK = BlockKind("self+cross", ("image", "prompt"))


@dataclass(frozen=True)
class WanConfig(JointAttentionConfig):
    hidden_size: int
    num_layers: int
    ffn_dim: int
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    image_to_video: bool = False  # 2.1 I2V: CLIP-vision tokens beside the prompt (img_emb, k_img / v_img)
    camera_channels: int = 0  # Fun camera: the Plücker embedding's channels its control_adapter reads (24); else 0
    reference_channels: int = 0  # 2.2 Fun control: ref_conv's input (a reference image's latent); else 0
    vace_layers: int = 0  # VACE: its context blocks (vace_blocks), each after every (layers / vace_layers)-th block
    vace_channels: int = 0  # VACE: vace_patch_embedding's input (WanVaceToVideo's latents and mask: 96); else 0
    clip_positions: int = 0  # 2.1 FLF2V: img_emb.emb_pos's rows (514: the start and end images' 257 tokens); else 0
    animate: bool = False  # 2.2 Animate: the pose embedding, the face encoders and a face block after every 5th block

    family = "wan"
    pooled_dim = 0
    text_encoders = "umT5-XXL (CLIPLoader type wan)"
    head_dim = HEAD_DIM
    num_single_layers = 0
    patch_size = (1, 2, 2)
    video = True  # latents are [B, C, T, H, W]

    def __post_init__(self):
        if self.hidden_size % HEAD_DIM:
            raise ModelFileError(f"Wan width {self.hidden_size} is not a multiple of its head size {HEAD_DIM}; the "
                                 f"file is damaged, so re-download it.")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // HEAD_DIM

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_dim

    @property
    def context_dim(self) -> int:
        return self.text_dim

    @property
    def latent_channels(self) -> int:
        return self.out_channels

    @property
    def latent_format(self):
        return LATENT_FORMATS[self.out_channels]

    @property
    def clip_vision_width(self) -> int | None:
        return CLIP_VISION_WIDTH if self.image_to_video else None

    @property
    def concat_channels(self) -> int:
        return self.in_channels - self.out_channels

    @property
    def variant(self) -> str:
        """"i2v" where the file reads start-frame channels beside the latent (WanImageToVideo's concat), else "t2v"."""
        return "i2v" if self.concat_channels else "t2v"

    @property
    def fun_kind(self) -> str | None:
        """VideoX-Fun's variant of this shape: "camera" (a control adapter), "control" (the control video's latent
        beside the start frame's: 2.1's two latents, 2.2's with the mask between), else None (T2V, I2V, Fun InP)."""
        if self.camera_channels:
            return "camera"
        return "control" if self.concat_channels in (2 * self.out_channels, 2 * self.out_channels + 4) else None

    @property
    def concat_nodes(self) -> str:
        """The node that makes this file's c_concat, for the sentence refusing a branch without it."""
        if self.fun_kind == "camera":
            return "WanCameraImageToVideo"
        if self.fun_kind == "control":
            return "Wan22FunControlToVideo" if self.concat_channels % self.out_channels else "WanFunControlToVideo"
        return "WanImageToVideo (or WanFunInpaintToVideo)"

    def reference_latent_problem(self, references, latent_shape: tuple, timestep, method=None) -> str | None:
        """What ComfyUI's WanModel could not run about these reference latents, as a sentence: it reads one reference
        image (the chain's last), of the video's size, beside one timestep per row; in-context streams (Bernini) of
        any size, beside one timestep per row."""
        per_frame = timestep is not None and timestep.ndim > 1 and timestep.shape[1] > 1
        if method == IN_CONTEXT_METHOD:
            # WanModel repeats per-frame modulation rows over x's tokens (repeat_e), which then hold the streams'
            # tokens too: frames and rows no longer line up, so there is no ComfyUI result to reproduce.
            return ("Bernini's in-context latents (BerniniConditioning) with per-frame timesteps (a noise mask on a "
                    "Wan 2.2 5B latent) have no defined result in ComfyUI's WanModel either; remove the noise mask "
                    "or BerniniConditioning" if per_frame else None)
        if len(references) != 1:
            return (f"this {self.title} model reads one reference image (Wan22FunControlToVideo's ref_image), not "
                    f"{len(references)}; remove the extra ReferenceLatent nodes")
        if tuple(references[0].shape[-2:]) != tuple(latent_shape[-2:]):
            return (f"the reference latent is {tuple(references[0].shape[-2:])} but the video's latent "
                    f"{tuple(latent_shape[-2:])}; give Wan22FunControlToVideo's ref_image the video's width and height")
        if per_frame:
            return ("a reference image with per-frame timesteps (a noise mask) is not run by ComfyUI's WanModel "
                    "either; remove the noise mask or disconnect ref_image")
        return None

    # Every Wan conditioning may carry reference latents of one of two kinds (reference_problem says which runs):
    # 2.2 Fun control's ref_image for ref_conv, or Bernini's in-context streams for the patch embedding.
    reads_references = True

    def reference_problem(self, name: str, references, method) -> str | None:
        """The one-sentence refusal of the `name` conditioning's reference latents, or None where this file reads
        them: in-context streams (IN_CONTEXT_METHOD) on a plain WanModel, else one ref_image through ref_conv (the
        method of FluxKontextMultiReferenceLatentMethod is ignored there, as WAN21.extra_conds ignores it)."""
        if method == IN_CONTEXT_METHOD:
            return self._in_context_problem(name, references)
        if method not in (None, *REFERENCE_METHODS):
            return (f"reference latent method {method!r} is unknown; choose one of {', '.join(REFERENCE_METHODS)} in "
                    f"FluxKontextMultiReferenceLatentMethod.")
        if not self.reference_channels:
            return (f"the {name} conditioning carries a reference latent, but this {self.title} model has no ref_conv "
                    f"to read it (Wan22FunControlToVideo's ref_image); disconnect ref_image or load a Wan 2.2 Fun "
                    f"control model.")
        for k, ref in enumerate(references):
            if ref.ndim != 4 or ref.shape[1] != self.out_channels or min(ref.shape[2:]) < 1:
                return (f"reference latent {k + 1} of the {name} conditioning has shape {tuple(ref.shape)}, not "
                        f"[batch, {self.out_channels}, height/8, width/8]; encode the reference image with this "
                        f"model's VAE (VAE Encode) before ReferenceLatent.")
        return None

    def _in_context_problem(self, name: str, streams) -> str | None:
        """ComfyUI's WanModel embeds each in-context stream with the video's patch_embedding and appends it to the
        video's tokens: a file whose patch embedding reads more than the latent (image-to-video, Fun), or whose
        model class ignores the streams (VaceWanModel's and CameraWanModel's forward_orig), cannot run them."""
        if self.concat_channels or self.reference_channels or self.vace_layers or self.camera_channels:
            return (f"the {name} conditioning carries Bernini's in-context latents (BerniniConditioning), which "
                    f"ComfyUI's WanModel reads on a Wan text-to-video file (the Bernini experts, wan2.2_bernini_*), "
                    f"not on this {self.title} model; load the Bernini file or remove BerniniConditioning.")
        for k, lat in enumerate(streams):
            if lat.ndim != 5 or lat.shape[0] != 1 or lat.shape[1] != self.out_channels or min(lat.shape[2:]) < 1:
                return (f"in-context latent {k + 1} of the {name} conditioning has shape {tuple(lat.shape)}, not "
                        f"[1, {self.out_channels}, frames, height/8, width/8]; encode its video or image with this "
                        f"model's VAE in BerniniConditioning.")
        return None

    @property
    def title(self) -> str:
        size = {1536: "1.3B", 3072: "5B", 5120: "14B"}.get(self.hidden_size, f"{self.hidden_size}-wide")
        if self.animate:
            return f"Wan 2.2 Animate {size}"
        if self.vace_layers:  # 2.1's VACE 14B and 2.2's VACE-Fun A14B experts share one shape
            return f"Wan {'2.1' if size == '1.3B' else '2.1 / 2.2'} VACE {size}"
        if self.fun_kind:  # 2.1's Fun files cross-attend CLIP vision (img_emb); 2.2's read the concat alone
            version = "2.1" if self.image_to_video else "2.2"
            return f"Wan {version} Fun {self.fun_kind.capitalize()} {size}"
        if self.clip_positions:  # 2.1 FLF2V 14B: I2V's shape plus positions for two images' CLIP-vision tokens
            return f"Wan 2.1 FLF2V {size}"
        if self.out_channels == 48 and not self.concat_channels:  # 2.2's own VAE: the start frame is in the latent
            return f"Wan 2.2 TI2V {size}"
        if self.out_channels == 48:
            return f"Wan 2.2 Fun InP {size}"
        # 2.1 I2V cross-attends CLIP-vision tokens; 2.2's I2V reads the start frame through the concat alone; the
        # 14B text-to-video files of 2.1 and 2.2 (each expert) share one shape.
        version = "2.1" if self.image_to_video or size == "1.3B" else ("2.2" if self.variant == "i2v" else "2.1 / 2.2")
        return f"Wan {version} {self.variant.upper()} {size}"

    @property
    def vace_after(self) -> dict[int, int]:
        """Main block -> the VACE context block whose hint is added after it (VaceWanModel.vace_layers_mapping)."""
        if not self.vace_layers:
            return {}
        return {i: n for n, i in enumerate(range(0, self.num_layers, self.num_layers // self.vace_layers))}

    def random_inputs(self, latent_shape: tuple, g: torch.Generator, negative: bool = False) -> dict:
        """A bench job's inputs beside the prompt, as WanAnimateToVideo sets them on an Animate model: the concat
        (mask and reference / motion latents), CLIP vision, the pose latent and BENCH_FACE_FRAMES face frames (-1
        on the negative), the face kept under the hash of its bytes as a model call's (one key, one tensor: the
        client sends a kept input only when its key is new to the workers). Other Wan files: none."""
        if not self.animate:
            return {}
        b, c, t, h, w = latent_shape
        frames = BENCH_FACE_FRAMES if t > 2 else 1  # a smoke run's 2 latent frames (bench --quick): one face frame
        face = (torch.rand(1, 3, frames, 512, 512, generator=g) * 2 - 1) if not negative else \
            torch.full((1, 3, frames, 512, 512), -1.0)
        return dict(concat=torch.randn(1, self.concat_channels, t, h, w, generator=g),
                    clip_vision=torch.randn(1, CLIP_TOKENS, CLIP_VISION_WIDTH, generator=g),
                    pose=torch.randn(1, c, t - 1, h, w, generator=g), face=face,
                    face_key=kept_key("face", face))

    @property
    def face_after(self) -> dict[int, int]:
        """Main block -> the Animate face block that runs after it (AnimateWanModel: after blocks 0, 5, 10, ...)."""
        return wan_animate.face_block_after(self.num_layers) if self.animate else {}

    @property
    def riders(self) -> dict[int, tuple[str, ...]]:
        """Main block -> the modules that run right after it and live with it (a VACE context block, a face block):
        their weights count with it for stage planning, and the stage that owns it owns them."""
        out: dict[int, tuple[str, ...]] = {}
        for after, name in ((self.vace_after, "vace_blocks"), (self.face_after, "face_adapter.fuser_blocks")):
            for i, n in after.items():
                out[i] = out.get(i, ()) + (f"{name}.{n}.",)
        return out

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        """Self-attention over the video's tokens, then cross-attention to the prompt every rank holds."""
        return (WAN_BLOCK,) * self.num_layers

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """RoPE dims of (frame, row, column), as ComfyUI's WanModel splits its head dim."""
        d = HEAD_DIM
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)


# -- checkpoint layout --------------------------------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    key_set = set(keys)
    for prefix in BFL_PREFIXES:
        if ({prefix + "head.modulation", prefix + "patch_embedding.weight"} <= key_set
                and has_block(keys, prefix, "blocks")):
            return Match("comfy", prefix)
    return None


# The keys comfy/model_detection.py tells these Wan variants by.
# Each with what it adds that the workers do not run yet, and the ComfyUI node that feeds it (None: a node of
# ComfyUI 2026's that has no fixed name here).
_UNSUPPORTED = {"casual_audio_encoder.encoder.final_linear.weight":
                ("Wan 2.2 S2V", "its audio encoder and audio tokens", "WanSoundImageToVideo"),
                "audio_proj.audio_proj_glob_1.layer.bias": ("Wan HuMo", "its audio projection", "WanHuMoImageToVideo"),
                "patch_embedding_mask.weight": ("Wan SCAIL 2", "its pose and mask streams", None),
                "patch_embedding_pose.weight": ("Wan SCAIL", "its pose stream", None),
                "patch_embedding_global.weight": ("Wan Dancer", "its global motion stream", None)}
# What ComfyUI reads from a file's own metadata (config -> transformer -> model_type) over the keys: Wan Animate 2
# files are Wan 2.1 I2V-shaped and only their metadata says that a pose branch runs beside the video.
_UNSUPPORTED_MODEL_TYPES = {"animate2": ("Wan Animate 2", "its pose branch beside the video", "WanAnimate2ToVideo")}


def _model_type_in_metadata(reader) -> str | None:
    metadata = getattr(reader, "metadata", None)
    try:
        config = json.loads((metadata() if callable(metadata) else {}).get("config") or "{}")
        return config.get("transformer", {}).get("model_type")
    except (ValueError, AttributeError):  # no JSON config, or not the shape ComfyUI reads: the keys decide
        return None


def infer_config(reader, match: Match, name: str) -> WanConfig:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    # The metadata first: ComfyUI lets it override what the keys say.
    variants = [_UNSUPPORTED_MODEL_TYPES.get(_model_type_in_metadata(reader))]
    variants += [variant for key, variant in _UNSUPPORTED.items() if p + key in reader]
    variant = next((v for v in variants if v), None)
    if variant:
        what, adds, node = variant
        raise ModelFileError(f"{name} is a {what} model, which ParaDiT does not run yet ({adds}); load it with "
                             f"UNETLoader{f' for {node}' if node else ''}, or choose a Wan 2.1 / 2.2 text-to-video, "
                             f"image-to-video, Fun or VACE file.")

    shape = tensor_shapes(reader, p, name, "a complete Wan DiT")

    dim, in_channels = shape("patch_embedding.weight")[:2]
    out_channels = shape("head.head.weight")[0] // 4
    if out_channels not in LATENT_FORMATS:
        raise ModelFileError(f"{name} predicts {out_channels} latent channels, not a Wan 2.1 (16) or Wan 2.2 TI2V (48) "
                             f"latent; the file is damaged or of a Wan variant ParaDiT does not know: load it with "
                             f"UNETLoader.")
    vace_layers, vace_channels = 0, 0
    if p + "vace_patch_embedding.weight" in reader:  # comfy/model_detection.py's VACE: vace_in_dim, vace_layers
        vace_channels = shape("vace_patch_embedding.weight")[1]
        vace_layers = block_count(reader.keys(), p, "vace_blocks", name)
        layers = block_count(reader.keys(), p, "blocks", name)
        if not 0 < vace_layers <= layers or len(range(0, layers, layers // vace_layers)) != vace_layers:
            raise ModelFileError(f"{name} has {vace_layers} VACE blocks for {layers} blocks, which ComfyUI's "
                                 f"VaceWanModel cannot place (one after every (blocks / VACE blocks)-th block); the "
                                 f"file is damaged or of another VACE layout: load it with UNETLoader.")
    layers = block_count(reader.keys(), p, "blocks", name)
    animate = p + "face_adapter.fuser_blocks.0.k_norm.weight" in reader  # comfy/model_detection.py's "animate"
    if animate and block_count(reader.keys(), p, "face_adapter.fuser_blocks", name) != layers // wan_animate.FACE_EVERY:
        raise ModelFileError(f"{name} has Wan Animate's face blocks but not one per {wan_animate.FACE_EVERY} of its "
                             f"{layers} blocks, as AnimateWanModel places them; the file is damaged: re-download it.")
    camera = 0
    if p + "control_adapter.conv.weight" in reader:  # WanCamAdapter: conv over 8x8-unshuffled Plücker channels
        camera = shape("control_adapter.conv.weight")[1] // CAMERA_UNSHUFFLE ** 2
    return WanConfig(hidden_size=dim, num_layers=layers,
                     ffn_dim=shape("blocks.0.ffn.0.weight")[0], in_channels=in_channels, out_channels=out_channels,
                     text_dim=shape("text_embedding.0.weight")[1], freq_dim=shape("time_embedding.0.weight")[1],
                     image_to_video=p + "img_emb.proj.0.weight" in reader, camera_channels=camera,
                     clip_positions=shape("img_emb.emb_pos")[1] if p + "img_emb.emb_pos" in reader else 0,
                     reference_channels=shape("ref_conv.weight")[1] if p + "ref_conv.weight" in reader else 0,
                     vace_layers=vace_layers, vace_channels=vace_channels, animate=animate)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, image_keys: bool = False):
        super().__init__()
        self.heads = heads  # what the forward splits q/k/v into (a tensor-parallel rank's share: heads / N)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=EPS), nn.RMSNorm(dim, eps=EPS)
        if image_keys:  # 2.1 I2V: the CLIP-vision tokens' own keys and values
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = nn.RMSNorm(dim, eps=EPS)


class _Block(nn.Module):
    def __init__(self, config: WanConfig):
        super().__init__()
        dim = config.hidden_size
        self.self_attn = _Attention(dim, config.num_heads)
        self.norm3 = nn.LayerNorm(dim, eps=EPS)  # cross_attn_norm: every released Wan has it
        self.cross_attn = _Attention(dim, config.num_heads, image_keys=config.image_to_video)
        self.ffn = nn.Sequential(nn.Linear(dim, config.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))


class _VaceBlock(_Block):
    """VaceWanAttentionBlock: a Wan block over the VACE context's tokens, whose after_proj makes the hint added to
    the video's; the first also adds before_proj of the context to the video's embedded tokens."""

    def __init__(self, config: WanConfig, first: bool):
        super().__init__(config)
        if first:
            self.before_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.after_proj = nn.Linear(config.hidden_size, config.hidden_size)


class _Head(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        self.head = nn.Linear(dim, out)
        self.modulation = nn.Parameter(torch.empty(1, 2, dim))


class _CameraAdapter(nn.Module):
    """WanCamAdapter's parameters: the patch conv over the unshuffled Plücker embedding, one residual block."""

    def __init__(self, channels: int, dim: int, patch: tuple[int, int]):
        super().__init__()
        self.conv = nn.Conv2d(channels * CAMERA_UNSHUFFLE ** 2, dim, patch, patch)
        block = nn.Module()
        block.conv1, block.conv2 = nn.Conv2d(dim, dim, 3, padding=1), nn.Conv2d(dim, dim, 3, padding=1)
        self.residual_blocks = nn.Sequential(block)

    def forward(self, camera: torch.Tensor) -> torch.Tensor:
        """[N, C, frames, 8H, 8W] -> [N, frames, H/2, W/2, dim], frame by frame as WanCamAdapter runs it."""
        n, c, f, h, w = camera.shape
        x = self.conv(F.pixel_unshuffle(camera.transpose(1, 2).reshape(n * f, c, h, w), CAMERA_UNSHUFFLE))
        for block in self.residual_blocks:
            x = block.conv2(F.relu(block.conv1(x))) + x
        return x.unflatten(0, (n, f)).permute(0, 1, 3, 4, 2)


class WanTransformer(nn.Module):
    """ComfyUI's WanModel parameters under its names; the forward lives in WanAdapter."""

    def __init__(self, config: WanConfig):
        super().__init__()
        dim = config.hidden_size
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, config.patch_size, config.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.head = _Head(dim, config.out_channels * math.prod(config.patch_size))
        if config.image_to_video:
            self.img_emb = nn.Module()
            width = CLIP_VISION_WIDTH
            self.img_emb.proj = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                              nn.Linear(width, dim), nn.LayerNorm(dim))
            if config.clip_positions:  # FLF2V: a learned position per CLIP-vision token of the two images
                self.img_emb.emb_pos = nn.Parameter(torch.empty(1, config.clip_positions, width))
        if config.reference_channels:  # a reference latent's patch conv (2.2 Fun control's ref_image)
            self.ref_conv = nn.Conv2d(config.reference_channels, dim, config.patch_size[1:], config.patch_size[1:])
        if config.camera_channels:
            self.control_adapter = _CameraAdapter(config.camera_channels, dim, config.patch_size[1:])
        if config.vace_layers:
            self.vace_blocks = nn.ModuleList(_VaceBlock(config, i == 0) for i in range(config.vace_layers))
            self.vace_patch_embedding = nn.Conv3d(config.vace_channels, dim, config.patch_size, config.patch_size)
        if config.animate:
            wan_animate.add_animate_parts(self, dim, config.num_heads, config.num_layers)


def _meta_model(config: WanConfig) -> WanTransformer:
    with torch.device("meta"):
        return WanTransformer(config)


def source_map(config: WanConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    """ComfyUI's names are ours: every parameter under its own name after the file's prefix."""
    return same_names(_meta_model(config).state_dict(), prefix)


def tensor_plan(config: WanConfig) -> dict[str, str]:
    """Tensor parallelism over Wan's blocks: both attentions' q/k/v (and 2.1 I2V's image keys and values) column-wise,
    their out-projections and the MLP's down projection row-wise. Wan's q/k RMSNorms span all heads' width, so they
    hold a rank's columns and all-reduce their sum of squares ("norm"). The modulation is a stored table, not a
    layer: every rank's."""
    plan = {}
    for blocks in ("blocks", "vace_blocks"):  # a VACE model's context blocks split like the main ones
        plan.update({f"{blocks}.*.ffn.0": "colwise", f"{blocks}.*.ffn.2": "rowwise"})
        for attn in ("self_attn", "cross_attn"):
            plan.update({f"{blocks}.*.{attn}.{proj}": "colwise" for proj in ("q", "k", "v", "k_img", "v_img")})
            plan.update({f"{blocks}.*.{attn}.{norm}": "norm" for norm in ("norm_q", "norm_k", "norm_k_img")})
            plan[f"{blocks}.*.{attn}.o"] = "rowwise"
    if config.animate:
        plan.update(wan_animate.tensor_plan())
    return plan


def _parameter_kind(name: str) -> str:
    """How a random test checkpoint draws a parameter: modulation tables O(1), norms (img_emb's LayerNorms are its
    proj.0 / proj.4) around 1, biases small, the rest by fan-in."""
    if name.endswith("modulation") or name.endswith("padding_tokens"):
        return "table"
    if name.startswith("motion_encoder."):  # StyleGAN's equalized layers scale unit-variance weights at run time
        return "blur" if name.endswith("kernel") else "bias" if name.endswith("bias") else "equal"
    if "norm" in name.split(".")[-2] or ".proj.0." in name or ".proj.4." in name:
        return "norm" if name.endswith("weight") else "bias"
    return "bias" if name.endswith("bias") else "weight"


def checkpoint_shapes(config: WanConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a Wan file, for writing random test checkpoints."""
    return shapes_of_model(_meta_model(config).state_dict(), _parameter_kind)


# -- the strategies' view -----------------------------------------------------------------------------

def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """comfy/ldm/wan/model.py's sinusoidal_embedding_1d: [cos, sin] of t x 10000^(-i / half), in float32."""
    half = dim // 2
    t = t.float()
    sinusoid = torch.outer(t, torch.pow(10000, -torch.arange(half, device=t.device).to(t).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def block_inputs(config: WanConfig, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (video tokens, embedded prompt, (e, six modulation rows, CLIP-vision tokens of an I2V model), RoPE of
    a one-frame grid) of a block call."""
    h, cols = config.hidden_size, max(1, math.isqrt(image))
    rope = (*rope_table(video_grid_ids(1, -(-image // cols), cols)[:image], config.rope_axes),
            torch.zeros(image, dtype=torch.long))
    clip = torch.randn(1, CLIP_TOKENS, h, generator=generator) if config.image_to_video else None
    temb = (torch.randn(1, 1, h, generator=generator), torch.randn(1, 1, 6, h, generator=generator), clip, ())
    return torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb, rope


def in_context_rotation(cos: torch.Tensor, sin: torch.Tensor, source_id: int, theta: float = 10000.0) -> tuple:
    """An in-context stream's RoPE (Bernini): rope_encode's `source_id` composes one more rotation into the spatial
    one, by angle source_id x theta^(-2k / d) for pair k of the WHOLE head dim d (not per axis as the grid's), so
    each stream differs from the video (id 0) and from the others at every position. The angles as ComfyUI's flux
    rope makes them (float64, then float32); its product of the two rotation matrices is the angle sum, written
    here as cos(a + b) and sin(a + b) of the two float32 tables (the same products, in float32)."""
    d = cos.shape[-1]
    angle = source_id * theta ** -torch.linspace(0, (d - 2) / d, d // 2, dtype=torch.float64)
    cos_b, sin_b = (f(angle).float().repeat_interleave(2).to(cos.device) for f in (torch.cos, torch.sin))
    return cos * cos_b - sin * sin_b, sin * cos_b + cos * sin_b


def per_token(rows: torch.Tensor, rope) -> torch.Tensor:
    """Modulation rows [N, frames, dim] for the tokens `rope` covers: one row for all (a scalar timestep), or each
    token its frame's (per-frame timesteps; ComfyUI's repeat_e gives token j frame j // tokens-per-frame)."""
    return rows if rows.shape[1] == 1 else rows[:, rope[2]]


class WanAdapter(PatchTokens):
    """Tokens: the kit's 1x2x2 patches, frame-major, (c, ph, pw) inside each (the patch conv's weight order); a
    reference image's [B, C, H, W] packs as one frame (ref_conv's order)."""

    patch = 2
    default_guidance = 0.0  # no guidance input
    joint_text = False  # the prompt is cross-attended, not part of the attention sequence
    reads_clip_vision = True  # the Denoiser hands timestep_embedding the branches' CLIP-vision tokens
    reads_rope_options = True  # ScaleROPE's scale and shift of the RoPE grid (rope_encode's rope_options)
    skip: frozenset = frozenset()  # blocks whose output is their input this job (SkipLayerGuidance), set per job

    def __init__(self, config: WanConfig, model: WanTransformer, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels = config.out_channels
        self.latent_format = config.latent_format
        self.dtype, self.device = compute_placement(model.time_embedding)
        # Wan Animate's motion tokens by face input (its kept key, frames): the run's model calls reuse them
        self._face_tokens: dict[tuple, torch.Tensor] = {}
        self._frame_runs: dict[int, tuple] = {}  # the face blocks' runs of rows per frame table (wan_animate.frame_runs)

    @property
    def variant(self) -> str:
        return self.config.variant

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(8.0, 1000.0, kind="discrete_flow")  # supported_models.WAN21_T2V: shift 8

    # -- token layout ----------------------------------------------------------------------------------

    def rope(self, text_len: int, t: int, h: int, w: int, references=(), method=None, rope_options=None):
        """Per video token (the prompt is not in the sequence): RoPE's cos and sin of ComfyUI's rope_encode ids,
        and the token's frame, which picks its modulation rows when the timestep is per frame (Wan 2.2 5B's
        image-to-video); strategies take each table's rows at their tokens' positions. `rope_options` (ScaleROPE:
        scale_t, scale_y, scale_x, shift_t, shift_y, shift_x) moves grid index i of an axis to shift + i * scale,
        as rope_encode's linspace does (ChronoEdit's scale_t 7 puts its edited frame at time 7). In-context streams
        (`method` IN_CONTEXT_METHOD, `references` their (frames, h, w)) follow the video's rows, each on its own
        grid from 0 (scaled and shifted alike), turned by its source rotation (in_context_rotation)."""
        rows, cols = (h + 1) // 2, (w + 1) // 2
        ids = video_grid_ids(t, rows, cols).to(self.device)
        frames = ids[:, 0].long()
        streams = ()
        if method == IN_CONTEXT_METHOD:  # _forward's rope_encode of each padded stream: (frames, h / 2, w / 2)
            streams = tuple(video_grid_ids(f, (sh + 1) // 2, (sw + 1) // 2).to(self.device) for f, sh, sw in references)
            ids = torch.cat([ids, *streams])
            frames = torch.cat([frames, frames.new_zeros(len(ids) - len(frames))])  # the scalar timestep's rows
        elif references:  # ref_conv's tokens (after the video's here): rope_encode over t + 1 frames, the reference
            # first (ComfyUI prepends it), so the reference reads frame 0 and the video frames 1..t
            reference = video_grid_ids(1, rows, cols).to(self.device)
            ids = torch.cat([ids + torch.tensor([1.0, 0.0, 0.0], device=ids.device), reference])
            frames = torch.cat([frames, frames.new_zeros(rows * cols)])  # its modulation: the scalar timestep's
        if rope_options is not None:
            scale, shift = torch.tensor(rope_options[:3], device=ids.device), torch.tensor(rope_options[3:], device=ids.device)
            ids = ids * scale + shift
        cos, sin = rope_table(ids, self.config.rope_axes)
        start = t * rows * cols
        for source_id, stream in enumerate(streams, start=1):
            rows_of = slice(start, start + len(stream))
            cos[rows_of], sin[rows_of] = in_context_rotation(cos[rows_of], sin[rows_of], source_id)
            start += len(stream)
        return cos, sin, frames

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, thw) -> torch.Tensor:
        """The 1x2x2 patch conv as one matmul on packed tokens, in float32 as ComfyUI runs it, then the model dtype;
        rows past the video's (a reference image's) through ref_conv, in the model dtype as ComfyUI runs that."""
        t, h, w = thw
        if self.config.reference_channels and len(index) and int(index.min()) >= t * (h // 2) * (w // 2):
            conv = self.model.ref_conv
            out = F.linear(tokens.to(self.device, conv.weight.dtype), conv.weight.flatten(1), conv.bias)
            return out.to(self.dtype)
        conv = self.model.patch_embedding
        out = F.linear(tokens.to(self.device, torch.float32), conv.weight.float().flatten(1), conv.bias.float())
        return out.to(self.dtype)

    def embed_camera(self, camera: torch.Tensor, index: torch.Tensor, thw) -> torch.Tensor:
        """WanCamAdapter's rows for video tokens `index`, added to their patch embedding as CameraWanModel adds
        them: the adapter runs on the frames those tokens lie in only (its 3x3 convolutions stay within a frame),
        moved to the device from the embedding the branch carries, in the model's dtype."""
        t, h, w = thw
        per_frame = (h // 2) * (w // 2)
        first, last = int(index.min()) // per_frame, int(index.max()) // per_frame
        adapter = self.model.control_adapter
        frames = camera[:, :, first:last + 1].to(self.device, adapter.conv.weight.dtype)
        rows = adapter(frames).flatten(1, 3).to(self.dtype)  # [N, frames x tokens per frame, dim]
        return rows[:, index.to(rows.device) - first * per_frame]

    def embed_vace(self, tokens: torch.Tensor) -> torch.Tensor:
        """VACE context tokens [N, inputs, rows, C*4] (packed like the latent) through vace_patch_embedding, in
        float32 from the model's dtype as VaceWanModel runs it: [N, inputs x rows, dim], input after input."""
        conv = self.model.vace_patch_embedding
        tokens = tokens.to(self.device, self.dtype).float()
        return F.linear(tokens, conv.weight.float().flatten(1), conv.bias.float()).to(self.dtype).flatten(1, 2)

    def embed_pose(self, pose: torch.Tensor, index: torch.Tensor, thw) -> torch.Tensor:
        """Wan Animate's pose rows for video tokens `index` (pose packed like the latent, one frame behind it)."""
        return wan_animate.pose_rows(self.model.pose_patch_embedding, pose, index, thw, self.dtype)

    def face_rows(self, face: torch.Tensor, key: str | None, thw, share=None) -> torch.Tensor:
        """Wan Animate's motion tokens [rows, frames, 5, dim] of one branch's face video, made once per face input
        (`key`: the hash the host kept it under), video length and weights (a LoRA patches them: weights_id), and
        kept for the run's next model calls; at most FACE_INPUTS_KEPT inputs (a run's positive and negative, and
        one run before). `share`: the ranks that split the motion encoder's frames (wan_animate.face_motion); a
        rank's cache may hold what another's lacks (under CFG parallelism each kept its own branch's), so they
        agree first whether all hold the tokens."""
        cache_key = ((key, tuple(face.shape), thw[0], getattr(self, "weights_id", None))
                     if key is not None and face.shape[0] == 1 else None)
        tokens = self._face_tokens.get(cache_key) if cache_key else None
        if share is not None:  # the ranks encode together, so all of them make the tokens unless all have them
            held = torch.tensor([tokens is not None], dtype=torch.float32, device=self.device)
            tokens = tokens if bool(torch.cat(share[2](held)).all()) else None
        if tokens is None:
            with torch.no_grad():
                tokens = wan_animate.face_motion(self.model, face, thw[0], self.dtype, share)
            if cache_key:
                while len(self._face_tokens) >= FACE_INPUTS_KEPT:
                    self._face_tokens.pop(next(iter(self._face_tokens)))
                self._face_tokens[cache_key] = tokens
        return tokens

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.text_embedding(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, thw=None, clip_vision=None,
                           vace_strength: tuple[float, ...] = (), face: torch.Tensor | None = None):
        """What every block reads beside its rows and the prompt: (e [N, 1, dim] for the head, e0 [N, 1, 6, dim] for
        the blocks, at t in the model's units (sigma x 1000), and the start image's CLIP-vision tokens through
        img_emb [N, 257, dim] (2.1 I2V; else None). Those ride here, not with the prompt, because every pipeline
        stage embeds its timestep itself (img_emb is tiny) while only the first embeds the prompt. Then a VACE
        branch's strengths, one per context input (whose rows ride behind the video's: run_blocks), and last an
        Animate branch's motion tokens per row (Branches.face_rows), which its face blocks read."""
        sinusoid = sinusoidal_embedding(self.config.freq_dim, t.to(self.device).flatten()).to(self.dtype)
        e = self.model.time_embedding(sinusoid).reshape(t.shape[0], -1, self.config.hidden_size)
        image = None
        if clip_vision is not None and self.config.image_to_video:  # a text-to-video model ignores it, as ComfyUI's
            clip_vision = clip_vision.to(self.device, self.dtype)
            if self.config.clip_positions:  # FLF2V's MLPProj: at most emb_pos's rows, each plus its position
                positions = self.model.img_emb.emb_pos.to(self.dtype)
                clip_vision = clip_vision[:, :positions.shape[1]] + positions[:, :clip_vision.shape[1]]
            image = self.model.img_emb.proj(clip_vision)
        e0 = self.model.time_projection(e).unflatten(2, (6, self.config.hidden_size))
        return e, e0, image, tuple(vace_strength), face

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb, rope, chunk: int = 0) -> tuple:
        """The chunk's blocks on the rank's rows. A VACE branch's image stream is [video rows, then each context
        input's rows, as many]: the context rows run through the VACE blocks (VaceWanModel's order: context block n
        after main block vace_after⁻¹(n), its hint times the input's strength added to the video rows), and ride on
        with the video's to the next chunk, so a pipeline stage runs the context blocks of its own main blocks."""
        strengths = temb[3] if len(temb) > 3 else ()
        motion = temb[4] if len(temb) > 4 else None
        x, contexts = image, []
        if strengths:
            x, *contexts = image.tensor_split(len(strengths) + 1, dim=1)
        for i in self.chunks[chunk]:
            if contexts and i == 0:  # the first context block reads the video's embedded tokens (VaceWanModel x_orig)
                first = self.model.vace_blocks[0].before_proj
                contexts = [first(c) + x for c in contexts]
            if i not in self.skip:
                x = self._block(self.model.blocks[i], i, x, text, temb[1], rope, temb[2])
            n = self.config.vace_after.get(i)
            if contexts and n is not None:
                block = self.model.vace_blocks[n]
                for k, strength in enumerate(strengths):
                    contexts[k] = self._block(block, self.config.num_layers + n, contexts[k], text, temb[1], rope,
                                              temb[2])
                    x = x + block.after_proj(contexts[k]) * strength
            n = self.config.face_after.get(i)
            if motion is not None and n is not None:  # after the block, skipped or not (AnimateWanModel.forward_orig)
                face = self.model.face_adapter.fuser_blocks[n]
                x = x + wan_animate.face_attention(face, x, motion.to(x.dtype), self._runs_of(rope[2]))
        return (torch.cat([x, *contexts], dim=1) if contexts else x), text

    def _runs_of(self, frames: torch.Tensor) -> list:
        """The face blocks' runs of rows per frame for these rows, read back once per frame table (rows_cached: the
        step loops build each rank's tables once per job)."""
        if len(self._frame_runs) > 64 and id(frames) not in self._frame_runs:  # tables of finished jobs
            self._frame_runs.clear()
        return rows_cached(self._frame_runs, frames, lambda: wan_animate.frame_runs(frames))

    def _block(self, block: nn.Module, layer: int, x: torch.Tensor, context: torch.Tensor, e0: torch.Tensor, rope,
               clip_tokens: torch.Tensor | None) -> torch.Tensor:
        """WanAttentionBlock.forward: modulated self-attention, cross-attention, modulated MLP. `layer` names the
        block's attention to the strategy (a VACE context block's: after the main blocks')."""
        e = [per_token(row, rope) for row in (block.modulation.to(x.dtype).unsqueeze(0) + e0).unbind(2)]
        dim = self.config.hidden_size
        y = torch.addcmul(e[0], F.layer_norm(x, (dim,), eps=EPS), 1 + e[1])
        y = self._self_attention(block.self_attn, layer, y, rope)
        x = torch.addcmul(x, y, e[2])
        x = x + self._cross_attention(block.cross_attn, block.norm3(x), context, clip_tokens)
        y = block.ffn(torch.addcmul(e[3], F.layer_norm(x, (dim,), eps=EPS), 1 + e[4]))
        return torch.addcmul(x, y, e[5])

    def _self_attention(self, attn: nn.Module, layer: int, x: torch.Tensor, rope) -> torch.Tensor:
        from diffusers.models.embeddings import apply_rotary_emb

        heads = attn.heads

        def split(t):
            return t.unflatten(-1, (heads, -1))

        q = apply_rotary_emb(split(attn.norm_q(attn.q(x))), rope[:2], sequence_dim=1)
        k = apply_rotary_emb(split(attn.norm_k(attn.k(x))), rope[:2], sequence_dim=1)
        out = self.context.image_attention(q, k, split(attn.v(x)), layer).flatten(2, 3).to(x.dtype)
        return attn.o(out)

    def _cross_attention(self, attn, x: torch.Tensor, context: torch.Tensor,
                         clip_tokens: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows attend to the whole prompt, which every rank holds (no communication). A 2.1 I2V model
        also attends to the CLIP-vision tokens with its own keys and values and adds the two (WanI2VCrossAttention);
        without them it reads the prompt there too, as ComfyUI does when no CLIP vision output is given."""
        heads = attn.heads

        def split(t):
            return t.unflatten(-1, (heads, -1)).transpose(1, 2)

        def attend(k, v):
            return F.scaled_dot_product_attention(q, split(k), split(v)).transpose(1, 2).flatten(2, 3)

        q = split(attn.norm_q(attn.q(x)))
        out = attend(attn.norm_k(attn.k(context)), attn.v(context))
        if self.config.image_to_video:
            image = context if clip_tokens is None else clip_tokens
            out = out + attend(attn.norm_k_img(attn.k_img(image)), attn.v_img(image))
        return attn.o(out)

    def head(self, image: torch.Tensor, temb, rope=None) -> torch.Tensor:
        """Velocity in float32, re-ordered from the head's (pt, ph, pw, c) to pack's (c, ph, pw)."""
        head = self.model.head
        shift, scale = (per_token(row, rope) for row in
                        (head.modulation.to(image.dtype).unsqueeze(0) + temb[0].unsqueeze(2)).unbind(2))
        dim = self.config.hidden_size
        out = head.head(torch.addcmul(shift, F.layer_norm(image, (dim,), eps=EPS), 1 + scale)).float()
        return channels_first(out, self.patch, self.config.out_channels)


@dataclass(frozen=True, eq=False)
class WanFamily(DiTFamily):
    """Wan's blocks, each carrying the VACE context block whose hint it adds (a VACE file's): that block's weights
    count with it for stage planning and memory, and the stage that owns it loads and runs both."""

    def parameter_counts(self, config) -> tuple[tuple[int, ...], int, int, int]:
        per_block, always, first, last = super().parameter_counts(config)
        riders = config.riders
        if not riders:
            return per_block, always, first, last
        weights = dict(_meta_model(config).named_parameters())
        extra = {i: sum(p.numel() for name, p in weights.items() if name.startswith(prefixes))
                 for i, prefixes in riders.items()}
        return tuple(n + extra.get(i, 0) for i, n in enumerate(per_block)), always, first, last

    def stage_ownership(self, config, chunks: list[range], first: bool, last: bool):
        """A stage also owns the VACE context blocks whose hints its main blocks add and the Animate face blocks that
        follow them (they run there: run_blocks)."""
        owns = super().stage_ownership(config, chunks, first, last)
        riders = tuple(p for i, prefixes in config.riders.items() if any(i in c for c in chunks) for p in prefixes)
        return lambda name: owns(name) or name.startswith(riders)


WAN = WanFamily(
    name="wan", title="Wan 2.1 / 2.2 (text- and image-to-video)", match=match_layout, infer_config=infer_config,
    meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=WanAdapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="comfy", replace_keys=("double_block",), block_inputs=block_inputs, tensor_plan=tensor_plan)
