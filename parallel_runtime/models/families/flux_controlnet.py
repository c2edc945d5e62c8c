"""Flux ControlNets (XLabs, Mistoline, InstantX and InstantX Union) as the workers run them.

The file is ComfyUI's own ControlNetFlux state dict (the host exports the ControlNet that ControlNetLoader
built, so every format arrives in one layout): Flux's embedders and a few double / single blocks under
BFL names, a `controlnet_blocks` / `controlnet_single_blocks` projection per block, `pos_embed_input` for the
hint tokens, and either a conv stack that turns the hint image into latent-sized features (`input_hint_block`,
Mistoline's `input_cond_block`) or none (InstantX: the hint is a VAE latent already).

Its blocks are Flux blocks, so they run through `FluxAdapter` (flux_adapter.FluxControlNetAdapter) with the
job's attention strategy: under Ulysses and Ring the ControlNet's tokens split exactly like the DiT's, and each
rank gets the residuals of the image rows it holds. `residual_index` reproduces ComfyUI's repetition of the residuals over the DiT's
blocks (comfy/ldm/flux/controlnet.py: 19 double and 38 single slots, tiled or stretched).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...weights.keymap import block_count
from ...weights.mapping import build_from_map
from . import flux

# ComfyUI's ControlNetFlux: how many DiT blocks its residual lists cover (main_model_double / _single).
MAIN_DOUBLE, MAIN_SINGLE = 19, 38
# The stride-2 convolutions of the hint encoders (index in their nn.Sequential): three halvings, 8x down.
HINT_STRIDES = {"input_hint_block": (4, 8, 12), "input_cond_block.encoder": (6, 10, 14)}
# Attention layer ids of ControlNet k start here, so PipeFusion's stale K/V never mixes them with the DiT's.
LAYER_BASE = 1_000_000


@dataclass(frozen=True)
class ControlNetConfig:
    flux: flux.FluxConfig  # the ControlNet's own blocks and embedders
    hint_encoder: str | None  # the conv stack's key prefix; None: the hint is a latent (InstantX)
    hint_channels: int  # pos_embed_input's input width (packed 2x2 tokens)
    union_modes: int  # InstantX Union's control types (0: not a union model)
    mistoline: bool  # its residual projections are Linear + SiLU

    @property
    def hidden_size(self) -> int:
        return self.flux.hidden_size

    @property
    def axes_dims_rope(self) -> tuple[int, int, int]:
        return self.flux.axes_dims_rope

    @property
    def double(self) -> int:
        return self.flux.num_layers

    @property
    def single(self) -> int:
        return self.flux.num_single_layers

    @property
    def outputs(self) -> int:
        """Residual tensors one pass yields: one per ControlNet block."""
        return self.double + self.single

    def residual_index(self, main_double: int, main_single: int) -> dict[int, int]:
        """DiT block index (double blocks, then single ones, as the adapters order them) -> which of this
        ControlNet's outputs ComfyUI adds after it. A latent-input ControlNet (InstantX) stretches each residual
        over consecutive blocks; the others repeat the whole list."""
        out = {}
        for slots, count, first, offset, main in ((MAIN_DOUBLE, self.double, 0, 0, main_double),
                                                  (MAIN_SINGLE, self.single, main_double, self.double, main_single)):
            if count == 0:
                continue
            repeat = math.ceil(slots / count)
            for i in range(min(slots, main)):
                out[first + i] = offset + (i // repeat if self.hint_encoder is None else i % count)
        return out


def read_config(reader) -> ControlNetConfig:
    """The ControlNet's config from its tensor names and shapes."""
    name = os.path.basename(getattr(reader, "path", "controlnet"))
    keys = set(reader.keys())
    if "img_in.weight" not in keys or "pos_embed_input.weight" not in keys:
        raise ModelFileError(f"{name} is not a Flux ControlNet (no img_in / pos_embed_input); load a Flux "
                             f"ControlNet with ControlNetLoader.")
    n_double = block_count(keys, "", "double_blocks", name)
    n_single = block_count(keys, "", "single_blocks", name)
    hidden, in_ch = reader.shape("img_in.weight")
    norm = "double_blocks.0.img_attn.norm.query_norm.scale" if n_double else "single_blocks.0.norm.query_norm.scale"
    mlp = (reader.shape("double_blocks.0.img_mlp.0.weight")[0] if n_double
           else reader.shape("single_blocks.0.linear1.weight")[0] - 3 * hidden)
    head_dim = reader.shape(norm)[0]
    config = flux.FluxConfig(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim, num_layers=n_double,
                             num_single_layers=n_single, in_channels=in_ch, context_dim=reader.shape("txt_in.weight")[1],
                             pooled_dim=reader.shape("vector_in.in_layer.weight")[1],
                             guidance_embeds="guidance_in.in_layer.weight" in keys, mlp_ratio=mlp / hidden)
    encoder = next((p for p in HINT_STRIDES if f"{p}.0.weight" in keys), None)
    modes = reader.shape("controlnet_mode_embedder.weight")[0] if "controlnet_mode_embedder.weight" in keys else 0
    return ControlNetConfig(config, encoder, reader.shape("pos_embed_input.weight")[1], modes,
                            mistoline="controlnet_blocks.0.linear.weight" in keys)


