"""SD3 / SD3.5 ControlNets as the workers run them: InstantX's SD3 ControlNets and Stability's SD3.5 ones.

The host exports the ControlNet that ControlNetLoader built, so each kind arrives in ComfyUI's own layout.

InstantX's (comfy.cldm.mmdit.ControlNet, from a diffusers-layout SD3ControlNetModel file): an MMDiT's embedders and
a few joint blocks
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

Stability's SD3.5 ControlNets (comfy.cldm.dit_embedder.ControlNetEmbedder, ControlNetSD35): image-only blocks (a
DiT block without the text stream: diffusers' SD3SingleTransformerBlock, here on the job's image-only attention),
the pooled vector embedded as the DiT embeds it, each block's output repeated ceil(depth / blocks) times. Part of
it is the DiT's own (ComfyUI's ControlNetSD35.pre_run copies it in): the DiT's x embedder, with a sin-cos position
table added; or, for a "double y" ControlNet (its y embedder is width x width), the DiT's y embedder in front of its
own, its own x embedder, no positions, and every block reading the same input (the blocks do not chain). The
workers read those layers from their DiT (`load_controlnet`'s `dit`); the host's copy of them is never read.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...weights.keymap import block_count, linear
from ...weights.mapping import build_from_map
from ...weights.storage import compute_placement
from ..family import ControlNetBlocks, Match, derived_tensor_plan, modulation_plan
from ..shapes import CheckpointShapes
from . import sd3
from .flux_adapter import FluxAdapter, patch_conv
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


@dataclass(frozen=True)
class SD35ControlNetConfig:
    """Stability's SD3.5 ControlNet (ComfyUI's ControlNetEmbedder)."""

    hidden_size: int
    num_layers: int
    double_y: bool  # its y embedder reads the DiT's y embedding (width x width) instead of the pooled vector
    pooled_dim: int  # the y embedder's input (the DiT's y embedding width where double_y)
    hint_channels: int
    patch_size: int = 2
    union_modes = 0
    axes_dims_rope = None

    @property
    def num_heads(self) -> int:
        return self.hidden_size // sd3.HEAD_DIM

    @property
    def outputs(self) -> int:
        return self.num_layers

    def residual_index(self, main_double: int, main_single: int = 0) -> dict[int, int]:
        """DiT block i -> output i // repeat: ControlNetEmbedder lists each block's output ceil(depth / blocks)
        times, depth being its width / 64."""
        repeat = -(-(self.hidden_size // sd3.HEAD_DIM) // self.outputs)
        return {i: i // repeat for i in range(min(self.outputs * repeat, main_double))}


def read_config(reader) -> SD3ControlNetConfig | SD35ControlNetConfig:
    """The ControlNet's config from its tensor names and shapes: InstantX's SD3 kind (joint blocks) or Stability's
    SD3.5 kind (image-only blocks)."""
    name = os.path.basename(getattr(reader, "path", "controlnet"))
    keys = set(reader.keys())
    if {"pos_embed_input.proj.weight", "controlnet_blocks.0.weight", "y_embedder.mlp.0.weight",
            "transformer_blocks.0.adaLN_modulation.1.weight"} <= keys:
        hidden, pooled = reader.shape("y_embedder.mlp.0.weight")
        return SD35ControlNetConfig(hidden, block_count(keys, "", "transformer_blocks", name), hidden == pooled,
                                    pooled, reader.shape("pos_embed_input.proj.weight")[1],
                                    reader.shape("pos_embed_input.proj.weight")[-1])
    if not {"x_embedder.proj.weight", "pos_embed_input.proj.weight", "controlnet_blocks.0.weight",
            "joint_blocks.0.context_block.attn.qkv.weight"} <= keys:
        raise ModelFileError(f"{name} is not an SD3 ControlNet (no joint or image blocks with pos_embed_input); "
                             f"load an SD3 / SD3.5 ControlNet with ControlNetLoader.")
    config = sd3.infer_config(reader, Match("original", ""), name)
    return SD3ControlNetConfig(config, reader.shape("pos_embed_input.proj.weight")[1])


def controlnet_shapes(config: SD3ControlNetConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of an SD3 ControlNet, for writing random test checkpoints."""
    h, p = config.hidden_size, config.sd3.patch_size
    out = sd3.checkpoint_shapes(config.sd3, controlnet=True)
    for i in range(config.outputs):
        out.linear(f"controlnet_blocks.{i}", h, h)
    out.conv("pos_embed_input.proj", h, config.hint_channels, p, p)
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


