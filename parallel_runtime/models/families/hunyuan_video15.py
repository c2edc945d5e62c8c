"""HunyuanVideo 1.5 (Tencent, 8.3B): text- and image-to-video at 480p / 720p, their CFG-distilled files too.

The DiT is 54 double-stream MMDiT blocks and nothing else (no single-stream blocks): each attends jointly over
[prompt, video], with 3-D RoPE (axes 16/56/56, theta 256) on the video tokens and none on the prompt. The video is
the 32-channel latent of its own VAE (16x spatial, 4x temporal) in 1x1x1 patches, one token per latent pixel;
the model reads 65 channels: the latent, then HunyuanVideo15ImageToVideo's start-frame latent (32) and mask (1),
which ComfyUI fills with zeros for text-to-video. The prompt stream is ComfyUI's, in its order: the start image's
SigLIP tokens (image-to-video, through `vision_in`), the ByT5 glyph tokens of quoted text (`byt5_in`), then the
Qwen2.5-VL tokens after a two-block token refiner; a learned `cond_type_embedding` row marks each kind.

The token refiner reads the timestep (its gates come from the step's time embedding and the prompt's mean), so the
whole prompt is embedded again every step (`prompt_reads_timestep`), on every rank that embeds it, with local
attention; each rank then takes its rows. Everything after that is Flux's joint attention, split by the
strategies as they split Flux's.

The module tree is diffusers' HunyuanVideo15Transformer3DModel, so diffusers-layout files map one to one; the
released files (Tencent's names, which ComfyUI renames on load) and ComfyUI's own parameter names (what a LoRA
names) map through `source_map`, fused q/k/v cut into rows and the final modulation's halves swapped.
Where this follows ComfyUI rather than diffusers: the prompt has no padding and no mask (ComfyUI drops all-ones
masks; diffusers' masked-out SigLIP / glyph tokens of text-to-video are simply absent here), and RoPE tables are
computed in float64 as ComfyUI's EmbedND does (diffusers: float32; ~1e-7 apart). Sampling is
ModelSamplingDiscreteFlow (shift 7, multiplier 1000) on ComfyUI's HunyuanVideo15 latent format.

Refused in one sentence: the 1080p super-resolution files (98 input channels), MeanFlow files (`time_r_in`: they
read the sampler's next sigma), the original HunyuanVideo (1.0) and HunyuanImage 2.1, whose keys look alike.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling import HUNYUAN_VIDEO15_LATENT
from ...sampling.flow import FluxModelSampling
from ...strategies.attention import LocalAttention
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..conditioning import modulate, timestep_sinusoid
from ..detection import BFL_PREFIXES, DIFFUSERS_PREFIXES
from ..family import DiTFamily, Match, OneBlockListConfig, diffusers_meta_model
from ..patchify import PatchTokens
from ..rope import probe_ids, rope_table, video_grid_ids

LATENT_CHANNELS = 32
HEAD_DIM = 128  # ComfyUI's detection: num_heads = width // 128
ROPE_AXES = (16, 56, 56)
ROPE_THETA = 256
VISION_WIDTH = 1152  # SigLIP (sigclip_vision_patch14_384): the start image's tokens, ComfyUI's clip_fea
GLYPH_WIDTH = 1472  # ByT5 small: the glyph tokens of quoted text, ComfyUI's txt_byt5
EPS = 1e-6
SR_CHANNELS = 98  # HunyuanVideo15_SR_Distilled's input: latent, upsampled low-res latent, mask and more
BLOCK_LISTS = ("transformer_blocks",)
ALWAYS_OWNED = ("time_embed.",)
# The prompt stream (refiner, glyph and vision projections) is embedded where the prompt enters: the first stage.
FIRST_STAGE = ("x_embedder.", "context_embedder.", "context_embedder_2.", "image_embedder.", "cond_type_embed.")
LAST_STAGE = ("norm_out.", "proj_out.")
# cond_type_embedding rows: which kind of prompt token (ComfyUI: 0 text encoder, 1 byt5, 2 vision encoder).
TEXT, GLYPH, VISION = 0, 1, 2


@dataclass(frozen=True)
class HunyuanVideo15Config(OneBlockListConfig):  # 54 double blocks, 4x MLP
    hidden_size: int
    num_layers: int
    in_channels: int = 65
    text_dim: int = 3584  # Qwen2.5-VL 7B's hidden size
    num_refiner_layers: int = 2

    family = "hunyuan_video15"
    pooled_dim = 0
    text_encoders = "Qwen2.5-VL 7B and ByT5 small (DualCLIPLoader type hunyuan_video_15)"
    head_dim = HEAD_DIM
    video = True  # latents are [B, C, T, H, W]
    patch_size = 1  # one token per latent pixel
    latent_downscale = 16  # its VAE's spatial compression
    clip_vision_width = VISION_WIDTH
    clip_vision_model = "sigclip_vision_patch14_384 (SigLIP)"
    glyph_width = GLYPH_WIDTH
    concat_nodes = "HunyuanVideo15ImageToVideo"
    concat_optional = True  # a branch without c_concat reads zeros there, as ComfyUI's concat_cond builds them
    latent_format = HUNYUAN_VIDEO15_LATENT
    latent_channels = LATENT_CHANNELS

    def __post_init__(self):
        if self.hidden_size % HEAD_DIM or self.in_channels not in (LATENT_CHANNELS, 2 * LATENT_CHANNELS + 1):
            raise ModelFileError(f"HunyuanVideo 1.5 config is inconsistent ({self.hidden_size} wide, "
                                 f"{self.in_channels} input channels); the file is damaged, so re-download it.")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // HEAD_DIM

    @property
    def context_dim(self) -> int:
        return self.text_dim

    @property
    def concat_channels(self) -> int:
        return self.in_channels - LATENT_CHANNELS

    @property
    def variant(self) -> str:
        return "hunyuan_video15"

    @property
    def title(self) -> str:
        size = "8.3B" if (self.hidden_size, self.num_layers) == (2048, 54) else f"{self.hidden_size}-wide"
        return f"HunyuanVideo 1.5 {size}"

    def diffusers_kwargs(self) -> dict:
        return dict(in_channels=self.in_channels, out_channels=LATENT_CHANNELS, num_attention_heads=self.num_heads,
                    attention_head_dim=HEAD_DIM, num_layers=self.num_layers,
                    num_refiner_layers=self.num_refiner_layers, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                    text_embed_dim=self.text_dim, text_embed_2_dim=GLYPH_WIDTH, image_embed_dim=VISION_WIDTH,
                    rope_theta=float(ROPE_THETA), rope_axes_dim=ROPE_AXES)


# -- checkpoint layout --------------------------------------------------------------------------------

_REFINER0 = "txt_in.individual_token_refiner.blocks.0.norm1.weight"  # ComfyUI's Hunyuan Video detection key


def match_layout(keys: list[str]) -> Match | None:
    """ComfyUI's Hunyuan Video key (every HunyuanVideo / HunyuanImage 2.1 file: infer_config tells 1.5 from its
    look-alikes and refuses those), in the released names ("hunyuan") or ComfyUI's own ("comfy"); or diffusers'
    token refiner beside its cond_type_embed."""
    key_set = set(keys)
    for prefix in BFL_PREFIXES:
        if prefix + _REFINER0 in key_set:
            if any(k.startswith(prefix + "double_blocks.0.img_mod.lin.") for k in keys):
                return Match("comfy", prefix)
            split = prefix + "double_blocks.0.img_attn_q.weight" in key_set
            return Match("hunyuan_split" if split else "hunyuan", prefix)
    for prefix in DIFFUSERS_PREFIXES:
        if {prefix + "context_embedder.token_refiner.refiner_blocks.0.norm1.weight",
                prefix + "cond_type_embed.weight"} <= key_set:
            return Match("diffusers", prefix)
    return None


def _refuse_look_alikes(reader, p: str, name: str, layout: str) -> None:
    if layout == "diffusers":
        return
    if any(k.startswith(p + "single_blocks.") for k in reader.keys()) or p + "cond_type_embedding.weight" not in reader:
        image = len(reader.shape(p + "img_in.proj.weight")) == 4 if p + "img_in.proj.weight" in reader else False
        what = "a HunyuanImage 2.1 model" if image else "the original HunyuanVideo (1.0) or a HunyuanImage 2.1 refiner"
        raise ModelFileError(f"{name} is {what}, not HunyuanVideo 1.5, and ParaDiT runs only HunyuanVideo 1.5 of "
                             f"this kind; load it with UNETLoader or choose a hunyuanvideo1.5 480p/720p file.")


def infer_config(reader, match: Match, name: str) -> HunyuanVideo15Config:
    p, layout = match.prefix, match.layout
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    _refuse_look_alikes(reader, p, name, layout)
    comfy = layout != "diffusers"
    shape = tensor_shapes(reader, p, name, "a complete HunyuanVideo 1.5 DiT")
    if (p + "time_r_in.mlp.0.weight" in reader or p + "time_r_in.in_layer.weight" in reader
            or p + "time_embed.timestep_embedder_r.linear_1.weight" in reader):
        raise ModelFileError(f"{name} is a MeanFlow-distilled HunyuanVideo 1.5 file (time_r_in), which reads the "
                             f"sampler's next sigma and does not run on ParaDiT yet; load it with UNETLoader or "
                             f"choose a 480p/720p text- or image-to-video file.")
    width, in_channels = shape("img_in.proj.weight" if comfy else "x_embedder.proj.weight")[:2]
    if in_channels == SR_CHANNELS:
        raise ModelFileError(f"{name} is the HunyuanVideo 1.5 super-resolution model (1080p SR distilled), which "
                             f"upsamples a finished 720p video's latent and does not run on ParaDiT yet; sample the "
                             f"720p video here and upscale it with UNETLoader's SR model or the latent upsampler.")
    block = "double_blocks" if comfy else "transformer_blocks"
    refiner = "txt_in.individual_token_refiner.blocks" if comfy else "context_embedder.token_refiner.refiner_blocks"
    text_in = "txt_in.input_embedder.weight" if comfy else "context_embedder.proj_in.weight"
    return HunyuanVideo15Config(hidden_size=width, num_layers=block_count(reader.keys(), p, block, name),
                                in_channels=in_channels, text_dim=shape(text_in)[1],
                                num_refiner_layers=block_count(reader.keys(), p, refiner, name))


_meta_model = diffusers_meta_model("HunyuanVideo15Transformer3DModel")


def comfy_names(config: HunyuanVideo15Config) -> dict[str, Source]:
    """diffusers parameter -> ComfyUI's parameter name (comfy/ldm/hunyuan_video/model.py, Flux's block names)."""
    out: dict[str, Source] = {}
    d = config.hidden_size

    def lin(dst: str, src: str, rows: slice | None = None, transform: str | None = None) -> None:
        for part in ("weight", "bias"):
            out[f"{dst}.{part}"] = Source(f"{src}.{part}", rows, transform)

    def qkv(dst: str, src: str, names=("to_q", "to_k", "to_v")) -> None:
        for k, n in enumerate(names):
            lin(f"{dst}.{n}", src, slice(k * d, (k + 1) * d))

    for i in range(config.num_layers):
        b, c = f"transformer_blocks.{i}", f"double_blocks.{i}"
        lin(f"{b}.norm1.linear", f"{c}.img_mod.lin")
        lin(f"{b}.norm1_context.linear", f"{c}.txt_mod.lin")
        qkv(f"{b}.attn", f"{c}.img_attn.qkv")
        qkv(f"{b}.attn", f"{c}.txt_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
        for ours, theirs in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                             ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            out[f"{b}.attn.{ours}.weight"] = Source(f"{c}.{theirs}.weight")
        lin(f"{b}.attn.to_out.0", f"{c}.img_attn.proj")
        lin(f"{b}.attn.to_add_out", f"{c}.txt_attn.proj")
        for ours, theirs in (("ff", "img_mlp"), ("ff_context", "txt_mlp")):
            lin(f"{b}.{ours}.net.0.proj", f"{c}.{theirs}.0")
            lin(f"{b}.{ours}.net.2", f"{c}.{theirs}.2")
    for j in range(config.num_refiner_layers):
        b, c = f"context_embedder.token_refiner.refiner_blocks.{j}", f"txt_in.individual_token_refiner.blocks.{j}"
        lin(f"{b}.norm1", f"{c}.norm1")
        lin(f"{b}.norm2", f"{c}.norm2")
        qkv(f"{b}.attn", f"{c}.self_attn.qkv")
        lin(f"{b}.attn.to_out.0", f"{c}.self_attn.proj")
        lin(f"{b}.ff.net.0.proj", f"{c}.mlp.0")
        lin(f"{b}.ff.net.2", f"{c}.mlp.2")
        lin(f"{b}.norm_out.linear", f"{c}.adaLN_modulation.1")
    embed = "context_embedder.time_text_embed"
    for ours, theirs in (("context_embedder.proj_in", "txt_in.input_embedder"),
                         (f"{embed}.timestep_embedder.linear_1", "txt_in.t_embedder.in_layer"),
                         (f"{embed}.timestep_embedder.linear_2", "txt_in.t_embedder.out_layer"),
                         (f"{embed}.text_embedder.linear_1", "txt_in.c_embedder.in_layer"),
                         (f"{embed}.text_embedder.linear_2", "txt_in.c_embedder.out_layer"),
                         ("x_embedder.proj", "img_in.proj"),
                         ("time_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                         ("time_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                         ("context_embedder_2.norm", "byt5_in.layernorm"),
                         ("context_embedder_2.linear_1", "byt5_in.fc1"), ("context_embedder_2.linear_2", "byt5_in.fc2"),
                         ("context_embedder_2.linear_3", "byt5_in.fc3"),
                         ("image_embedder.norm_in", "vision_in.proj.0"), ("image_embedder.linear_1", "vision_in.proj.1"),
                         ("image_embedder.linear_2", "vision_in.proj.3"), ("image_embedder.norm_out", "vision_in.proj.4"),
                         ("proj_out", "final_layer.linear")):
        lin(ours, theirs)
    out["cond_type_embed.weight"] = Source("cond_type_embedding.weight")
    # ComfyUI's LastLayer chunks (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift).
    lin("norm_out.linear", "final_layer.adaLN_modulation.1", transform="swap_halves")
    return out


# ComfyUI's names -> the released files' (the inverse of supported_models.HunyuanVideo.process_unet_state_dict, in
# reverse order: the MLPs' "mlp.0." first, before the embedders' renames write "mlp.0." again).
_RELEASED = (("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."),
             ("txt_in.t_embedder.in_layer.", "txt_in.t_embedder.mlp.0."),
             ("txt_in.t_embedder.out_layer.", "txt_in.t_embedder.mlp.2."),
             ("txt_in.c_embedder.in_layer.", "txt_in.c_embedder.linear_1."),
             ("txt_in.c_embedder.out_layer.", "txt_in.c_embedder.linear_2."),
             ("time_in.in_layer.", "time_in.mlp.0."), ("time_in.out_layer.", "time_in.mlp.2."),
             ("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."), ("_attn.proj.", "_attn_proj."),
             ("_attn.norm.query_norm.weight", "_attn_q_norm.weight"), ("_attn.norm.key_norm.weight", "_attn_k_norm.weight"))


def released_name(comfy_name: str) -> str:
    for comfy, released in _RELEASED:
        comfy_name = comfy_name.replace(comfy, released)
    return comfy_name


def source_map(config: HunyuanVideo15Config, layout: str, prefix: str = "") -> dict:
    """Every diffusers parameter -> its Source in a file of `layout`: "diffusers", "comfy" (ComfyUI's parameter
    names), "hunyuan_split" (the released names with the double blocks' q, k and v stored apart, as in Tencent's
    own files) or the released names with them fused, as ComfyUI's files have them (any other layout)."""
    if layout == "diffusers":
        return same_names(_meta_model(config).state_dict(), prefix)
    out = {}
    for name, src in comfy_names(config).items():
        key = src.key if layout == "comfy" else released_name(src.key)
        rows = src.rows
        if layout == "hunyuan_split" and "_attn_qkv." in key and key.startswith("double_blocks."):
            key, rows = key.replace("_attn_qkv.", f"_attn_{'qkv'[rows.start // config.hidden_size]}."), None
        out[name] = Source(prefix + key, rows, src.transform)
    return out


