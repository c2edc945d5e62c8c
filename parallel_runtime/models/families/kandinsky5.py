"""Kandinsky 5 (Kandinsky Lab): the video DiT (Lite 1792-wide x 32, Pro 4096-wide) and the image DiT (2560-wide):
Kandinsky 6's video half, whose blocks ComfyUI 2026's Kandinsky 6 imports.

One token stream: 2x2 patches of the 16-channel latent (the video files read 16 condition channels and a mask
beside them: zeros in text-to-video, as ComfyUI and diffusers give them; the image files read the latent alone),
3-D RoPE over frame, row, column (rows and columns at half rate for video, full rate for images). Each block is
self-attention, cross-attention to the prompt, MLP, modulated per sample by the timestep embedding plus the CLIP-L
pooled vector's projection. The prompt (Qwen2.5-VL rows) is refined by a few text blocks modulated by that same
embedding, so it depends on the timestep: every rank refines the whole prompt, every pass (it is short).

Under sequence parallelism the self-attention is Ulysses / Ring over the video rows (the prompt is cross-attended
locally: every rank holds it); tensor parallelism splits both attentions' heads (the q/k norms are per head) and the
MLP's units; PipeFusion's patches are runs of video rows, every stage holding the small time, pooled and text
modules. Attention is full on every file: ComfyUI's Kandinsky5 runs no NABLA sparse attention (diffusers' pipeline
does on the Pro files at high resolution), so neither does ParaDiT, exact to ComfyUI.

The module tree is diffusers' Kandinsky5Transformer3DModel, whose names are ComfyUI's (the released files') one for
one. Its attention processor casts rotated queries and keys to bfloat16 whatever the model's dtype; ParaDiT rotates
in float32 and casts back to the model's dtype, as ComfyUI does (Kandinsky 6's processor, reused here). ComfyUI's
call is Kandinsky5's: x [B, 16, T, H, W] (an image's [B, 16, H, W]), timestep = sigma x 1000, context the Qwen2.5-VL
rows, y the pooled CLIP-L vector, and in image-to-video Kandinsky5ImageToVideo's start frames (time_dim_replace),
which ComfyUI writes over the latent's first frames before the model: Load Parallel DiT's door does the same
(nodes/remote_model.py), so the workers run an ordinary call.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling.flow import FLUX_LATENT, FluxModelSampling, VideoLatentFormat
from ...weights.keymap import block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import DiTFamily, JointAttentionConfig, Match
from ..shapes import shapes_of_model
from .flux import BFL_PREFIXES, DIFFUSERS_PREFIXES
from .kandinsky6 import PATCH, StreamAttnProcessor, _freqs, _rope, parameter_kind
from .wan import WAN_BLOCK, WanAdapter

BLOCK_LISTS = ("visual_transformer_blocks",)
# Every stage modulates its blocks and cross-attends the refined prompt (RoPE is computed, not stored).
ALWAYS_OWNED = ("time_embeddings.", "pooled_text_embeddings.", "text_embeddings.", "text_transformer_blocks.")
FIRST_STAGE = ("visual_embeddings.",)
LAST_STAGE = ("out_layer.",)
VIDEO_ROPE_SCALE = (1.0, 2.0, 2.0)  # ComfyUI's Kandinsky5 rope_scale_factor; diffusers' pipeline's at 480p
IMAGE_ROPE_SCALE = (1.0, 1.0, 1.0)  # the image files' (diffusers' text-to-image pipeline's scale_factor)
PRO_ROPE_SCALE = (1.0, 3.16, 3.16)  # ComfyUI: the 4096-wide video model at latent h x w >= 14080
PRO_WIDTH, PRO_LARGE = 4096, 14080
_KEYS = ("visual_transformer_blocks.0.cross_attention.key_norm.weight", "text_transformer_blocks.0.text_modulation"
         ".out_layer.weight", "pooled_text_embeddings.in_layer.weight")


@dataclass(frozen=True)
class Kandinsky5Config(JointAttentionConfig):
    hidden_size: int  # model_dim
    num_layers: int  # visual blocks
    head_dim: int = 128  # the sum of the RoPE axes
    ff_dim: int = 7168
    time_dim: int = 512
    text_blocks: int = 2
    latent_dim: int = 16
    visual_cond: bool = True  # video files: 16 condition channels and a mask beside the latent's
    context_dim: int = 3584  # Qwen2.5-VL rows
    pooled_dim: int = 768  # CLIP-L

    family = "kandinsky5"
    num_single_layers = 0
    text_encoders = "Qwen2.5-VL 7B and CLIP-L (CLIPLoader type kandinsky5)"
    latent_downscale = 8

    def __post_init__(self):
        if self.hidden_size % self.head_dim or self.head_dim % 8:
            raise ModelFileError(f"Kandinsky 5 config is inconsistent ({self.hidden_size} wide over heads of "
                                 f"{self.head_dim}); the file is damaged, so re-download it.")

    num_blocks = property(lambda self: self.num_layers)
    num_heads = property(lambda self: self.hidden_size // self.head_dim)
    mlp_hidden = property(lambda self: self.ff_dim)
    latent_channels = property(lambda self: self.latent_dim)
    in_channels = property(lambda self: self.latent_dim * math.prod(PATCH))  # a token's output width
    video = property(lambda self: self.visual_cond)  # the image files read [B, C, H, W]
    variant = property(lambda self: "kandinsky5" if self.visual_cond else "kandinsky5-image")
    # ComfyUI's x of a video file carries the condition and mask channels (c_concat) beside the latent; without
    # them (Parallel Sampler's text-to-video) they are zeros, as diffusers' pipeline gives them.
    concat_channels = property(lambda self: self.latent_dim + 1 if self.visual_cond else 0)
    concat_optional = True
    concat_nodes = "Kandinsky5ImageToVideo"
    block_kinds = property(lambda self: (WAN_BLOCK,) * self.num_layers)  # self-attention, then the prompt's

    @property
    def axes_dims(self) -> tuple[int, int, int]:
        """RoPE widths of frame, row, column: (16, 24, 24) of 64 (Lite), (32, 48, 48) of 128 (Pro, Image)."""
        return self.head_dim // 4, 3 * self.head_dim // 8, 3 * self.head_dim // 8

    @property
    def title(self) -> str:
        kind = "Image" if not self.visual_cond else ("Pro" if self.hidden_size == PRO_WIDTH else "Lite")
        return f"Kandinsky 5 {kind} {self.hidden_size}-wide x {self.num_layers}"

    def rope_scale(self, h: int, w: int) -> tuple[float, float, float]:
        if not self.visual_cond:
            return IMAGE_ROPE_SCALE
        return PRO_ROPE_SCALE if self.hidden_size == PRO_WIDTH and h * w >= PRO_LARGE else VIDEO_ROPE_SCALE

    def diffusers_kwargs(self) -> dict:
        return dict(in_visual_dim=self.latent_dim, out_visual_dim=self.latent_dim, in_text_dim=self.context_dim,
                    in_text_dim2=self.pooled_dim, time_dim=self.time_dim, patch_size=PATCH, model_dim=self.hidden_size,
                    ff_dim=self.ff_dim, num_text_blocks=self.text_blocks, num_visual_blocks=self.num_layers,
                    axes_dims=self.axes_dims, visual_cond=self.visual_cond)


# -- checkpoint layout: ComfyUI's names are diffusers' --------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    key_set = set(keys)
    for prefix in dict.fromkeys(BFL_PREFIXES + DIFFUSERS_PREFIXES):
        if all(prefix + k in key_set for k in _KEYS):
            return Match("original", prefix)
    return None


def infer_config(reader, match: Match, name: str) -> Kandinsky5Config:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete Kandinsky 5 DiT")
    visual_in, visual_out = shape("visual_embeddings.in_layer.weight"), shape("out_layer.out_layer.weight")
    latent, volume = visual_out[0] // math.prod(PATCH), math.prod(PATCH)
    if visual_in[1] not in (latent * volume, (2 * latent + 1) * volume):
        raise ModelFileError(f"{name} reads {visual_in[1]} features per patch, neither its {latent}-channel latent's "
                             f"nor with a condition and mask beside it, so it is not a Kandinsky 5 file ParaDiT runs; "
                             f"load it with UNETLoader.")
    block = "visual_transformer_blocks.0."
    return Kandinsky5Config(
        hidden_size=visual_in[0], num_layers=block_count(reader.keys(), p, "visual_transformer_blocks", name),
        head_dim=shape(block + "self_attention.query_norm.weight")[0],
        ff_dim=shape(block + "feed_forward.in_layer.weight")[0], time_dim=shape("time_embeddings.out_layer.weight")[0],
        text_blocks=block_count(reader.keys(), p, "text_transformer_blocks", name), latent_dim=latent,
        visual_cond=visual_in[1] != latent * volume, context_dim=shape("text_embeddings.in_layer.weight")[1],
        pooled_dim=shape("pooled_text_embeddings.in_layer.weight")[1])


def _meta_model(config: Kandinsky5Config):
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Transformer3DModel

    with torch.device("meta"):
        return Kandinsky5Transformer3DModel(**config.diffusers_kwargs())


def source_map(config: Kandinsky5Config, layout: str, prefix: str = "") -> dict:
    return same_names(_meta_model(config).state_dict(), prefix)


def checkpoint_shapes(config: Kandinsky5Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a complete Kandinsky 5 DiT, for random test files."""
    return shapes_of_model(_meta_model(config).state_dict(), parameter_kind)