def hint_tokens(adapter, hint: torch.Tensor) -> torch.Tensor:
    """pos_embed_input of a hint latent as tokens [B, N, hidden] (padded circularly to whole patches, as ComfyUI's
    PatchEmbed pads)."""
    p = adapter.patch
    hint = hint.to(adapter.device, adapter.dtype)
    hint = torch.nn.functional.pad(hint, (0, (-hint.shape[-1]) % p, 0, (-hint.shape[-2]) % p), mode="circular")
    return patch_conv(adapter.pack(hint), adapter.model.pos_embed_input.proj)


class SD3ControlNetAdapter(ControlNetBlocks, sd3.SD3Adapter):
    """What the strategies call on a loaded SD3 ControlNet: the hint's tokens (once per hint), its image, text and
    time embeddings, and one pass over its blocks that returns a residual per block for this rank's image rows."""

    reads_types = False  # no union SD3 ControlNets

    def __init__(self, model, config: SD3ControlNetConfig, context):
        self.net, self.control = model, config
        # One chunk per block, so `residuals` can project each block's output.
        super().__init__(config.sd3, model, [range(i, i + 1) for i in range(config.outputs)], context)
        self.projections = model.controlnet_blocks
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
        return hint_tokens(self, hint)

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """t_embedder(t) + y_embedder(0): ComfyUI's SD3 ControlNet zeroes its pooled input."""
        return super().timestep_embedding(t, torch.zeros_like(pooled), guidance, hw)



# -- Stability's SD3.5 ControlNets ---------------------------------------------------------------------------


class _PatchEmbedding(torch.nn.Module):
    """A patch conv (ComfyUI's PatchEmbed without positions), applied to packed tokens by `patch_conv`."""

    def __init__(self, channels: int, hidden: int, patch: int):
        super().__init__()
        self.proj = torch.nn.Conv2d(channels, hidden, patch, patch)


class SD35ControlNet(torch.nn.Module):
    """ComfyUI's ControlNetEmbedder without the layers it takes from the DiT: diffusers' modules of the same maths
    (CombinedTimestepTextProjEmbeddings = t_embedder + y_embedder, SD3SingleTransformerBlock = DismantledBlock)."""

    def __init__(self, config: SD35ControlNetConfig):
        from diffusers.models.embeddings import CombinedTimestepTextProjEmbeddings
        from diffusers.models.transformers.transformer_sd3 import SD3SingleTransformerBlock

        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.x_embedder = _PatchEmbedding(16, h, p) if config.double_y else None  # else the DiT's
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(h, config.pooled_dim)
        self.transformer_blocks = torch.nn.ModuleList(
            SD3SingleTransformerBlock(h, config.num_heads, sd3.HEAD_DIM) for _ in range(config.num_layers))
        self.controlnet_blocks = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(config.num_layers))
        self.pos_embed_input = _PatchEmbedding(config.hint_channels, h, p)


