"""SD3 / SD3.5 ControlNets (InstantX's SD3 ControlNets and their kin) as the workers run them.

The file is ComfyUI's own comfy.cldm.mmdit.ControlNet state dict (the host exports the ControlNet that
ControlNetLoader built from a diffusers-layout SD3ControlNetModel file): an MMDiT's embedders and a few joint blocks
under ComfyUI's names (`joint_blocks.N.x_block...`, every block with a whole text stream), a `controlnet_blocks.N`
projection per block and `pos_embed_input`, a patch embedding of the hint, which is a VAE latent (16 channels; 17
for an inpainting ControlNet, whose mask rides along).

Its blocks are SD3 blocks, so they run through `SD3Adapter` with the job's attention strategy: under Ulysses and
Ring the ControlNet's [text, image] sequence splits exactly like the DiT's and each rank gets the residuals of the
image rows it holds. What ComfyUI's ControlNet does that diffusers' pipeline does not: its pooled input is zeroed
(`y = zeros_like(y)`: the y embedding of zeros still adds its biases), its image embedding adds the centre-cropped
position table of its own, and `residual_index` repeats its residuals over the DiT's blocks as ComfyUI lists them
(each block's output `depth // blocks` times, one fewer for the last, depth = width / 64; the DiT adds entry i after
its block i, to every image row).
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...weights.keymap import linear
from ...weights.mapping import build_from_map
from ..family import Match, derived_tensor_plan, modulation_plan
from . import sd3
from .flux_adapter import patch_conv
from .flux_controlnet import LAYER_BASE

BLOCK_LISTS = ("transformer_blocks",)


@dataclass(frozen=True)
class SD3ControlNetConfig:
    sd3: sd3.SD3Config  # the ControlNet's own blocks and embedders
    hint_channels: int  # pos_embed_input's input channels (the latent's, plus an inpainting ControlNet's mask)
    union_modes = 0  # no union SD3 ControlNets
    axes_dims_rope = None  # absolute positions, as the DiT's

    @property
    def hidden_size(self) -> int:
        return self.sd3.hidden_size

    @property
    def outputs(self) -> int:
        """Residual tensors one pass yields: one per ControlNet block."""
        return self.sd3.num_layers

    def residual_index(self, main_double: int, main_single: int = 0) -> dict[int, int]:
        """DiT block index -> which of this ControlNet's outputs ComfyUI adds after it: comfy.cldm.mmdit lists each
        block's output `depth // blocks` times (one fewer for the last block), depth being its width / 64."""
        count = (self.hidden_size // sd3.HEAD_DIM) // self.outputs
        listed = self.outputs * count - 1 if count else 0
        return {i: i // count for i in range(min(listed, main_double))}


def read_config(reader) -> SD3ControlNetConfig:
    """The ControlNet's config from its tensor names and shapes."""
    name = os.path.basename(getattr(reader, "path", "controlnet"))
    keys = set(reader.keys())
    if not {"x_embedder.proj.weight", "pos_embed_input.proj.weight", "controlnet_blocks.0.weight",
            "joint_blocks.0.context_block.attn.qkv.weight"} <= keys:
        raise ModelFileError(f"{name} is not an SD3 ControlNet (no joint blocks / pos_embed_input); load an SD3 "
                             f"ControlNet (InstantX's SD3 ControlNets) with ControlNetLoader.")
    config = sd3.infer_config(reader, Match("original", ""), name)
    return SD3ControlNetConfig(config, reader.shape("pos_embed_input.proj.weight")[1])


def controlnet_shapes(config: SD3ControlNetConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of an SD3 ControlNet, for writing random test checkpoints."""
    h, p = config.hidden_size, config.sd3.patch_size
    out = sd3.checkpoint_shapes(config.sd3, controlnet=True)
    for i in range(config.outputs):
        out[f"controlnet_blocks.{i}.weight"], out[f"controlnet_blocks.{i}.bias"] = ((h, h), "weight"), ((h,), "bias")
    out["pos_embed_input.proj.weight"] = ((h, config.hint_channels, p, p), "weight")
    out["pos_embed_input.proj.bias"] = ((h,), "bias")
    return out


def meta_model(config: SD3ControlNetConfig) -> torch.nn.Module:
    """diffusers' SD3ControlNetModel on the meta device: its blocks are the DiT's (without the pre-only one)."""
    from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetModel

    kwargs = config.sd3.diffusers_kwargs()
    with torch.device("meta"):
        return SD3ControlNetModel(**kwargs, extra_conditioning_channels=config.hint_channels - config.sd3.in_channels)


def source_map(config: SD3ControlNetConfig) -> dict:
    """Every SD3ControlNetModel parameter -> its key in ComfyUI's layout."""
    out = sd3.source_map(config.sd3, "original", controlnet=True)
    for i in range(config.outputs):
        linear(out, f"controlnet_blocks.{i}", f"controlnet_blocks.{i}")
    linear(out, "pos_embed_input.proj", "pos_embed_input.proj")
    return out


class SD3ControlNetAdapter(sd3.SD3Adapter):
    """What the strategies call on a loaded SD3 ControlNet: the hint's tokens (once per hint), its image, text and
    time embeddings, and one pass over its blocks that returns a residual per block for this rank's image rows."""

    reads_types = False  # no union SD3 ControlNets

    def __init__(self, model, config: SD3ControlNetConfig, context):
        self.net, self.control = model, config
        # One chunk per block, so `residuals` can project each block's output.
        super().__init__(config.sd3, model, [range(i, i + 1) for i in range(config.outputs)], context)
        self.hint_cache: collections.OrderedDict = collections.OrderedDict()  # hint key -> tokens, kept by strategies

    def use_layers(self, position: int) -> None:
        """Attention layer ids for the ControlNet at `position` of a chain: past the DiT's, and apart for each use,
        so PipeFusion's stale K/V of one use is never another's."""
        base = LAYER_BASE * (position + 1)
        for i, block in enumerate(self.model.transformer_blocks):
            for attn in (block.attn, block.attn2):
                if attn is not None:
                    attn.processor.layer = base + i

    def hint_tokens(self, hint: torch.Tensor) -> torch.Tensor:
        """pos_embed_input of the hint latent as tokens [B, N, hidden] (padded circularly to whole patches, as
        ComfyUI's PatchEmbed pads)."""
        p = self.patch
        hint = hint.to(self.device, self.dtype)
        hint = torch.nn.functional.pad(hint, (0, (-hint.shape[-1]) % p, 0, (-hint.shape[-2]) % p), mode="circular")
        return patch_conv(self.pack(hint), self.model.pos_embed_input.proj)

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """t_embedder(t) + y_embedder(0): ComfyUI's SD3 ControlNet zeroes its pooled input."""
        return super().timestep_embedding(t, torch.zeros_like(pooled), guidance, hw)

    def embed_control_image(self, x_tokens: torch.Tensor, hint_rows: torch.Tensor, index: torch.Tensor,
                            hw: tuple[int, int]) -> torch.Tensor:
        """x_embedder(x) + the ControlNet's own position rows + the hint's rows."""
        return self.embed_image(x_tokens, index, hw) + hint_rows

    def residuals(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope) -> list[torch.Tensor]:
        """One residual per ControlNet block, for the image rows of `image`."""
        out = []
        for k, projection in enumerate(self.model.controlnet_blocks):
            image, text = self.run_blocks(image, text, temb, rope, chunk=k)
            out.append(projection(image))
        return out


def load_controlnet(reader, dtype: torch.dtype, device, context, tensor=None) -> SD3ControlNetAdapter:
    """An SD3 ControlNet file (ComfyUI's layout) built on `device`, its attention on the worker's `context`;
    `tensor`: a tensor-parallel rank's split, cutting its blocks as the DiT's are cut."""
    config = read_config(reader)
    meta, smap = meta_model(config), source_map(config)
    if tensor is not None:
        plan = {**modulation_plan(meta, BLOCK_LISTS), **derived_tensor_plan(meta, BLOCK_LISTS)}
        smap = tensor.shard(meta, plan, smap, "SD3 ControlNet")
    model = build_from_map(meta, smap, reader, BLOCK_LISTS, "SD3 ControlNet", dtype=dtype, device=device)
    model.eval()
    return SD3ControlNetAdapter(model, config, context)
