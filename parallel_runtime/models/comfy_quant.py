"""Comfy-Org's mixed-precision checkpoints (`*_int8_convrot`, `*_fp8mixed`, nvfp4, mxfp8), kept quantized per rank.

Such a file quantizes some linear layers: `<layer>.weight` holds the quantized data, `<layer>.weight_scale` (and
for nvfp4 `<layer>.weight_scale_2`) the scales, and `<layer>.comfy_quant` a uint8 tensor of JSON naming the
format (`{"format": "nvfp4"}`, `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}`); older
files list the same layers in the header's `_quantization_metadata`. Layers not listed stay in their stored dtype.

A rank keeps only its rows of each quantized layer, in the layout comfy-kitchen (Comfy-Org's kernel library, the
code ComfyUI itself runs) stores: `ComfyQuantLinear` rebuilds comfy-kitchen's `QuantizedTensor` from them per
call and dequantizes it to the compute dtype before `F.linear`, which is what ComfyUI computes on a device
without native kernels for the format (every CPU). nvfp4 and mxfp8 block scales are stored swizzled in 128 x 4
tiles; a rank unswizzles, takes its rows and swizzles them again, so a fused tensor cut by rows (Flux's q/k/v)
stays exact. A LoRA is added per call to the dequantized weight (weight_patches.PatchedPerCall), as ComfyUI's
dynamic-VRAM path patches a quantized layer; the rank keeps holding only the quantized rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelFileError

# comfy_quant format -> (comfy-kitchen layout, the multiple of rows its stored data is padded to)
LAYOUTS = {"float8_e4m3fn": ("TensorCoreFP8Layout", 1), "float8_e5m2": ("TensorCoreFP8Layout", 1),
           "int8_tensorwise": ("TensorWiseINT8Layout", 1), "mxfp8": ("TensorCoreMXFP8Layout", 32),
           "nvfp4": ("TensorCoreNVFP4Layout", 16)}
BLOCK = {"mxfp8": 32, "nvfp4": 16}
SCALES = (".weight_scale", ".weight_scale_2")  # held with the data (stored_bytes)
AUXILIARY = (*SCALES, ".comfy_quant", ".input_scale", ".pre_quant_scale")  # a layer's tensors beside `.weight`  # values per block scale, along the input dimension
HEADER_KEY = "_quantization_metadata"


def kitchen():
    """comfy-kitchen, or one sentence saying how to get it."""
    try:
        from comfy_kitchen import float_utils
        from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    except ImportError as exc:
        raise ModelFileError(f"this file is a ComfyUI quantized checkpoint, which needs the comfy-kitchen package "
                             f"({exc}); pip install packaging comfy-kitchen==0.2.40 into ComfyUI's Python (its "
                             f"py3-none-any wheel runs on any platform).") from None
    return QuantizedTensor, get_layout_class, float_utils


def layer_formats(reader) -> dict[str, dict]:
    """Layer name (the key before `.weight`) -> its comfy_quant config, from the per-layer `.comfy_quant`
    tensors and the header's `_quantization_metadata` (the per-layer entry wins, as in ComfyUI)."""
    layers: dict[str, dict] = {}
    name = getattr(reader, "name", None) or getattr(reader, "path", "checkpoint")
    header = reader.metadata().get(HEADER_KEY)
    if header:
        try:
            layers.update(json.loads(header)["layers"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{name}: its {HEADER_KEY} header is not valid JSON with a 'layers' table ({exc}); "
                                 f"re-download or re-export the file.") from None
    for key in reader.keys():
        if key.endswith(".comfy_quant"):
            raw = reader.read_raw(key)
            try:
                layers[key[: -len(".comfy_quant")]] = json.loads(bytes(raw.to(torch.uint8).flatten().tolist()))
            except ValueError as exc:
                raise ModelFileError(f"{name}: {key} does not hold a JSON layer description ({exc}); re-download "
                                     f"the file.") from None
    for layer, conf in layers.items():
        fmt = conf.get("format") if isinstance(conf, dict) else None
        if fmt not in LAYOUTS:
            raise ModelFileError(f"{name}: layer {layer!r} is stored as {fmt!r}, a ComfyUI quantized format ParaDiT "
                                 f"does not run (it runs {', '.join(LAYOUTS)}); use another release of the model.")
    return layers


def auxiliary_keys(layers: dict[str, dict]) -> set[str]:
    """The tensors quantized `layers` carry beside their `.weight` (scales, descriptions)."""
    return {layer + suffix for layer in layers for suffix in AUXILIARY}


def _params(conf: dict) -> dict:
    """The layout options a comfy_quant entry carries (ConvRot, at the top level or under "params")."""
    extra = dict(conf.get("params") or {}, **{k: v for k, v in conf.items() if k != "params"})
    if conf["format"] != "int8_tensorwise" or not extra.get("convrot"):
        return {}
    return {"convrot": True, "convrot_groupsize": int(extra.get("convrot_groupsize", 256))}


@dataclass
class ComfyQuantWeight:
    """One rank's rows of a quantized layer, stored as comfy-kitchen stores them (padded rows, swizzled scales)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    block_scale: torch.Tensor | None
    options: dict
    shape: tuple[int, int]
    pre_scale: torch.Tensor | None = None  # AWQ-style per-input-channel factor (`pre_quant_scale`), folded in

    def linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return ComfyQuantLinear(self, bias)


def read_rows(reader, layer: str, conf: dict, rows: slice | None, transform: str | None,
              device) -> ComfyQuantWeight:
    """The rows `rows` (None: all) of quantized `layer` (swap_halves applied to whole rows), ready for a rank."""
    from .mapping import apply_transform

    float_utils = kitchen()[2]
    fmt = conf["format"]
    stored_rows, stored_cols = reader.stored_shape(f"{layer}.weight")
    rows = rows or slice(0, stored_rows)
    data = apply_transform(reader.read_raw(f"{layer}.weight", rows=rows, device=device), transform)
    # nvfp4: per-tensor weight_scale_2 beside the block scales; mxfp8: only block scales (below)
    scale_key = f"{layer}.weight_scale_2" if fmt == "nvfp4" else f"{layer}.weight_scale"
    scale = reader.read_raw(scale_key, device=device).float() if fmt != "mxfp8" else None
    if scale is not None and scale.dim() == 1 and scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # per-row int8 scales written 1-D: [O] -> [O, 1], as comfy-kitchen needs
    if scale is not None and scale.dim() == 2 and scale.shape[0] > 1:
        scale = apply_transform(scale[rows], transform)
    block_scale, cols = None, stored_cols * (2 if fmt == "nvfp4" else 1)
    if fmt in BLOCK:
        stored = reader.read_raw(f"{layer}.weight_scale", device=device)
        dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
        full = float_utils.from_blocked(stored.view(dtype) if stored.dtype != dtype else stored,
                                        stored_rows, cols // BLOCK[fmt])
        block_scale = apply_transform(full[rows], transform)
    pad = LAYOUTS[fmt][1]
    n = data.shape[0]
    if n % pad:  # comfy-kitchen's layouts hold whole row blocks: zero rows, which dequantize to zero
        data = torch.cat([data, data.new_zeros(pad - n % pad, data.shape[1])])
        block_scale = torch.cat([block_scale, block_scale.new_zeros(pad - n % pad, block_scale.shape[1])])
    if block_scale is not None:
        block_scale = float_utils.to_blocked(block_scale, flatten=False)
    if fmt == "mxfp8":  # comfy-kitchen's MXFP8 layout takes its block scales as `scale`
        scale, block_scale = block_scale, None
    pre_key = f"{layer}.pre_quant_scale"
    pre_scale = reader.read_raw(pre_key, device=device).float().flatten() if pre_key in reader else None
    return ComfyQuantWeight(fmt, data.contiguous(), scale, block_scale, _params(conf), (n, cols), pre_scale)


class ComfyQuantLinear(torch.nn.Module):
    """A Linear whose weight stays in a ComfyUI quantized layout on the rank; each call rebuilds comfy-kitchen's
    QuantizedTensor and dequantizes it to the input's dtype (ComfyUI's path where no native kernel runs)."""

    def __init__(self, weight: ComfyQuantWeight, bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.options = weight.fmt, weight.options
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_data", weight.data)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("block_scale", weight.block_scale)
        self.register_buffer("pre_quant_scale", weight.pre_scale)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.patch = None  # callable(layer, dtype) -> patched weight, while a LoRA is added per call

    def quantized(self, dtype: torch.dtype):
        quantized_tensor, get_layout_class, _ = kitchen()
        layout = LAYOUTS[self.fmt][0]
        extra = {"block_scale": self.block_scale} if self.block_scale is not None else {}
        if self.fmt == "int8_tensorwise":
            extra.update(is_weight=True, **self.options)
        params = get_layout_class(layout).Params(scale=self.weight_scale, orig_dtype=dtype,
                                                 orig_shape=(self.out_features, self.in_features), **extra)
        return quantized_tensor(self.weight_data, layout, params)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        weight = self.quantized(dtype).dequantize()
        if self.pre_quant_scale is not None:  # quantized against inputs scaled per channel: the weight it means
            weight = weight * self.pre_quant_scale.to(dtype)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.patch(self, x.dtype) if self.patch is not None else self.dequantized(x.dtype)
        return F.linear(x, weight, self.bias.to(x.dtype) if self.bias is not None else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.fmt}"