def sd35_source_map(config: SD35ControlNetConfig) -> dict:
    """Every SD35ControlNet parameter -> its key in ComfyUI's ControlNetEmbedder layout."""
    out: dict = {}
    h = config.hidden_size
    if config.double_y:
        linear(out, "x_embedder.proj", "x_embedder.proj")
    for dst, src in (("timestep_embedder.linear_1", "t_embedder.mlp.0"),
                     ("timestep_embedder.linear_2", "t_embedder.mlp.2"),
                     ("text_embedder.linear_1", "y_embedder.mlp.0"), ("text_embedder.linear_2", "y_embedder.mlp.2")):
        linear(out, f"time_text_embed.{dst}", src)
    for i in range(config.num_layers):
        d = s = f"transformer_blocks.{i}"
        linear(out, f"{d}.norm1.linear", f"{s}.adaLN_modulation.1")
        for name, rows in (("to_q", slice(0, h)), ("to_k", slice(h, 2 * h)), ("to_v", slice(2 * h, 3 * h))):
            linear(out, f"{d}.attn.{name}", f"{s}.attn.qkv", rows)
        linear(out, f"{d}.attn.to_out.0", f"{s}.attn.proj")
        linear(out, f"{d}.ff.net.0.proj", f"{s}.mlp.fc1")
        linear(out, f"{d}.ff.net.2", f"{s}.mlp.fc2")
        linear(out, f"controlnet_blocks.{i}", f"controlnet_blocks.{i}")
    linear(out, "pos_embed_input.proj", "pos_embed_input.proj")
    return out


