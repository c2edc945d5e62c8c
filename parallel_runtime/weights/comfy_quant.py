"""Comfy-Org's mixed-precision checkpoints (`*_int8_convrot`, `*_fp8mixed`, nvfp4, mxfp8), kept quantized per rank.

Such a file quantizes some linear layers: `<layer>.weight` holds the quantized data, `<layer>.weight_scale` (and
for nvfp4 `<layer>.weight_scale_2`) the scales, and `<layer>.comfy_quant` a uint8 tensor of JSON naming the
format (`{"format": "nvfp4"}`, `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}`); older
files list the same layers in the header's `_quantization_metadata`. Layers not listed stay in their stored dtype.

A rank keeps only its rows of each quantized layer, in the layout comfy-kitchen (Comfy-Org's kernel library, the
code ComfyUI itself runs) stores: `ComfyQuantLinear` rebuilds comfy-kitchen's `QuantizedTensor` from them per
call. Where the device has comfy-kitchen's matmul kernel for the format (ComfyUI's rule, `kernel_formats`: fp8
on NVIDIA compute capability 8.9+, int8 on CUDA GPUs, nvfp4 and mxfp8 on 10.0+) the layer multiplies in the
layout as ComfyUI does: fp8/nvfp4/mxfp8 quantize the input to the weight's layout first, int8's kernel quantizes
it per row itself. Elsewhere (every CPU), or under the `dequantize` switch, it dequantizes the weight to the
compute dtype and runs `F.linear`, as ComfyUI does on devices without the kernel. nvfp4 and mxfp8 block scales
are stored swizzled in 128 x 4 tiles; a rank unswizzles, takes its rows and swizzles them again, so a fused
tensor cut by rows (Flux's q/k/v) stays exact. A LoRA is added per call to the dequantized weight
(patches.PatchedPerCall), as ComfyUI's dynamic-VRAM path patches a quantized layer; the rank keeps holding
only the quantized rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError, ModelFileError
from .keymap import Rows, apply_transform, read_pieces
from .storage import KeptLinear

# comfy_quant format -> (comfy-kitchen layout, the multiple of rows its stored data is padded to)
LAYOUTS = {"float8_e4m3fn": ("TensorCoreFP8Layout", 1), "float8_e5m2": ("TensorCoreFP8Layout", 1),
           "int8_tensorwise": ("TensorWiseINT8Layout", 1), "mxfp8": ("TensorCoreMXFP8Layout", 32),
           "nvfp4": ("TensorCoreNVFP4Layout", 16)}
BLOCK = {"mxfp8": 32, "nvfp4": 16}
SCALES = (".weight_scale", ".weight_scale_2")  # held with the data (stored_bytes)
AUXILIARY = (*SCALES, ".comfy_quant", ".input_scale", ".pre_quant_scale")  # a layer's tensors beside `.weight`
HEADER_KEY = "_quantization_metadata"
# ComfyUI's QUANT_ALGOS "quantize_input": these kernels take the input in the weight's layout; int8's takes it as is
QUANTIZES_INPUT = {"float8_e4m3fn", "float8_e5m2", "mxfp8", "nvfp4"}
# Formats whose input, without a stored input_scale, is quantized at one scale from the whole input's amax: nvfp4's
# amax(|x|) / (F8_E4M3_MAX x F4_E2M1_MAX). A rank widens that amax to the whole forward pass (input_amax.py).
AMAX_SCALED_INPUT = {"nvfp4": 448.0 * 6.0}
QUANTIZED_MATMUL = ("auto", "dequantize", "kernel")  # the loader's switch, see kernel_formats


_BACKENDS_SET = False


def kitchen():
    """comfy-kitchen, or one sentence saying how to get it; its backends set as ComfyUI's quant_ops sets them."""
    global _BACKENDS_SET
    try:
        import comfy_kitchen
        from comfy_kitchen import float_utils
        from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    except ImportError as exc:
        raise ModelFileError(f"this file is a ComfyUI quantized checkpoint, which needs the comfy-kitchen package "
                             f"({exc}); pip install packaging comfy-kitchen==0.2.40 into ComfyUI's Python (its "
                             f"py3-none-any wheel runs on any platform).") from None
    if not _BACKENDS_SET:  # ComfyUI runs comfy-kitchen's CUDA kernels only with a CUDA 13 torch, never Triton's
        cuda = torch.version.cuda
        if cuda is None or int(str(cuda).split(".")[0]) < 13:
            comfy_kitchen.registry.disable("cuda")
        comfy_kitchen.registry.disable("triton")
        _BACKENDS_SET = True
    return QuantizedTensor, get_layout_class, float_utils


