"""How a rank stores a checkpoint's weights: the one rule (`Storage`) and the base of every compact layer.

The storage kinds themselves live beside it: `fp8` (fp8 and scaled-fp8 weights), `gguf_file` (GGUF blocks) and
`comfy_quant` (ComfyUI's quantized layouts through comfy-kitchen); each layer subclasses `KeptLinear`, so this
module imports none of them.

ComfyUI keeps an fp8 file's linear weights in fp8 and upcasts each one to the compute dtype when its layer
runs ("manual cast"); a scaled-fp8 file (ComfyUI's `scaled_fp8` marker and a `scale_weight` per layer)
multiplies the upcast weight by its scale. ComfyUI-GGUF keeps a GGUF file's quantized blocks and dequantizes a
layer's weight just before the layer runs. A rank does the same with the linear layers it owns (`Fp8Linear`,
`GGUFLinear`), so it holds the file's bytes, not bf16's; every other tensor (norms, biases, embeddings) is
small and is read in the compute dtype.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .input_amax import InputAmax

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
FP8_WEIGHT_DTYPES = {n: getattr(torch, "float8_" + n[4:]) for n in ("fp8_e4m3fn", "fp8_e5m2") if hasattr(torch, "float8_" + n[4:])}
SCALED_FP8_MARKER = "scaled_fp8"  # ComfyUI's key for "this file's fp8 weights carry per-layer scales"


@dataclass(frozen=True)
class Storage:
    """`compute`: the dtype layers run in. `keep_quantized`: linear weights stored in fp8, GGUF blocks or a ComfyUI
    quantized layout stay so (else they are upcast at load). `cast_fp8`: cast every linear weight to this fp8 dtype
    at load, as UNETLoader's weight_dtype fp8 options do (the other tensors are rounded through it too, as ComfyUI
    stores them)."""

    compute: torch.dtype
    keep_quantized: bool = True
    cast_fp8: torch.dtype | None = None
    # A scaled-fp8 file's type: ComfyUI builds every Linear of such a model in it, biases included.
    scaled_fp8: torch.dtype | None = None
    # The device computes in fp8 (CUDA 8.9+): ComfyUI then holds a plain fp8 file in fp8; elsewhere it upcasts the
    # file at load (comfy.model_management.unet_dtype), which decides how a LoRA lands (see bakes_fp8).
    fp8_compute: bool = False
    # ComfyUI quantized formats whose layers multiply in their layout with comfy-kitchen's kernels on this device
    # (comfy_quant.kernel_formats); the others dequantize per call.
    kernel_formats: frozenset = frozenset()
    # A scaled-fp8 file whose marker asks for full-precision matmuls (ComfyUI: a 2-element `scaled_fp8` tensor).
    scaled_full_precision: bool = False
    # The hook through which the strategy widens a quantized layer's dynamic input scale to the whole forward pass
    # (input_amax.py): one per loaded model, shared by its layers.
    input_amax: InputAmax = dataclasses.field(default_factory=InputAmax, compare=False, repr=False)

    @classmethod
    def for_weight_dtype(cls, name: str, compute: torch.dtype, **device_facts) -> "Storage":
        """Load Parallel DiT's `weight_dtype` as every rank stores it (the one rule; the memory estimate asks it
        too): 'default' keeps a file's fp8 weights, GGUF blocks and ComfyUI layouts as they are (as ComfyUI and
        ComfyUI-GGUF keep them), an fp8 name casts every linear weight to that type (UNETLoader's options of those
        names), bf16/fp16/fp32 upcast everything to `compute`. `device_facts`: fp8_compute, kernel_formats."""
        cast = FP8_WEIGHT_DTYPES.get(name)
        return cls(compute, keep_quantized=name == "default" or cast is not None, cast_fp8=cast, **device_facts)

    def held_bytes(self, stored: torch.dtype | None, quantized_bytes: float, compute_bytes: float) -> float:
        """Bytes a rank holds per weight stored as `stored` (None: in GGUF blocks or a ComfyUI layout, which hold
        `quantized_bytes`), counting it as a linear weight; `compute_bytes`: the compute dtype's size."""
        if stored is None and self.keeps_blocks("quantized"):
            return quantized_bytes
        kept = self.linear_dtype(stored if stored is not None else torch.float32)
        return kept.itemsize if kept is not None else compute_bytes

    def for_file(self, reader) -> "Storage":
        """This storage for one file: a scaled-fp8 file's marker names the fp8 type of all its linear layers
        (an fp32 marker means e4m3fn, as in ComfyUI)."""
        key = next((k for k in reader.keys() if k.rpartition(".")[2] == SCALED_FP8_MARKER), None)
        if key is None or not self.keep_quantized:
            return self
        marker = reader.dtype(key)
        return dataclasses.replace(self, scaled_fp8=marker if marker in FP8_DTYPES else FP8_DTYPES[0],
                                   scaled_full_precision=math.prod(reader.shape(key)) == 2)

    def linear_dtype(self, stored: torch.dtype) -> torch.dtype | None:
        """The dtype a linear weight stored as `stored` is kept in on the rank; None: the compute dtype."""
        forced = self.cast_fp8 or self.scaled_fp8
        if forced is not None:
            return forced
        return stored if self.keep_quantized and stored in FP8_DTYPES else None

    def bakes_fp8(self) -> bool:
        """Whether ComfyUI would hold this model's fp8 weights in fp8, so a LoRA is baked back into fp8 (with its
        stochastic rounding); else ComfyUI holds them upcast and adds the LoRA in the compute dtype, which a rank
        reproduces per call on its fp8 weights (patches.PatchedPerCall)."""
        return self.cast_fp8 is not None or self.scaled_fp8 is not None or self.fp8_compute

    def fp8_kernel(self, stored: torch.dtype, scaled: bool) -> bool:
        """Whether a kept fp8 weight (`scaled`: with its own `scale_weight`) multiplies in fp8 (torch._scaled_mm
        through comfy-kitchen): ComfyUI reads a scaled-fp8 file's layers that have a scale as float8_e4m3fn
        quantized layers, which take the kernel where the device has it."""
        return (scaled and self.scaled_fp8 is not None and stored == torch.float8_e4m3fn
                and not self.scaled_full_precision and "float8_e4m3fn" in self.kernel_formats)

    def keeps_blocks(self, quant_format: str | None) -> bool:
        """Whether a linear weight stored in GGUF blocks or a ComfyUI layout stays so (a forced fp8 type casts it
        instead)."""
        return quant_format is not None and self.keep_quantized and self.cast_fp8 is None

    def rounding(self, linear_bias: bool) -> torch.dtype | None:
        """The fp8 type another tensor is rounded through before the compute dtype, as ComfyUI stores it."""
        return self.cast_fp8 or (self.scaled_fp8 if linear_bias else None)


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "scale_weight"


