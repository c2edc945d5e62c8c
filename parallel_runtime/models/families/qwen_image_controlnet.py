"""Qwen-Image ControlNets (InstantX's Qwen-Image ControlNet Union and Inpainting) as the workers run them.

The file is ComfyUI's own comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel state dict (the host exports the
ControlNet that ControlNetLoader built; its names are diffusers', as the DiT's): a Qwen-Image DiT without its head,
a `controlnet_blocks.N` projection per block and `controlnet_x_embedder`, a linear embedding of the packed hint
latent (64 wide; 68 for the inpainting ControlNet, whose mask rides along).

Its blocks are Qwen-Image blocks, so they run through `QwenImageAdapter` with the job's attention strategy and the
DiT's RoPE rows of [text, image] (ComfyUI's ControlNet builds the same ids and never sees Edit's reference latents).
`residual_index` repeats its residuals as ComfyUI does: each block's output ceil(60 / blocks) times, the list cut at
60 entries (ComfyUI's main_model_double, whatever the DiT's depth); the DiT adds entry i to its image rows after
block i. What diffusers' pipeline does differently: its RoPE (see qwen_image.py); here ComfyUI's is followed.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...weights.keymap import block_count, same_names
from ...weights.mapping import build_from_map
from ..family import ControlNetBlocks
from . import qwen_image
from .flux_controlnet import LAYER_BASE

MAIN_BLOCKS = 60  # ComfyUI's QwenImageControlNetModel.main_model_double: the list it returns is cut there


@dataclass(frozen=True)
class QwenImageControlNetConfig:
    qwen: qwen_image.QwenImageConfig  # the ControlNet's own blocks and embedders
    hint_channels: int  # controlnet_x_embedder's input width (packed 2 x 2 tokens)
    union_modes = 0  # the Union ControlNet reads no type tokens: its control type is in the hint

    @property
    def hidden_size(self) -> int:
        return self.qwen.hidden_size

    @property
    def axes_dims_rope(self):
        return self.qwen.axes_dims_rope

    @property
    def outputs(self) -> int:
        return self.qwen.num_layers

    def residual_index(self, main_double: int, main_single: int = 0) -> dict[int, int]:
        """DiT block i -> output i // repeat, repeat = ceil(60 / blocks), for the first 60 blocks."""
        repeat = math.ceil(MAIN_BLOCKS / self.outputs)
        return {i: i // repeat for i in range(min(MAIN_BLOCKS, self.outputs * repeat, main_double))}


def read_config(reader) -> QwenImageControlNetConfig:
    """The ControlNet's config from its tensor names and shapes."""
    name = os.path.basename(getattr(reader, "path", "controlnet"))
    keys = set(reader.keys())
    if not {"controlnet_x_embedder.weight", "controlnet_blocks.0.weight", "txt_norm.weight", "img_in.weight",
            "transformer_blocks.0.attn.norm_q.weight"} <= keys:
        raise ModelFileError(f"{name} is not a Qwen-Image ControlNet (no controlnet_x_embedder / joint blocks); load "
                             f"a Qwen-Image ControlNet with ControlNetLoader.")
    hidden, in_channels = reader.shape("img_in.weight")
    head_dim = reader.shape("transformer_blocks.0.attn.norm_q.weight")[0]
    config = qwen_image.QwenImageConfig(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim,
                                        num_layers=block_count(keys, "", "transformer_blocks", name),
                                        in_channels=in_channels, context_dim=reader.shape("txt_in.weight")[1])
    return QwenImageControlNetConfig(config, reader.shape("controlnet_x_embedder.weight")[1])


def controlnet_shapes(config: QwenImageControlNetConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, kind)} of a Qwen-Image ControlNet, for writing random test checkpoints."""
    h = config.hidden_size
    out = {k: v for k, v in qwen_image.checkpoint_shapes(config.qwen).items()
           if not k.startswith(("norm_out.", "proj_out."))}
    for i in range(config.outputs):
        out[f"controlnet_blocks.{i}.weight"], out[f"controlnet_blocks.{i}.bias"] = ((h, h), "weight"), ((h,), "bias")
    out["controlnet_x_embedder.weight"] = ((h, config.hint_channels), "weight")
    out["controlnet_x_embedder.bias"] = ((h,), "bias")
    return out


def meta_model(config: QwenImageControlNetConfig) -> torch.nn.Module:
    """diffusers' QwenImageControlNetModel on the meta device (its blocks are the DiT's)."""
    from diffusers.models.controlnets.controlnet_qwenimage import QwenImageControlNetModel

    kwargs = config.qwen.diffusers_kwargs()
    kwargs.pop("patch_size")
    with torch.device("meta"):
        extra = config.hint_channels - config.qwen.in_channels
        return QwenImageControlNetModel(**kwargs, extra_condition_channels=extra)


class QwenImageControlNetAdapter(ControlNetBlocks, qwen_image.QwenImageAdapter):
    """What the strategies call on a loaded Qwen-Image ControlNet: the hint's tokens (once per hint), its image, text
    and time embeddings, and one pass over its blocks that returns a residual per block for this rank's image rows."""

    reads_types = False

    def __init__(self, model, config: QwenImageControlNetConfig, context):
        self.net, self.control, self.context = model, config, context
        # One chunk per block, so `residuals` can project each block's output.
        super().__init__(config.qwen, model, [range(i, i + 1) for i in range(config.outputs)], context)
        self.projections = model.controlnet_blocks
        self.hint_cache: collections.OrderedDict = collections.OrderedDict()

    def use_layers(self, position: int) -> None:
        """Attention layer ids for the ControlNet at `position` of a chain: past the DiT's, apart for each use."""
        base = LAYER_BASE * (position + 1)
        for i, block in enumerate(self.model.transformer_blocks):
            block.attn.processor.layer = base + i

    def hint_tokens(self, hint: torch.Tensor) -> torch.Tensor:
        """controlnet_x_embedder of the packed hint latent (ComfyUI's process_img: one frame of the Wan latent,
        padded circularly to whole patches) as tokens [B, N, hidden]."""
        hint = hint.to(self.device, self.dtype)
        if hint.ndim == 5:  # [B, C, 1, H, W], as the Wan VAE encodes an image
            hint = hint[:, :, 0]
        hint = torch.nn.functional.pad(hint, (0, (-hint.shape[-1]) % 2, 0, (-hint.shape[-2]) % 2), mode="circular")
        return self.model.controlnet_x_embedder(self.pack(hint))


def load_controlnet(reader, dtype: torch.dtype, device, context, tensor=None, dit=None) -> QwenImageControlNetAdapter:
    """A Qwen-Image ControlNet file built on `device`, its attention on the worker's `context`; `tensor`: a
    tensor-parallel rank's split, cutting its blocks with the DiT's plan; `dit`: unused (it shares no DiT layer)."""
    config = read_config(reader)
    meta = meta_model(config)
    smap = same_names(n for n, _ in meta.named_parameters())
    if tensor is not None:
        smap = tensor.shard(meta, qwen_image.tensor_plan(config.qwen), smap, "Qwen-Image ControlNet")
    model = build_from_map(meta, smap, reader, qwen_image.BLOCK_LISTS, "Qwen-Image ControlNet", dtype=dtype,
                           device=device)
    model.eval()
    return QwenImageControlNetAdapter(model, config, context)


# The QWEN_IMAGE family with its ControlNets: declared here, not in qwen_image.py, because this module builds on that one's
# blocks and adapter (the registry lists this one, so qwen_image.py never imports its ControlNets: no import circle).
QWEN_IMAGE = dataclasses.replace(qwen_image.QWEN_IMAGE, controlnet_config=read_config, load_controlnet=load_controlnet)