def check_quantized_matmul(mode: str) -> None:
    """One sentence for a quantized_matmul value that is none of the switch's."""
    if mode not in QUANTIZED_MATMUL:
        raise ConfigError(f"quantized_matmul {mode!r} is unknown; choose one of {', '.join(QUANTIZED_MATMUL)}.")


def kernel_formats(device: torch.device, mode: str = "auto") -> frozenset[str]:
    """The formats whose layers multiply in their layout on `device` with comfy-kitchen's kernels.

    "auto" is ComfyUI's rule (comfy.ops.get_disabled_quant_formats): fp8 on NVIDIA compute capability 8.9+, int8 on
    any CUDA/ROCm GPU, nvfp4 on 10.0+, mxfp8 on 10.0+ with torch 2.10+; none on a CPU. "dequantize" forces
    dequantize-then-matmul everywhere. "kernel" also takes comfy-kitchen's eager CPU versions on a CPU (no mxfp8
    there): ComfyUI's GPU arithmetic, checkable on any machine; on a GPU it is "auto". float8_e5m2 layers never
    do: ComfyUI quantizes their input to e5m2, which torch._scaled_mm refuses, and falls back to dequantizing."""
    check_quantized_matmul(mode)
    if mode == "dequantize":
        return frozenset()
    if device.type != "cuda":
        return frozenset(LAYOUTS) - {"mxfp8", "float8_e5m2"} if mode == "kernel" else frozenset()
    formats = {"int8_tensorwise"}
    if torch.version.cuda is not None and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        formats |= {"float8_e4m3fn"} if (major, minor) >= (8, 9) else set()
        formats |= {"nvfp4"} if major >= 10 else set()
        formats |= {"mxfp8"} if major >= 10 and tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 10) else set()
    return frozenset(formats)


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
    pre_scale: torch.Tensor | None = None  # AWQ-style per-input-channel factor (`pre_quant_scale`) on the input
    input_scale: torch.Tensor | None = None  # the file's static scale for the input's layout (kernel path)
    full_precision: bool = False  # the layer's `full_precision_matrix_mult`: never the quantized matmul

    def linear(self, bias: torch.Tensor | None, storage=None) -> torch.nn.Module:
        kernel = storage is not None and self.fmt in storage.kernel_formats and not self.full_precision
        amax = storage.input_amax if kernel and self.fmt in AMAX_SCALED_INPUT and self.input_scale is None else None
        return ComfyQuantLinear(self, bias, kernel=kernel, input_amax=amax)