class KeptLinear(torch.nn.Module):
    """A Linear whose weight a rank keeps compact (fp8, GGUF blocks, a ComfyUI layout): each storage kind
    subclasses it, so the builder and the LoRA patcher find every such layer without importing the kinds.
    `patch` is set while a LoRA is added per call (patches.PatchedPerCall)."""

    out_features: int
    in_features: int
    patch = None  # callable(layer, dtype) -> patched weight, set while a LoRA is added per call
    compute_dtype: torch.dtype | None = None  # the dtype the model runs in (set by install_kept_linears)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in `dtype`."""
        raise NotImplementedError


def linear_names(model: torch.nn.Module) -> dict[str, str]:
    """`<module>.weight` and `<module>.bias` -> module name, for every linear layer of a model (nn.Linear, and
    the layers that keep their weight compact)."""
    return {f"{name}.{p}": name for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, KeptLinear)) for p in ("weight", "bias")}


def install_kept_linears(model: torch.nn.Module, weights: dict, storage: Storage | None = None) -> None:
    """Replace each Linear named in `weights` (module name -> Fp8Weight, GGUFWeight or ComfyQuantWeight) by the
    layer that keeps that weight compact, with the Linear's already-loaded bias (computing as `storage` says)."""
    for name, kept in weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        bias = old.bias if old.bias is not None and old.bias.device.type != "meta" else None
        layer = kept.linear(bias, storage)
        layer.compute_dtype = storage.compute if storage is not None else None
        setattr(parent, child, layer)


def compute_placement(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) a built module computes in: its first float parameter not stored in fp8 (a bias, a norm;
    GGUF blocks are buffers), or, in a module of bias-free compact linears only (FLUX.2's embedders in an fp8
    or GGUF file), the compute dtype its layers were built for."""
    param = next((p for p in module.parameters() if p.dtype not in FP8_DTYPES), None)
    if param is not None:
        return param.dtype, param.device
    kept = next(m for m in module.modules() if isinstance(m, KeptLinear) and m.compute_dtype is not None)
    return kept.compute_dtype, next(t for t in (*kept.parameters(), *kept.buffers())).device