class _Projection(torch.nn.Module):
    """One residual projection: Linear, or Mistoline's Linear + SiLU."""

    def __init__(self, linear: torch.nn.Linear, silu: bool):
        super().__init__()
        self.linear, self.silu = linear, silu

    def forward(self, x):
        y = self.linear(x)
        return torch.nn.functional.silu(y) if self.silu else y


def _linear(reader, key: str, dtype, device) -> torch.nn.Linear:
    weight = reader.read(f"{key}.weight", dtype=dtype, device=device)
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=f"{key}.bias" in reader, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        layer.bias = torch.nn.Parameter(reader.read(f"{key}.bias", dtype=dtype, device=device), requires_grad=False)
    return layer


def _hint_encoder(reader, prefix: str, dtype, device) -> torch.nn.Sequential:
    """ComfyUI's conv stack (convs at even indices, SiLU between), rebuilt from the file's shapes."""
    layers, index = [], 0
    while f"{prefix}.{index}.weight" in reader:
        weight = reader.read(f"{prefix}.{index}.weight", dtype=dtype, device=device)
        k = weight.shape[-1]
        conv = torch.nn.Conv2d(weight.shape[1], weight.shape[0], k, padding=k // 2,
                               stride=2 if index in HINT_STRIDES[prefix] else 1, device="meta")
        conv.weight = torch.nn.Parameter(weight, requires_grad=False)
        conv.bias = torch.nn.Parameter(reader.read(f"{prefix}.{index}.bias", dtype=dtype, device=device), requires_grad=False)
        layers += [torch.nn.SiLU(), conv] if layers else [conv]
        index += 2
    return torch.nn.Sequential(*layers)


class FluxControlNet(torch.nn.Module):
    """The ControlNet's weights: a Flux transformer without its head, plus the ControlNet's own layers."""

    def __init__(self, config: ControlNetConfig, reader, dtype: torch.dtype, device, tensor=None,
                 tensor_plan: dict | None = None):
        """`tensor`, `tensor_plan`: a tensor-parallel rank's split of the transformer's blocks (as the DiT's)."""
        super().__init__()
        self.config = config
        smap = flux.source_map(config.flux, "bfl")
        meta = flux.meta_model(config.flux)
        if tensor is not None:
            smap = tensor.shard(meta, tensor_plan, smap, "Flux ControlNet")
        self.transformer = build_from_map(meta, smap, reader,
                                          ("transformer_blocks", "single_transformer_blocks"), "Flux ControlNet",
                                          owned=lambda n: not n.startswith(("norm_out.", "proj_out.")),
                                          dtype=dtype, device=device)
        self.transformer.eval()

        def projections(name: str, count: int) -> torch.nn.ModuleList:
            key = "{}.{}.linear" if config.mistoline else "{}.{}"
            return torch.nn.ModuleList(_Projection(_linear(reader, key.format(name, i), dtype, device),
                                                   config.mistoline) for i in range(count))

        self.double_projections = projections("controlnet_blocks", config.double)
        self.single_projections = projections("controlnet_single_blocks", config.single)
        self.hint_embedder = _linear(reader, "pos_embed_input", dtype, device)
        self.hint_encoder = (_hint_encoder(reader, config.hint_encoder, dtype, device) if config.hint_encoder
                             else None)
        self.mode_embedder = None
        if config.union_modes:
            weight = reader.read("controlnet_mode_embedder.weight", dtype=dtype, device=device)
            self.mode_embedder = torch.nn.Embedding.from_pretrained(weight, freeze=True)