def read_rows(reader, layer: str, conf: dict, rows: Rows, transform: str | None, device,
              cols: tuple[slice, ...] | None = None) -> ComfyQuantWeight:
    """The rows `rows` (None: all; a tensor-parallel rank's runs) of quantized `layer` (swap_halves applied to whole
    rows), and only columns `cols` where given (a row-wise split: whole blocks of the layout only), ready for a
    rank. Per-tensor scales are every rank's; per-row and block scales are cut alongside the data."""
    float_utils = kitchen()[2]
    fmt = conf["format"]
    stored_rows, stored_cols = reader.stored_shape(f"{layer}.weight")
    rows = rows or slice(0, stored_rows)
    packed = 2 if fmt == "nvfp4" else 1  # values per stored element
    _check_columns(layer, fmt, _params(conf), cols)

    def by_columns(width: int) -> tuple[slice, ...] | None:  # `cols` in units of `width` values
        return None if cols is None else tuple(slice(c.start // width, c.stop // width) for c in cols)

    def cut(t: torch.Tensor, columns=None) -> torch.Tensor:
        return apply_transform(read_pieces(lambda index: t[index], rows, columns, torch.cat), transform)

    data = apply_transform(reader.read_raw(f"{layer}.weight", rows=rows, device=device, cols=by_columns(packed)),
                           transform)
    # nvfp4: per-tensor weight_scale_2 beside the block scales; mxfp8: only block scales (below)
    scale_key = f"{layer}.weight_scale_2" if fmt == "nvfp4" else f"{layer}.weight_scale"
    scale = reader.read_raw(scale_key, device=device).float() if fmt != "mxfp8" else None
    if scale is not None and scale.dim() == 1 and scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # per-row int8 scales written 1-D: [O] -> [O, 1], as comfy-kitchen needs
    if scale is not None and scale.dim() == 2 and scale.shape[0] > 1:
        scale = cut(scale)
    block_scale, width = None, stored_cols * packed
    if fmt in BLOCK:
        stored = reader.read_raw(f"{layer}.weight_scale", device=device)
        dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
        full = float_utils.from_blocked(stored.view(dtype) if stored.dtype != dtype else stored,
                                        stored_rows, width // BLOCK[fmt])
        block_scale = cut(full, by_columns(BLOCK[fmt]))
    pad = LAYOUTS[fmt][1]
    n = data.shape[0]
    if n % pad:  # comfy-kitchen's layouts hold whole row blocks: zero rows, which dequantize to zero
        data = torch.cat([data, data.new_zeros(pad - n % pad, data.shape[1])])
        block_scale = torch.cat([block_scale, block_scale.new_zeros(pad - n % pad, block_scale.shape[1])])
    if block_scale is not None:
        block_scale = float_utils.to_blocked(block_scale, flatten=False)
    if fmt == "mxfp8":  # comfy-kitchen's MXFP8 layout takes its block scales as `scale`
        scale, block_scale = block_scale, None
    pre_key, input_key = f"{layer}.pre_quant_scale", f"{layer}.input_scale"
    # ComfyUI loads a pre_quant_scale for nvfp4 layers only (QUANT_ALGOS' parameters); others ignore it.
    pre_scale = reader.read_raw(pre_key, device=device).float().flatten() \
        if fmt == "nvfp4" and pre_key in reader else None
    if pre_scale is not None and cols is not None:  # one factor per input column: a row-wise rank's columns
        pre_scale = torch.cat([pre_scale[c] for c in cols])
    input_scale = reader.read_raw(input_key, device=device).float().reshape(()) if input_key in reader else None
    cols_held = width if cols is None else sum(c.stop - c.start for c in cols)
    return ComfyQuantWeight(fmt, data.contiguous(), scale, block_scale, _params(conf), (n, cols_held), pre_scale,
                            input_scale, bool(conf.get("full_precision_matrix_mult", False)))


def _check_columns(layer: str, fmt: str, options: dict, cols: tuple[slice, ...] | None) -> None:
    """One sentence where a row-wise tensor-parallel cut would fall inside a block of columns the layout scales or
    rotates together (nvfp4's 16, mxfp8's 32, a ConvRot group)."""
    group = options.get("convrot_groupsize") or BLOCK.get(fmt, 1)
    for c in cols or ():
        if c.start % group or c.stop % group:
            raise ConfigError(f"tensor parallelism would cut {layer} at input column "
                              f"{c.start if c.start % group else c.stop}, inside a group of {group} columns its "
                              f"{fmt} layout scales together; pick a lower tensor_degree.")


def kernel_linear(x: torch.Tensor, weight, fmt: str, input_scale: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """ComfyUI's quantized matmul of `x` by a comfy-kitchen QuantizedTensor `weight` of format `fmt`: fp8, nvfp4
    and mxfp8 quantize the input to the weight's layout first (at `input_scale`; an fp8 input without one at 1,
    as ComfyUI's fp8 layout does), int8's kernel quantizes it per row itself. The weight's orig_shape gives the
    output its width (rows padded to whole blocks are sliced off), so `bias` has that many values."""
    if fmt not in QUANTIZES_INPUT:
        return F.linear(x, weight, bias)
    if input_scale is None and fmt == "float8_e4m3fn":
        input_scale = torch.ones((), device=x.device, dtype=torch.float32)
    rows = kitchen()[0].from_float(x.reshape(-1, x.shape[-1]), LAYOUTS[fmt][0], scale=input_scale)
    out = F.linear(rows, weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# torch._scaled_mm on CUDA takes an fp8 weight only with both dimensions divisible by 16 ("mat2 shape (1024x200)
# must be divisible by 16"). A whole layer of a real model always is; a rank's rows or columns of it need not be
# (tensor parallelism over 3 ranks, rows weighted by device speed), so fp8_kernel_linear pads those with zeros.
SCALED_MM_ALIGN = 16


def fp8_kernel_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None,
                      input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """ComfyUI's fp8 matmul (kernel_linear on a TensorCoreFP8Layout weight) of `x` by this rank's fp8 rows `data`
    at the per-tensor `scale`. Rows and input columns that do not fill SCALED_MM_ALIGN are padded with zeros:
    a zero input column adds nothing to any output, and a zero row's output column is sliced off, so every kept
    column is the same dot product, quantized input included (the input's scale is per tensor, never per row).
    Only such an uneven shard pays the copy of its weight per call."""
    out_features, in_features = data.shape
    pad_rows, pad_cols = -out_features % SCALED_MM_ALIGN, -in_features % SCALED_MM_ALIGN
    if pad_rows or pad_cols:
        data = F.pad(data.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(data.dtype)
        x = F.pad(x, (0, pad_cols))
        bias = F.pad(bias, (0, pad_rows)) if bias is not None else None
    quantized_tensor, get_layout_class, _ = kitchen()
    params = get_layout_class("TensorCoreFP8Layout").Params(scale=scale, orig_dtype=x.dtype,
                                                            orig_shape=tuple(data.shape))
    out = kernel_linear(x, quantized_tensor(data, "TensorCoreFP8Layout", params), "float8_e4m3fn", input_scale, bias)
    return out[..., :out_features].contiguous() if pad_rows else out


class ComfyQuantLinear(KeptLinear):
    """A Linear whose weight stays in a ComfyUI quantized layout on the rank. Each call rebuilds comfy-kitchen's
    QuantizedTensor from the rows it holds and, as ComfyUI's mixed-precision Linear: multiplies in the layout
    (`kernel`: the device has comfy-kitchen's kernel for the format and the switch allows it), or dequantizes to
    the input's dtype and runs F.linear. A `pre_quant_scale` multiplies the input first, on both paths.
    `input_amax`: where an nvfp4 kernel layer without a stored input_scale takes its input's amax (InputAmax)."""

    def __init__(self, weight: ComfyQuantWeight, bias: torch.Tensor | None, kernel: bool = False, input_amax=None):
        super().__init__()
        self.fmt, self.options, self.kernel, self.input_amax = weight.fmt, weight.options, kernel, input_amax
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_data", weight.data)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("block_scale", weight.block_scale)
        self.register_buffer("pre_quant_scale", weight.pre_scale)
        self.register_buffer("input_scale", weight.input_scale)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

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
        """The stored weight in `dtype` (what a LoRA patches; `pre_quant_scale` stays on the input side)."""
        return self.quantized(dtype).dequantize()

    def effective_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the layer means, `pre_quant_scale` folded in: what a full-precision load holds."""
        weight = self.dequantized(dtype)
        return weight * self.pre_quant_scale.to(dtype) if self.pre_quant_scale is not None else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.patch is not None:
            return F.linear(x, self.patch(self, x.dtype), bias)
        if not self.kernel:
            return F.linear(x, self.dequantized(x.dtype), bias)
        if self.fmt == "float8_e4m3fn":
            return fp8_kernel_linear(x, self.weight_data, self.weight_scale, self._input_scale(x), bias)
        return kernel_linear(x, self.quantized(x.dtype), self.fmt, self._input_scale(x), bias)

    def _input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The file's input_scale; else nvfp4's from the amax over the whole forward pass, formed as comfy-kitchen
        forms it (in x's dtype); None leaves it to comfy-kitchen (this rank's x is the whole pass: serial)."""
        amax = self.input_amax(x) if self.input_amax is not None else None
        return self.input_scale if amax is None else amax / AMAX_SCALED_INPUT[self.fmt]

    def extra_repr(self) -> str:
        path = "kernel" if self.kernel else "dequantize"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.fmt}, {path}"