def checkpoint_shapes(config: HunyuanVideo15Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{released key: (shape, kind)} of a complete HunyuanVideo 1.5 file, for writing random test checkpoints."""
    params = _meta_model(config).state_dict()
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, src in comfy_names(config).items():
        key = released_name(src.key)
        shape = list(params[name].shape)
        if src.rows is not None:  # a fused q/k/v: three of diffusers' rows
            shape[0] = 3 * config.hidden_size
        if "_mod." in key or "adaLN_modulation" in key:
            kind = "mod" if key.endswith("weight") else "bias"
        elif key.endswith("bias"):
            kind = "bias"
        elif key == "cond_type_embedding.weight":
            kind = "table"
        elif "norm" in key or ".proj.0." in key or ".proj.4." in key:
            kind = "norm"
        else:
            kind = "weight"
        shapes[key] = (tuple(shape), kind)
    return shapes


# -- the strategies' view -----------------------------------------------------------------------------

def rope_tables(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of position ids [L, 3] (Flux's EmbedND formula, pairs interleaved), theta 256, axes 16/56/56."""
    return rope_table(ids, ROPE_AXES, ROPE_THETA)


def block_inputs(config: HunyuanVideo15Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (video tokens, prompt rows, time embedding, RoPE of [prompt, one-frame grid]) of a block call."""
    h = config.hidden_size
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.randn(1, h, generator=generator), rope_tables(probe_ids(text, image)))


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1))


class HunyuanVideo15Adapter(PatchTokens, BlockLoop):
    patch = 1  # [B, C, T, H, W] -> [B, T H W, C]: one token per latent pixel, frame after frame
    latent_channels = LATENT_CHANNELS
    latent_format = HUNYUAN_VIDEO15_LATENT
    default_guidance = 0.0  # ComfyUI passes guidance 6.0, which these files (no guidance_in) never read
    joint_text = True
    prompt_reads_timestep = True  # the token refiner reads t: the prompt is embedded again every step

    def __init__(self, config: HunyuanVideo15Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.dtype, self.device = compute_placement(model.time_embed)

    variant = "hunyuan_video15"

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(7.0, 1000.0, kind="discrete_flow")  # supported_models.HunyuanVideo15: shift 7

    # -- token layout ----------------------------------------------------------------------------------

    def rope(self, text_len: int, t: int, h: int, w: int, references=(), method=None):
        """cos/sin over [prompt (ids 0: no rotation), video (frame, row, column)], as ComfyUI's ids."""
        ids = torch.cat([torch.zeros(text_len, 3), video_grid_ids(t, h, w)])
        return rope_tables(ids.to(self.device))

    @staticmethod
    def joined_rows(branches) -> int:
        """Rows embed_text puts in front of the prompt: the start image's vision tokens and the glyph tokens."""
        return sum(extra.shape[1] for extra in (branches.clip_vision, branches.glyph) if extra is not None)

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, thw) -> torch.Tensor:
        """img_in's 1x1x1 conv as one matmul; a text-to-video branch without c_concat reads zeros there (ComfyUI's
        HunyuanVideo15.concat_cond), which adds nothing but the bias, so only the latent's columns are used."""
        conv = self.model.x_embedder.proj
        weight = conv.weight.flatten(1)
        tokens = tokens.to(self.device, self.dtype)
        return F.linear(tokens, weight[:, :tokens.shape[-1]], conv.bias)

    def embed_text(self, cond: torch.Tensor, t: torch.Tensor | None = None, clip_vision: torch.Tensor | None = None,
                   glyph: torch.Tensor | None = None) -> torch.Tensor:
        """The whole prompt stream of ComfyUI's forward_orig at timestep t (the model's units): [SigLIP tokens
        through vision_in, ByT5 tokens through byt5_in, Qwen tokens through the token refiner], each plus its
        cond_type_embedding row."""
        if t is None:
            raise ValueError("HunyuanVideo 1.5's prompt embedding needs the step's timestep (prompt_reads_timestep)")
        kinds = self.model.cond_type_embed.weight
        parts = [self._refine(cond.to(self.device, self.dtype), t) + kinds[TEXT].to(self.dtype)]
        if glyph is not None:
            parts.insert(0, self.model.context_embedder_2(glyph.to(self.device, self.dtype)) + kinds[GLYPH].to(self.dtype))
        if clip_vision is not None:
            vision = self.model.image_embedder(clip_vision.to(self.device, self.dtype))
            parts.insert(0, vision + kinds[VISION].to(self.dtype))
        return torch.cat(parts, dim=1)

    def _refine(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """ComfyUI's TokenRefiner: gates from the timestep's and the prompt mean's embeddings, then two unmasked
        pre-norm blocks over the prompt alone (local attention: every rank holds the whole prompt here)."""
        refiner = self.model.context_embedder
        embed = refiner.time_text_embed
        mean = x.float().sum(dim=1).div(x.shape[1]).to(x.dtype) if x.dtype == torch.float16 else x.mean(dim=1)
        c = embed.timestep_embedder(timestep_sinusoid(t.to(self.device).flatten()).to(x.dtype)) + embed.text_embedder(mean)
        x = refiner.proj_in(x)
        heads = self.config.num_heads
        attend = LocalAttention()
        for j, block in enumerate(refiner.token_refiner.refiner_blocks):
            gate_msa, gate_mlp = block.norm_out.linear(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
            h = block.norm1(x)
            q, k, v = (_split_heads(proj(h), heads) for proj in (block.attn.to_q, block.attn.to_k, block.attn.to_v))
            y = attend(q, k, v, self.config.num_layers + j).flatten(2, 3).to(x.dtype)
            x = x + block.attn.to_out[0](y) * gate_msa
            x = x + block.ff(block.norm2(x)) * gate_mlp
        return x

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, thw=None):
        """time_in of t (the model's units: sigma x 1000), the sinusoid in float32 as ComfyUI computes it."""
        sinusoid = timestep_sinusoid(t.to(self.device).flatten()).to(self.dtype)
        return self.model.time_embed.timestep_embedder(sinusoid)

    # -- blocks and head -------------------------------------------------------------------------------

    def block(self, i: int, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope) -> tuple:
        """Flux's DoubleStreamBlock as ComfyUI's HunyuanVideo runs it: per stream, adaLN (shift, scale, gate) x 2,
        RMS-normed q/k, joint attention over [prompt, video] with RoPE, then a tanh-GELU MLP."""
        from diffusers.models.embeddings import apply_rotary_emb

        block = self.model.transformer_blocks[i]
        attn, heads, dim = block.attn, block.attn.heads, self.config.hidden_size  # heads: a tensor rank's share
        img_mod = [m.unsqueeze(1) for m in block.norm1.linear(F.silu(temb)).chunk(6, dim=-1)]
        txt_mod = [m.unsqueeze(1) for m in block.norm1_context.linear(F.silu(temb)).chunk(6, dim=-1)]

        def modulated(x, mod, k):
            return modulate(F.layer_norm(x, (dim,), eps=EPS), mod[k], mod[k + 1])

        img_in, txt_in = modulated(image, img_mod, 0), modulated(text, txt_mod, 0)
        q = torch.cat([attn.norm_added_q(_split_heads(attn.add_q_proj(txt_in), heads)),
                       attn.norm_q(_split_heads(attn.to_q(img_in), heads))], dim=1)
        k = torch.cat([attn.norm_added_k(_split_heads(attn.add_k_proj(txt_in), heads)),
                       attn.norm_k(_split_heads(attn.to_k(img_in), heads))], dim=1)
        v = torch.cat([_split_heads(attn.add_v_proj(txt_in), heads), _split_heads(attn.to_v(img_in), heads)], dim=1)
        q, k = (apply_rotary_emb(x, rope, sequence_dim=1) for x in (q, k))
        out = self.context.attention(q, k, v, i, masked=False).flatten(2, 3).to(image.dtype)
        n_text = text.shape[1]
        image = torch.addcmul(image, attn.to_out[0](out[:, n_text:].contiguous()), img_mod[2])
        text = torch.addcmul(text, attn.to_add_out(out[:, :n_text].contiguous()), txt_mod[2])
        image = torch.addcmul(image, block.ff(modulated(image, img_mod, 3)), img_mod[5])
        text = torch.addcmul(text, block.ff_context(modulated(text, txt_mod, 3)), txt_mod[5])
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """LastLayer: affine-free LayerNorm, (scale, shift) from the time embedding, the linear; float32 velocity
        in pack's channel order (1x1x1 patches: the head's own)."""
        scale, shift = self.model.norm_out.linear(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        x = modulate(F.layer_norm(image, (self.config.hidden_size,), eps=EPS), shift, scale)
        return self.model.proj_out(x).float()


HUNYUAN_VIDEO15 = DiTFamily(
    name="hunyuan_video15", title="HunyuanVideo 1.5 (text- and image-to-video)", match=match_layout,
    infer_config=infer_config, meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=HunyuanVideo15Adapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="comfy", replace_keys=("double_block",), block_inputs=block_inputs)