def tensor_plan(config: Kandinsky5Config) -> dict:
    """Every block's attentions split by heads (q/k/v column-wise, out-projection row-wise; the q/k norms are per
    head) and its MLP by units, the prompt's text blocks as the visual ones (a handful of all-reduces of the prompt's
    rows per call, for their weights halved); each block's modulation keeps 1/N of its outputs and all-gathers them
    (a few KB per block and step: the modulations hold a fifth of a block's weights). The embedders and head stay
    whole on every rank."""
    plan = {}
    for blocks, attentions, modulation in (("visual_transformer_blocks", ("self_attention", "cross_attention"),
                                            "visual_modulation"),
                                           ("text_transformer_blocks", ("self_attention",), "text_modulation")):
        plan.update({f"{blocks}.*.feed_forward.in_layer": "colwise", f"{blocks}.*.feed_forward.out_layer": "rowwise",
                     f"{blocks}.*.{modulation}.out_layer": "gather"})
        for attn in attentions:
            plan.update({f"{blocks}.*.{attn}.{p}": "colwise" for p in ("to_query", "to_key", "to_value")})
            plan[f"{blocks}.*.{attn}.out_layer"] = "rowwise"
    return plan


# -- the strategies' view -----------------------------------------------------------------------------

class AttnProcessor(StreamAttnProcessor):
    """Kandinsky 6's processor (float32 RoPE, heads counted from the projection) behind Kandinsky 5's attention
    call: one RoPE for queries and keys; the self-attention through the job's image-rows strategy, the prompt's
    and the text blocks' local."""

    def attend(self):
        return self.context.image_attention if self.stream == "image" else super().attend()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, sparse_params=None, rotary_emb=None):
        if sparse_params is not None:
            raise ValueError("Kandinsky 5's NABLA sparse attention is not run by ComfyUI's model nor by ParaDiT")
        return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb, rotary_emb)


