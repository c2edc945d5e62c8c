"""Qwen-Image (and Qwen-Image Edit, the same architecture): an MMDiT of double-stream blocks only.

Like Flux's double blocks (joint attention over [text, image], RoPE on both streams), but: the text is
RMS-normed before its projection; one timestep embedding (no pooled text, no guidance) modulates every
block and the head; RoPE ids are centred on the image, with the text placed on the diagonal after the
image's half-extent; the latent is Wan 2.1's (per-channel mean/std, 5D in ComfyUI). Edit's reference
latents join the image stream like Kontext's, each centred on its own grid, by default at index 1, 2, ...

ControlNets (InstantX's, ComfyUI's QwenImageControlNetModel) run beside the blocks: see qwen_image_controlnet.py.

Blocks are diffusers' `QwenImageTransformer2DModel` blocks with our attention processor. diffusers' own
RoPE differs from ComfyUI's (fp32 angles, and a different centre for odd grids), so the RoPE table is built
here from ComfyUI's ids with Flux's float64 `FluxPosEmbed`. Checkpoint keys are diffusers' names in both
ComfyUI's and diffusers' files (optionally prefixed).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...sampling import WAN21_LATENT, model_sampling_for
from ...strategies.attention.processor import ParallelFluxAttnProcessor
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..detection import BFL_PREFIXES, Signature, signature_match
from ..family import DiTFamily, Match, OneBlockListConfig, diffusers_meta_model
from ..patchify import PatchTokens
from ..rope import grid_ids, rope_table
from ..shapes import CheckpointShapes
from .flux import default_axes_dims_rope
from .flux_adapter import block_inputs, reference_placements

ALWAYS_OWNED = ("time_text_embed.",)
FIRST_STAGE = ("img_in.", "txt_norm.", "txt_in.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("transformer_blocks",)
PREFIXES = BFL_PREFIXES + ("transformer.",)


@dataclass(frozen=True)
class QwenImageConfig(OneBlockListConfig):
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int
    in_channels: int = 64
    out_channels: int = 16
    context_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] | None = None

    family = "qwen_image"
    title = "Qwen-Image"
    variant = "dev"  # ModelSamplingFlux, shift 1.15 (supported_models.QwenImage)
    pooled_dim = 0
    reads_references = True  # Qwen-Image Edit's ReferenceLatent
    text_encoders = "the Qwen-Image text encoder (CLIPLoader type qwen_image: qwen_2.5_vl_7b)"

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ModelFileError(f"Qwen-Image config is inconsistent: {self.num_heads} heads x {self.head_dim} != "
                                 f"hidden size {self.hidden_size}; the file is damaged, so re-download it.")
        axes = tuple(self.axes_dims_rope or default_axes_dims_rope(self.head_dim))
        object.__setattr__(self, "axes_dims_rope", axes)

    @property
    def latent_channels(self) -> int:
        return self.out_channels

    latent_dimensions = 3  # Wan 2.1's latent: ComfyUI samples it as [B, C, 1, H, W]

    def diffusers_kwargs(self) -> dict:
        return dict(patch_size=2, in_channels=self.in_channels, out_channels=self.out_channels,
                    num_layers=self.num_layers, attention_head_dim=self.head_dim,
                    num_attention_heads=self.num_heads, joint_attention_dim=self.context_dim,
                    axes_dims_rope=self.axes_dims_rope)


# -- checkpoint layout --------------------------------------------------------------------------------

# `txt_norm.weight` beside `img_in` and double blocks: what ComfyUI's detection keys Qwen-Image on.
match_layout = signature_match(Signature("diffusers", ("txt_norm.weight", "img_in.weight"), BLOCK_LISTS, PREFIXES))


def infer_config(reader, match: Match, name: str) -> QwenImageConfig:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))

    shape = tensor_shapes(reader, p, name, "a complete Qwen-Image DiT")

    if p + "txt_in.text_norm.weight" in reader:
        raise ModelFileError(f"{name} is a newer Qwen-Image release (txt_in.text_norm) ParaDiT does not run yet; "
                             f"choose Qwen-Image or Qwen-Image Edit.")
    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ModelFileError(f"{name}: width {hidden} is not a multiple of the head size {head_dim}; re-download it.")
    return QwenImageConfig(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim,
                           num_layers=block_count(reader.keys(), p, "transformer_blocks", name),
                           in_channels=in_channels, out_channels=shape("proj_out.weight")[0] // 4,
                           context_dim=shape("txt_in.weight")[1])


_diffusers_model = diffusers_meta_model("QwenImageTransformer2DModel")


def tensor_plan(config: QwenImageConfig) -> dict:
    """diffusers' tensor-parallel plan for Qwen-Image's blocks, plus their modulations (Sequential(SiLU, Linear))
    gathered, as the seam's modulation_plan gathers diffusers' AdaLayerNormZero ones."""
    from diffusers import QwenImageTransformer2DModel

    return {**QwenImageTransformer2DModel._tp_plan, "transformer_blocks.*.img_mod.1": "gather",
            "transformer_blocks.*.txt_mod.1": "gather"}


def source_map(config: QwenImageConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    """ComfyUI's and diffusers' files both use diffusers' names (single_file_model maps them 1:1)."""
    return same_names((n for n, _ in _diffusers_model(config).named_parameters()), prefix)


