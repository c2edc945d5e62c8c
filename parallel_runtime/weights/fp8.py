"""fp8 weights kept in fp8 on a rank: plain fp8 files, ComfyUI's scaled fp8 (`scale_weight` per layer) and
weight_dtype fp8 casts, upcast per call or multiplied in fp8 as ComfyUI does (`Storage` decides which)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .storage import KeptLinear, Storage


class Fp8Linear(KeptLinear):
    """A Linear whose weight stays in fp8 on the rank; each call upcasts it to the input's dtype (and applies
    the file's per-tensor scale on the side ComfyUI applies it: the smaller of weight and input), or, on the
    `kernel` path, quantizes the input to fp8 and multiplies in fp8 as ComfyUI's float8_e4m3fn layers do."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None, kernel: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.register_buffer("scale_weight", scale.reshape(()).float() if scale is not None else None)
        self.register_buffer("scale_input", input_scale.reshape(()).float() if input_scale is not None else None)
        self.kernel = kernel

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        weight = self.weight.to(dtype)
        return weight * self.scale_weight.to(dtype) if self.scale_weight is not None else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.patch is not None:
            return F.linear(x, self.patch(self, x.dtype), bias)
        if self.kernel:
            return self._fp8_matmul(x, bias)
        weight = self.weight.to(x.dtype)
        if self.scale_weight is None:
            return F.linear(x, weight, bias)
        scale = self.scale_weight.to(x.dtype)
        if weight.numel() < x.numel():
            return F.linear(x, weight * scale, bias)
        return F.linear(x * scale, weight, bias)

    def _fp8_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from .comfy_quant import fp8_kernel_linear

        return fp8_kernel_linear(x, self.weight, self.scale_weight, self.scale_input, bias)

    def extra_repr(self) -> str:
        path = ", kernel" if self.kernel else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight.dtype}{path}"


@dataclass
class Fp8Weight:
    """A linear weight a rank keeps in fp8 (with the file's per-tensor scale, if any)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    input_scale: torch.Tensor | None = None  # a scaled file's `scale_input` (its fp8 kernel's static input scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def linear(self, bias: torch.Tensor | None, storage: Storage | None = None) -> torch.nn.Module:
        kernel = storage is not None and storage.fp8_kernel(self.weight.dtype, self.scale is not None)
        return Fp8Linear(self.weight.contiguous(), bias, self.scale, self.input_scale, kernel)