class RefinedPrompt(NamedTuple):
    """Prompt rows already through the text blocks: the cost probe's, which times one visual block alone."""

    rows: torch.Tensor


class Kandinsky5Adapter:
    patch = 2
    joint_text = False  # the prompt is cross-attended
    default_guidance = 0.0
    skip: frozenset = frozenset()
    latent_format = VideoLatentFormat("hunyuan_video", 0.476986, 0.0)  # an image file's: the Flux VAE's (below)

    def __init__(self, config: Kandinsky5Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.dtype, self.device = compute_placement(model.time_embeddings)
        self.latent_channels = config.latent_dim
        # ModelSamplingDiscreteFlow (timestep = sigma x 1000) at the shift ComfyUI's Kandinsky 5 templates set with
        # ModelSamplingSD3 (video 5, image 3); the HunyuanVideo latent for video, the Flux VAE's for images.
        video = config.visual_cond
        self.model_sampling = FluxModelSampling(5.0 if video else 3.0, 1000.0, kind="discrete_flow")
        self.latent_format = type(self).latent_format if video else FLUX_LATENT
        self._refined = None  # (text, temb, refined prompt) of the last pass
        for i in (i for chunk in chunks for i in chunk):  # a stage's own blocks (the others are Identity there)
            block = model.visual_transformer_blocks[i]
            block.self_attention.set_processor(AttnProcessor(i, context, "image"))
            block.cross_attention.set_processor(AttnProcessor(i, context, "prompt"))
        for block in model.text_transformer_blocks:
            block.self_attention.set_processor(AttnProcessor(0, context, "prompt"))

    variant = property(lambda self: self.config.variant)

    # -- token layout: Wan's (features (channel, row, column) of each 1x2x2 patch, as the head writes them) ----

    pack = staticmethod(WanAdapter.pack)  # an image's [B, C, H, W] as one frame

    @staticmethod
    def unpack(tokens: torch.Tensor, *sizes: int) -> torch.Tensor:
        if len(sizes) == 2:
            return WanAdapter.unpack(tokens, 1, *sizes).squeeze(2)
        return WanAdapter.unpack(tokens, *sizes)

    def rope(self, text_len: int, *args):
        """Per video token (the prompt is not in the sequence): RoPE of ComfyUI's rope_encode_3d positions (index /
        scale per axis), as [rows, 1, d/2, 2, 2] rotations; args are the latent's (T, H, W) or (H, W), then the
        branches' references, which Kandinsky 5 has none of."""
        sizes = args[:3] if self.config.visual_cond else (1,) + tuple(args[:2])
        references = args[len(sizes) - (0 if self.config.visual_cond else 1):][:1]
        if references and references[0]:
            raise ValueError("Kandinsky 5 reads no reference latents")
        t, h, w = sizes[0], sizes[1] // 2, sizes[2] // 2
        rows = torch.arange(t * h * w)
        position = (rows // (h * w), rows // w % h, rows % w)
        scale = self.config.rope_scale(sizes[1], sizes[2])
        angles = torch.cat([torch.outer(p.float() / s, _freqs(d))
                            for p, d, s in zip(position, self.config.axes_dims, scale)], dim=-1)
        return (_rope(angles).to(self.device),)

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, thw) -> torch.Tensor:
        """The visual embedding of the rows: each patch's (row, column, channel) features of the latent and the
        call's c_concat channels after it (both packed channel-major), or for a video file without them zero
        condition channels and a zero mask (text-to-video, as diffusers' pipeline gives them)."""
        x = tokens.to(self.device, self.dtype).unflatten(-1, (-1, math.prod(PATCH))).transpose(-1, -2)
        if self.config.visual_cond and x.shape[-1] == self.config.latent_dim:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], self.config.concat_channels)], dim=-1)
        return self.model.visual_embeddings.in_layer(x.flatten(-2))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.text_embeddings(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, thw=None) -> torch.Tensor:
        """[N, time_dim]: the sinusoid of t (sigma x 1000) in float32, then the model's dtype (ComfyUI's
        TimeEmbeddings), plus the pooled CLIP-L vector's projection."""
        m = self.model.time_embeddings
        args = torch.outer(t.to(self.device).float().flatten(), _freqs(self.config.hidden_size).to(self.device))
        sinusoid = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.dtype)
        temb = m.out_layer(F.silu(m.in_layer(sinusoid)))
        return temb + self.model.pooled_text_embeddings(pooled.to(self.device, self.dtype))

    def refined_prompt(self, text: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The text blocks over the whole embedded prompt at this pass's embedding (kept for the pass's other
        run_blocks calls: PipeFusion's patches and stages of one step)."""
        held = self._refined
        if held is None or held[0] is not text or held[1] is not temb:
            pos = torch.arange(text.shape[1], dtype=torch.float32)
            rope = _rope(torch.outer(pos, _freqs(self.config.head_dim))).to(self.device)
            refined = text
            for block in self.model.text_transformer_blocks:
                refined = block(refined, temb, rope)
            self._refined = held = (text, temb, refined)
        return held[2]

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope, chunk: int = 0) -> tuple:
        """diffusers' decoder blocks over this rank's rows; the embedded prompt passes on unrefined (each stage
        refines it itself)."""
        prompt = text.rows if isinstance(text, RefinedPrompt) else self.refined_prompt(text, temb)
        for i in self.chunks[chunk]:
            if i not in self.skip:
                image = self.model.visual_transformer_blocks[i](image, prompt, temb, rope[0], None)
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """The out layer over the rows held: float32 velocities as packed patches (channel, row, column)."""
        m = self.model.out_layer
        shift, scale = m.modulation(temb).unsqueeze(1).chunk(2, dim=-1)
        x = (m.norm(image.float()) * (scale.float() + 1.0) + shift.float()).to(image.dtype)
        return m.out_layer(x).float()


def block_inputs(config: Kandinsky5Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (video rows, refined prompt, temb, RoPE of a one-frame grid) of one block call."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    cols = max(1, math.isqrt(image))
    rows = torch.arange(image)
    position = (torch.zeros(image), rows // cols, rows % cols)
    angles = torch.cat([torch.outer(p.float(), _freqs(d)) for p, d in zip(position, config.axes_dims)], dim=-1)
    return (rand(1, image, config.hidden_size), RefinedPrompt(rand(1, text, config.hidden_size)),
            rand(1, config.time_dim), (_rope(angles),))


KANDINSKY5 = DiTFamily(
    name="kandinsky5", title="Kandinsky 5 (text-to-video, text-to-image)", match=match_layout,
    infer_config=infer_config, meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=Kandinsky5Adapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="original", replace_keys=("double_block",), block_inputs=block_inputs,
    tensor_plan=tensor_plan)