def checkpoint_shapes(config: QwenImageConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, kind)} of a Qwen-Image file, for writing random test checkpoints."""
    H, D, M = config.hidden_size, config.head_dim, config.mlp_hidden
    out = CheckpointShapes()
    lin = out.linear
    lin("img_in", H, config.in_channels)
    out.norm("txt_norm", config.context_dim)
    lin("txt_in", H, config.context_dim)
    lin("time_text_embed.timestep_embedder.linear_1", H, 256)
    lin("time_text_embed.timestep_embedder.linear_2", H, H)
    for i in range(config.num_layers):
        b = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):
            lin(f"{b}.{stream}_mod.1", 6 * H, H, "mod")
            lin(f"{b}.{stream}_mlp.net.0.proj", M, H)
            lin(f"{b}.{stream}_mlp.net.2", H, M)
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            lin(f"{b}.attn.{proj}", H, H)
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            out.norm(f"{b}.attn.{norm}", D)
    lin("norm_out.linear", 2 * H, H, "mod")
    lin("proj_out", 4 * config.out_channels, H)
    return out


# -- the strategies' view -----------------------------------------------------------------------------

class QwenImageAdapter(PatchTokens, BlockLoop):
    latent_channels = 16
    patch = 2  # (c, ph, pw) per token, as comfy's process_img packs
    latent_format = WAN21_LATENT
    default_guidance = 0.0  # no guidance input

    def __init__(self, config: QwenImageConfig, model, chunks: list[range], context):
        self.config, self.model, self.chunks = config, model, chunks
        for i in (i for chunk in chunks for i in chunk):
            model.transformer_blocks[i].attn.set_processor(ParallelFluxAttnProcessor(i, context))
        self.dtype, self.device = compute_placement(model.time_text_embed)

    @functools.cached_property
    def model_sampling(self):
        return model_sampling_for(self.config.variant)

    def rope(self, text_len: int, h: int, w: int, references: tuple[tuple[int, int], ...] = (),
             method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for [text, image, references] with comfy/ldm/qwen_image's ids: every grid centred on itself,
        the text on the diagonal from max(rows, cols) // 2; references at index 1, 2, ... ("index", the
        default) or tiled at index 1 (any other method, as ComfyUI's Qwen treats them)."""
        rows, cols = (h + 1) // 2, (w + 1) // 2
        start = max(rows // 2, cols // 2)
        ids = [torch.arange(start, start + text_len, dtype=torch.float32)[:, None].expand(text_len, 3),
               grid_ids(rows, cols, 0, -(rows // 2), -(cols // 2))]
        method = "index" if method in (None, "index") else "offset"
        for r, c, index, off_r, off_c in reference_placements((h, w), references, method):
            ids.append(grid_ids(r, c, index, off_r - r // 2, off_c - c // 2))
        return rope_table(torch.cat(ids).to(self.device), self.config.axes_dims_rope)

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        return self.model.img_in(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.txt_in(self.model.txt_norm(cond.to(self.device, self.dtype)))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """Timesteps(256, flip_sin_to_cos, scale 1000) of t (= sigma x the sampling's multiplier, 1 unless a
        shift node says otherwise) in float32 as model_base passes it, then the MLP in the compute dtype. pooled
        and guidance are unused: Qwen-Image has neither."""
        t = t.to(self.device, torch.float32)
        return self.model.time_text_embed(t, torch.empty(0, dtype=self.dtype, device=self.device))

    def block(self, i: int, image, text, temb, rope) -> tuple:
        """A double block (BlockLoop adds ControlNet residuals to the image rows, before Edit's reference rows)."""
        text, image = self.model.transformer_blocks[i](hidden_states=image, encoder_hidden_states=text,
                                                       encoder_hidden_states_mask=None, temb=temb,
                                                       image_rotary_emb=rope)
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """Velocity in float32, (c, ph, pw) per token as pack's layout."""
        return self.model.proj_out(self.model.norm_out(image, temb)).float()


QWEN_IMAGE = DiTFamily(
    name="qwen_image", title="Qwen-Image (and Edit)", match=match_layout, infer_config=infer_config,
    meta_model=_diffusers_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=QwenImageAdapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="diffusers", block_inputs=block_inputs, tensor_plan=tensor_plan)