def sd35_controlnet_shapes(config: SD35ControlNetConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of an SD3.5 ControlNet as its file has it (without the DiT's layers), for writing
    random test checkpoints."""
    h, p = config.hidden_size, config.patch_size
    out = CheckpointShapes()
    lin = out.linear
    if config.double_y:
        out.conv("x_embedder.proj", h, 16, p, p)
    lin("t_embedder.mlp.0", h, 256)
    lin("t_embedder.mlp.2", h, h)
    lin("y_embedder.mlp.0", h, config.pooled_dim)
    lin("y_embedder.mlp.2", h, h)
    for i in range(config.num_layers):
        b = f"transformer_blocks.{i}"
        lin(f"{b}.adaLN_modulation.1", 6 * h, h, "mod")
        lin(f"{b}.attn.qkv", 3 * h, h)
        lin(f"{b}.attn.proj", h, h)
        lin(f"{b}.mlp.fc1", 4 * h, h)
        lin(f"{b}.mlp.fc2", h, 4 * h)
        lin(f"controlnet_blocks.{i}", h, h)
    out.conv("pos_embed_input.proj", h, config.hint_channels, p, p)
    return out


def sincos_positions(hidden: int, rows: int, cols: int) -> torch.Tensor:
    """ComfyUI's get_2d_sincos_pos_embed_torch (rows x cols, row-major, float32): a grid over +-7.5 around 7.5 along
    the shorter side, stretched along the longer; per axis sin then cos of pos / 10000^(2i/(D/2)); width, then
    height."""
    def axis(pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(hidden // 4, dtype=torch.float32) / (hidden / 4))
        angles = pos.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    small = min(rows, cols)
    half_h, half_w = rows / small * 7.5, cols / small * 7.5
    grid_h, grid_w = torch.meshgrid(torch.linspace(7.5 - half_h, 7.5 + half_h, rows),
                                    torch.linspace(7.5 - half_w, 7.5 + half_w, cols), indexing="ij")
    return torch.cat([axis(grid_w), axis(grid_h)], dim=1)


class SD35ControlNetAdapter:
    """What the strategies call on a loaded SD3.5 ControlNet; its blocks attend over the image rows alone (the
    job's image-only attention), and it reads the DiT's x or y embedder from the DiT's own adapter."""

    reads_types = False
    patch = sd3.SD3Adapter.patch
    pack = staticmethod(FluxAdapter.pack)

    def __init__(self, model: SD35ControlNet, config: SD35ControlNetConfig, context, dit: sd3.SD3Adapter):
        self.model, self.net, self.control, self.context, self.dit = model, model, config, context, dit
        for i, block in enumerate(model.transformer_blocks):
            block.attn.set_processor(sd3.ParallelJointAttnProcessor(i, context, image_only=True))
        self.dtype, self.device = compute_placement(model.time_text_embed)
        self.hint_cache: collections.OrderedDict = collections.OrderedDict()
        self._positions: dict = {}

    def use_layers(self, position: int) -> None:
        base = LAYER_BASE * (position + 1)
        for i, block in enumerate(self.model.transformer_blocks):
            block.attn.processor.layer = base + i

    def hint_tokens(self, hint: torch.Tensor) -> torch.Tensor:
        return hint_tokens(self, hint)

    def embed_text(self, cond: torch.Tensor) -> None:
        return None  # its blocks read no prompt

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """t_embedder(t) + y_embedder(y), y the pooled vector, or the DiT's y embedding of it (double y)."""
        pooled = pooled.to(self.device, self.dtype)
        if self.control.double_y:
            pooled = self.dit.model.time_text_embed.text_embedder(pooled)
        return self.model.time_text_embed(t.to(self.device, torch.float32), pooled)

    def embed_control_image(self, x_tokens: torch.Tensor, hint_rows: torch.Tensor, index: torch.Tensor,
                            hw: tuple[int, int]) -> torch.Tensor:
        """x embedder (the DiT's, plus the sin-cos rows of `index`; or its own) + the hint's rows."""
        x_tokens = x_tokens.to(self.device, self.dtype)
        if self.control.double_y:
            return patch_conv(x_tokens, self.model.x_embedder.proj) + hint_rows
        grid = (-(-hw[0] // self.patch), -(-hw[1] // self.patch))
        if grid not in self._positions:
            self._positions[grid] = sincos_positions(self.control.hidden_size, *grid).to(self.device)
        # ComfyUI adds the float32 table in place: the sum in float32, rounded to the compute dtype.
        image = (patch_conv(x_tokens, self.dit.model.pos_embed.proj) + self._positions[grid][index]).to(self.dtype)
        return image + hint_rows

    def residuals(self, image: torch.Tensor, text, temb: torch.Tensor, rope) -> list[torch.Tensor]:
        """One residual per block; blocks chain, except a double-y ControlNet's, which all read the embedded input."""
        out = []
        for block, projection in zip(self.model.transformer_blocks, self.model.controlnet_blocks):
            hidden = block(image, temb)
            if not self.control.double_y:
                image = hidden
            out.append(projection(hidden))
        return out


def load_controlnet(reader, dtype: torch.dtype, device, context, tensor=None, dit=None):
    """An SD3 / SD3.5 ControlNet file (ComfyUI's layout) built on `device`, its attention on the worker's `context`;
    `tensor`: a tensor-parallel rank's split, cutting its blocks as the DiT's are cut; `dit`: the DiT's adapter (an
    SD3.5 ControlNet reads its x or y embedder)."""
    config = read_config(reader)
    if isinstance(config, SD35ControlNetConfig):
        with torch.device("meta"):
            meta = SD35ControlNet(config)
        smap, what = sd35_source_map(config), "SD3.5 ControlNet"
    else:
        meta, smap, what = meta_model(config), source_map(config), "SD3 ControlNet"
    if tensor is not None:
        plan = {**modulation_plan(meta, BLOCK_LISTS), **derived_tensor_plan(meta, BLOCK_LISTS)}
        smap = tensor.shard(meta, plan, smap, what)
    model = build_from_map(meta, smap, reader, BLOCK_LISTS, what, dtype=dtype, device=device)
    model.eval()
    if isinstance(config, SD35ControlNetConfig):
        return SD35ControlNetAdapter(model, config, context, dit)
    return SD3ControlNetAdapter(model, config, context)


# The SD3 family with its ControlNets: declared here, not in sd3.py, because this module builds on that one's
# blocks and adapter (the registry lists this one, so sd3.py never imports its ControlNets: no import circle).
SD3 = dataclasses.replace(sd3.SD3, controlnet_config=read_config, load_controlnet=load_controlnet)
