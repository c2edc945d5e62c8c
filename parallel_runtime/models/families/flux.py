"""Flux.1 (dev / schnell) checkpoints -> diffusers ``FluxTransformer2DModel``.

This module is only the mapping: detect the key layout of a checkpoint, infer the model
size from tensor shapes, map every diffusers parameter to the (slice of the) checkpoint
tensor it comes from, and build a model that holds only the parameters a rank owns.

Two layouts are understood:

* ``"bfl"``: Black Forest Labs' original keys (``double_blocks.N.img_attn.qkv.weight``, ...),
  as shipped in ``flux1-dev.safetensors`` and used by ComfyUI, optionally prefixed with
  ``model.diffusion_model.`` or ``diffusion_model.``.
* ``"diffusers"``: diffusers' own parameter names, optionally prefixed with ``transformer.``.

The BFL mapping below is our own and works for any width (diffusers' single-file converter
hard-codes the 3072-wide model).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from ...errors import ModelFileError
from ...weights.keymap import Source, block_count, linear, same_names, tensor_shapes
from ..detection import BFL_PREFIXES, DIFFUSERS_PREFIXES
from ..family import BlockKind, TwoBlockListConfig, diffusers_meta_model
from ..shapes import CheckpointShapes

LAYOUTS = ("bfl", "diffusers")

# Width of the sinusoidal timestep / guidance features fed to time_in / guidance_in.
TIME_FEATURES = 256
# Flux's (and Chroma's) two block kinds: both attend jointly; a double block keeps two streams' weights.
DOUBLE_BLOCK = BlockKind("double", ("joint",))
SINGLE_BLOCK = BlockKind("single", ("joint",), fused=True)  # proj_out reads [attention, MLP]: one projection


# ----------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------
def default_axes_dims_rope(head_dim: int) -> tuple[int, int, int]:
    """RoPE axis split for a head: (16, 56, 56) for 128, scaled proportionally otherwise."""
    if head_dim == 128:
        return (16, 56, 56)
    if head_dim % 16 == 0:
        axes = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)
        if all(a % 2 == 0 for a in axes) and sum(axes) == head_dim:
            return axes
    raise ModelFileError(
        f"Attention head size {head_dim} cannot be split into even RoPE axes (head_dim/8, 7*head_dim/16, "
        f"7*head_dim/16); use a Flux checkpoint whose head size is a multiple of 32."
    )


@dataclass(frozen=True)
class FluxConfig(TwoBlockListConfig):
    first_kind, second_kind = DOUBLE_BLOCK, SINGLE_BLOCK  # the pipeline's one list: these, then single blocks
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    in_channels: int = 64
    context_dim: int = 4096
    pooled_dim: int = 768
    guidance_embeds: bool = True
    mlp_ratio: float = 4.0
    axes_dims_rope: tuple[int, int, int] | None = None
    out_channels: int | None = None  # None -> in_channels (differs only for Fill/Depth/Canny)

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ModelFileError(
                f"Flux config is inconsistent: {self.num_heads} heads x {self.head_dim} != hidden size "
                f"{self.hidden_size}; the checkpoint is damaged or not a Flux.1 model, so re-download it."
            )
        axes = self.axes_dims_rope
        if axes is None:
            axes = default_axes_dims_rope(self.head_dim)
        axes = tuple(int(a) for a in axes)
        if len(axes) != 3 or sum(axes) != self.head_dim or any(a % 2 for a in axes):
            raise ModelFileError(
                f"RoPE axes {axes} must be three even sizes summing to head_dim {self.head_dim}; "
                f"fix the Flux config."
            )
        object.__setattr__(self, "axes_dims_rope", axes)
        if self.out_channels is None:
            object.__setattr__(self, "out_channels", self.in_channels)
        object.__setattr__(self, "mlp_ratio", float(self.mlp_ratio))
        object.__setattr__(self, "guidance_embeds", bool(self.guidance_embeds))

    family = "flux"  # models/family.py: which family's functions plan and run this config
    reads_references = True  # Kontext: ReferenceLatent tokens join the image stream (any Flux.1 file reads them)
    text_encoders = "the Flux text encoders (DualCLIPLoader type flux: clip_l and t5xxl)"

    @property
    def variant(self) -> str:
        return "dev" if self.guidance_embeds else "schnell"

    @property
    def title(self) -> str:
        kind = {80: " Fill", 16: " Canny/Depth"}.get(self.concat_channels, "")  # the input's extra channels
        return f"Flux.1{kind} {self.variant}"

    @property
    def latent_channels(self) -> int:
        return self.out_channels // 4  # tokens pack 2x2 patches (Fill/Depth widen only the input)

    @property
    def concat_channels(self) -> int:
        """Channels the model reads beside the latent (c_concat): Fill 80 (masked image 16 + mask 64), Canny and
        Depth 16 (the control image's latent); 0 for text-to-image files."""
        return self.in_channels // 4 - self.latent_channels



    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def diffusers_kwargs(self) -> dict:
        """Keyword arguments for ``FluxTransformer2DModel(**kwargs)``."""
        if self.mlp_ratio != 4.0:
            # diffusers' Flux blocks hard-code a 4x MLP (FeedForward default mult, and the model
            # never forwards mlp_ratio to its single blocks).
            raise ModelFileError(
                f"This Flux checkpoint has MLP ratio {self.mlp_ratio:g}, but diffusers' FluxTransformer2DModel "
                f"only supports 4; choose a standard Flux.1 model."
            )
        return dict(
            patch_size=1,
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            num_layers=self.num_layers,
            num_single_layers=self.num_single_layers,
            attention_head_dim=self.head_dim,
            num_attention_heads=self.num_heads,
            joint_attention_dim=self.context_dim,
            pooled_projection_dim=self.pooled_dim,
            guidance_embeds=self.guidance_embeds,
            axes_dims_rope=self.axes_dims_rope,
        )


# ----------------------------------------------------------------------------------
# Layout detection
# ----------------------------------------------------------------------------------
_NOT_FLUX_1 = re.compile(r"(^|\.)(distilled_guidance_layer\.|double_stream_modulation)")


def match_layout(keys: Iterable[str]) -> tuple[str, str] | None:
    """``(layout, prefix)`` if the keys are a Flux.1 DiT's, else None."""
    keys = list(keys)
    key_set = set(keys)
    # Chroma (a distilled guidance network instead of Flux's modulation layers) and Flux.2 share Flux.1's
    # block names in both layouts: they are other families, not Flux.1 files with tensors missing.
    if any(_NOT_FLUX_1.search(k) for k in keys):
        return None

    def any_block(prefix: str, block: str) -> bool:
        pat = re.compile(re.escape(prefix + block) + r"\.\d+\.")
        return any(pat.match(k) for k in keys)

    for prefix in BFL_PREFIXES:
        if prefix + "img_in.weight" in key_set and (
            any_block(prefix, "double_blocks") or any_block(prefix, "single_blocks")
        ):
            return "bfl", prefix
    for prefix in DIFFUSERS_PREFIXES:
        if prefix + "x_embedder.weight" in key_set and (
            any_block(prefix, "transformer_blocks") or any_block(prefix, "single_transformer_blocks")
        ):
            return "diffusers", prefix
    return None


def detect_layout(keys: Iterable[str], name: str = "checkpoint") -> tuple[str, str]:
    """Return ``(layout, prefix)`` for a Flux DiT checkpoint's keys, else raise ModelFileError."""
    from ..family import describe_keys

    keys = list(keys)
    found = match_layout(keys)
    if found is None:
        raise ModelFileError(f"{name} is not a Flux DiT checkpoint ({describe_keys(keys)}); choose a Flux model "
                             f"from models/diffusion_models.")
    return found


# ----------------------------------------------------------------------------------
# Config inference (shapes only)
# ----------------------------------------------------------------------------------
# The tensors whose shapes give away a Flux config, per checkpoint layout.
_CONFIG_KEYS = {
    "bfl": {"double": "double_blocks", "single": "single_blocks", "img_in": "img_in.weight",
            "txt_in": "txt_in.weight", "vector_in": "vector_in.in_layer.weight",
            "guidance_in": "guidance_in.in_layer.weight", "final": "final_layer.linear.weight",
            "double_q_norm": "double_blocks.0.img_attn.norm.query_norm.scale",
            "double_mlp": "double_blocks.0.img_mlp.0.weight",
            "single_q_norm": "single_blocks.0.norm.query_norm.scale", "single_mlp": "single_blocks.0.linear1.weight"},
    "diffusers": {"double": "transformer_blocks", "single": "single_transformer_blocks",
                  "img_in": "x_embedder.weight", "txt_in": "context_embedder.weight",
                  "vector_in": "time_text_embed.text_embedder.linear_1.weight",
                  "guidance_in": "time_text_embed.guidance_embedder.linear_1.weight", "final": "proj_out.weight",
                  "double_q_norm": "transformer_blocks.0.attn.norm_q.weight",
                  "double_mlp": "transformer_blocks.0.ff.net.0.proj.weight",
                  "single_q_norm": "single_transformer_blocks.0.attn.norm_q.weight",
                  "single_mlp": "single_transformer_blocks.0.proj_mlp.weight"},
}


def infer_config(reader, layout: str | None = None, prefix: str | None = None) -> FluxConfig:
    """Infer a ``FluxConfig`` from tensor names and shapes (no tensor data is read)."""
    name = os.path.basename(getattr(reader, "path", "checkpoint"))
    keys = reader.keys()
    if layout is None or prefix is None:
        layout, prefix = detect_layout(keys, name)
    p = prefix

    shape = tensor_shapes(reader, p, name, "a complete Flux.1 (dev/schnell) DiT",
                          "re-download it or choose a Flux.1 model")

    if layout not in _CONFIG_KEYS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    k = _CONFIG_KEYS[layout]
    n_double = block_count(keys, p, k["double"], name)
    n_single = block_count(keys, p, k["single"], name)
    hidden, in_ch = shape(k["img_in"])
    context_dim = shape(k["txt_in"])[1]
    pooled_dim = shape(k["vector_in"])[1]
    guidance = p + k["guidance_in"] in reader
    out_ch = shape(k["final"])[0]
    if n_double:
        head_dim = shape(k["double_q_norm"])[0]
        mlp_hidden = shape(k["double_mlp"])[0]
    else:
        head_dim = shape(k["single_q_norm"])[0]
        mlp_hidden = shape(k["single_mlp"])[0] - (3 * hidden if layout == "bfl" else 0)  # BFL fuses qkv+mlp

    if head_dim <= 0 or hidden % head_dim:
        raise ModelFileError(
            f"{name}: hidden size {hidden} is not a multiple of the attention head size {head_dim}; "
            f"the file is not a valid Flux.1 DiT, so re-download it."
        )
    return FluxConfig(
        hidden_size=hidden,
        num_heads=hidden // head_dim,
        head_dim=head_dim,
        num_layers=n_double,
        num_single_layers=n_single,
        in_channels=in_ch,
        context_dim=context_dim,
        pooled_dim=pooled_dim,
        guidance_embeds=guidance,
        mlp_ratio=mlp_hidden / hidden,
        out_channels=out_ch,
    )


# ----------------------------------------------------------------------------------
# Key mapping
# ----------------------------------------------------------------------------------
def diffusers_param_names(config: FluxConfig) -> list[str]:
    """Every parameter name of ``FluxTransformer2DModel(**config.diffusers_kwargs())`` (built on meta)."""
    return list(meta_model(config).state_dict().keys())


def map_double_block(out: dict, d: str, b: str, H: int, M: int, modulation: bool = True) -> None:
    """One double-stream block, BFL `b` -> diffusers `d` (Chroma's blocks are the same without modulation)."""
    q, k, v = slice(0, H), slice(H, 2 * H), slice(2 * H, 3 * H)
    if modulation:
        linear(out, f"{d}.norm1.linear", f"{b}.img_mod.lin")
        linear(out, f"{d}.norm1_context.linear", f"{b}.txt_mod.lin")
    for dst, rows in (("to_q", q), ("to_k", k), ("to_v", v)):
        linear(out, f"{d}.attn.{dst}", f"{b}.img_attn.qkv", rows)
    for dst, rows in (("add_q_proj", q), ("add_k_proj", k), ("add_v_proj", v)):
        linear(out, f"{d}.attn.{dst}", f"{b}.txt_attn.qkv", rows)
    out[f"{d}.attn.norm_q.weight"] = Source(f"{b}.img_attn.norm.query_norm.scale")
    out[f"{d}.attn.norm_k.weight"] = Source(f"{b}.img_attn.norm.key_norm.scale")
    out[f"{d}.attn.norm_added_q.weight"] = Source(f"{b}.txt_attn.norm.query_norm.scale")
    out[f"{d}.attn.norm_added_k.weight"] = Source(f"{b}.txt_attn.norm.key_norm.scale")
    linear(out, f"{d}.attn.to_out.0", f"{b}.img_attn.proj")
    linear(out, f"{d}.attn.to_add_out", f"{b}.txt_attn.proj")
    linear(out, f"{d}.ff.net.0.proj", f"{b}.img_mlp.0")
    linear(out, f"{d}.ff.net.2", f"{b}.img_mlp.2")
    linear(out, f"{d}.ff_context.net.0.proj", f"{b}.txt_mlp.0")
    linear(out, f"{d}.ff_context.net.2", f"{b}.txt_mlp.2")


def map_single_block(out: dict, s: str, b: str, H: int, M: int, modulation: bool = True) -> None:
    """One single-stream block: BFL fuses q/k/v and the MLP's input projection into `linear1`."""
    q, k, v = slice(0, H), slice(H, 2 * H), slice(2 * H, 3 * H)
    if modulation:
        linear(out, f"{s}.norm.linear", f"{b}.modulation.lin")
    for dst, rows in (("to_q", q), ("to_k", k), ("to_v", v)):
        linear(out, f"{s}.attn.{dst}", f"{b}.linear1", rows)
    linear(out, f"{s}.proj_mlp", f"{b}.linear1", slice(3 * H, 3 * H + M))
    linear(out, f"{s}.proj_out", f"{b}.linear2")
    out[f"{s}.attn.norm_q.weight"] = Source(f"{b}.norm.query_norm.scale")
    out[f"{s}.attn.norm_k.weight"] = Source(f"{b}.norm.key_norm.scale")


def source_map(config: FluxConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    """Map every diffusers parameter name to its ``Source`` in a checkpoint of ``layout``."""
    if layout == "diffusers":
        return same_names(diffusers_param_names(config), prefix)
    if layout != "bfl":
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")

    p = prefix
    H = config.hidden_size
    M = config.mlp_hidden
    out: dict[str, Source] = {}

    linear(out, "x_embedder", p + "img_in")
    linear(out, "context_embedder", p + "txt_in")
    linear(out, "time_text_embed.timestep_embedder.linear_1", p + "time_in.in_layer")
    linear(out, "time_text_embed.timestep_embedder.linear_2", p + "time_in.out_layer")
    if config.guidance_embeds:
        linear(out, "time_text_embed.guidance_embedder.linear_1", p + "guidance_in.in_layer")
        linear(out, "time_text_embed.guidance_embedder.linear_2", p + "guidance_in.out_layer")
    linear(out, "time_text_embed.text_embedder.linear_1", p + "vector_in.in_layer")
    linear(out, "time_text_embed.text_embedder.linear_2", p + "vector_in.out_layer")

    for i in range(config.num_layers):
        map_double_block(out, f"transformer_blocks.{i}", f"{p}double_blocks.{i}", H, M)
    for i in range(config.num_single_layers):
        map_single_block(out, f"single_transformer_blocks.{i}", f"{p}single_blocks.{i}", H, M)
    linear(out, "norm_out.linear", p + "final_layer.adaLN_modulation.1", transform="swap_halves")
    linear(out, "proj_out", p + "final_layer.linear")
    return out


def bfl_tensor_shapes(config: FluxConfig, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """``{bfl_key: (shape, kind)}`` in a fixed order; kind is "weight", "mod", "bias" or "norm"."""
    H, M, hd = config.hidden_size, config.mlp_hidden, config.head_dim
    out = CheckpointShapes(prefix)
    linear = out.linear

    def norm(name: str) -> None:
        out.norm(name, hd, "scale")

    linear("img_in", H, config.in_channels)
    linear("time_in.in_layer", H, TIME_FEATURES)
    linear("time_in.out_layer", H, H)
    linear("vector_in.in_layer", H, config.pooled_dim)
    linear("vector_in.out_layer", H, H)
    if config.guidance_embeds:
        linear("guidance_in.in_layer", H, TIME_FEATURES)
        linear("guidance_in.out_layer", H, H)
    linear("txt_in", H, config.context_dim)
    for i in range(config.num_layers):
        b = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            linear(f"{b}.{stream}_mod.lin", 6 * H, H, "mod")
            linear(f"{b}.{stream}_attn.qkv", 3 * H, H)
            norm(f"{b}.{stream}_attn.norm.query_norm")
            norm(f"{b}.{stream}_attn.norm.key_norm")
            linear(f"{b}.{stream}_attn.proj", H, H)
            linear(f"{b}.{stream}_mlp.0", M, H)
            linear(f"{b}.{stream}_mlp.2", H, M)
    for i in range(config.num_single_layers):
        b = f"single_blocks.{i}"
        linear(f"{b}.linear1", 3 * H + M, H)
        linear(f"{b}.linear2", H, H + M)
        norm(f"{b}.norm.query_norm")
        norm(f"{b}.norm.key_norm")
        linear(f"{b}.modulation.lin", 3 * H, H, "mod")
    linear("final_layer.linear", config.out_channels, H)
    linear("final_layer.adaLN_modulation.1", 2 * H, H, "mod")
    return out


# ----------------------------------------------------------------------------------
# Building (the family object, FLUX, and load_flux live beside the adapter in flux_adapter.py)
# ----------------------------------------------------------------------------------
meta_model = diffusers_meta_model("FluxTransformer2DModel")  # config -> the model on the meta device


def match(keys: list[str]):
    from ..family import Match

    found = match_layout(keys)
    return None if found is None else Match(*found)
