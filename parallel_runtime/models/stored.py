"""How a rank stores a checkpoint's weights and computes with them: fp8 kept fp8, computed as ComfyUI does.

ComfyUI keeps an fp8 file's linear weights in fp8 and upcasts each one to the compute dtype when its layer
runs ("manual cast"); a scaled-fp8 file (ComfyUI's `scaled_fp8` marker and a `scale_weight` per layer)
multiplies the upcast weight by its scale. A rank does the same with the linear layers it owns
(`Fp8Linear`), so it holds half the bytes of bf16; every other tensor (norms, biases, embeddings) is small
and is read in the compute dtype.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALED_FP8_MARKER = "scaled_fp8"  # ComfyUI's key for "this file's fp8 weights carry per-layer scales"


@dataclass(frozen=True)
class Storage:
    """`compute`: the dtype layers run in. `keep_fp8`: linear weights stored in fp8 in the file stay fp8 (else
    they are upcast at load). `cast_fp8`: cast every linear weight to this fp8 dtype at load, as UNETLoader's
    weight_dtype fp8 options do (the other tensors are rounded through it too, as ComfyUI stores them)."""

    compute: torch.dtype
    keep_fp8: bool = True
    cast_fp8: torch.dtype | None = None
    # A scaled-fp8 file's type: ComfyUI builds every Linear of such a model in it, biases included.
    scaled_fp8: torch.dtype | None = None

    def for_file(self, reader) -> "Storage":
        """This storage for one file: a scaled-fp8 file's marker names the fp8 type of all its linear layers
        (an fp32 marker means e4m3fn, as in ComfyUI)."""
        key = next((k for k in reader.keys() if k.rpartition(".")[2] == SCALED_FP8_MARKER), None)
        if key is None or not self.keep_fp8:
            return self
        marker = reader.dtype(key)
        return dataclasses.replace(self, scaled_fp8=marker if marker in FP8_DTYPES else FP8_DTYPES[0])

    def linear_dtype(self, stored: torch.dtype) -> torch.dtype | None:
        """The dtype a linear weight stored as `stored` is kept in on the rank; None: the compute dtype."""
        forced = self.cast_fp8 or self.scaled_fp8
        if forced is not None:
            return forced
        return stored if self.keep_fp8 and stored in FP8_DTYPES else None

    def rounding(self, linear_bias: bool) -> torch.dtype | None:
        """The fp8 type another tensor is rounded through before the compute dtype, as ComfyUI stores it."""
        return self.cast_fp8 or (self.scaled_fp8 if linear_bias else None)


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "scale_weight"


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight stays in fp8 on the rank; each call upcasts it to the input's dtype (and applies
    the file's per-tensor scale on the side ComfyUI applies it: the smaller of weight and input)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.register_buffer("scale_weight", scale.reshape(()).float() if scale is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.scale_weight is None:
            return F.linear(x, weight, bias)
        scale = self.scale_weight.to(x.dtype)
        if weight.numel() < x.numel():
            return F.linear(x, weight * scale, bias)
        return F.linear(x * scale, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight.dtype}"


def linear_names(model: torch.nn.Module) -> dict[str, str]:
    """`<module>.weight` and `<module>.bias` -> module name, for every nn.Linear of a (meta-device) model."""
    return {f"{name}.{p}": name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            for p in ("weight", "bias")}


def install_fp8_linears(model: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Replace each Linear named in `weights` (module name -> (fp8 weight, scale or None)) by an Fp8Linear that
    keeps its already-loaded bias."""
    for name, (weight, scale) in weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        bias = old.bias if old.bias is not None and old.bias.device.type != "meta" else None
        setattr(parent, child, Fp8Linear(weight, bias, scale))


def compute_placement(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) a built module computes in: its first tensor not stored in fp8 (a bias, a norm)."""
    param = next(p for p in module.parameters() if p.dtype not in FP8_DTYPES)
    return param.dtype, param.device
