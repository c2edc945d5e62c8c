"""Single-device attention kernels in the [batch, seq, heads, head_dim] layout Flux uses.

`attention_with_lse` also returns the log-sum-exp of each query's scores, which Ring attention needs to
merge partial results exactly. It calls the fused kernel that exposes the LSE for the inputs (`lse_kernel`)
and falls back to plain math where none fits.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

# Compute capabilities torch's CUDA flash-attention kernels are built for (torch 2.13: sm80 to sm121).
FLASH_CUDA_CAPABILITIES = ((8, 0), (12, 1))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def lse_kernel(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> str:
    """The kernel that gives attention with its log-sum-exp for these inputs.

    'flash_cpu' on CPU; on CUDA 'flash' for half precision where the flash kernels exist (sm80+), else the
    memory-efficient kernel (every dtype from sm50; bf16 only from sm80, below which there is no bf16
    kernel and 'math' remains); 'math' on anything else.
    """
    if device_type == "cpu":
        return "flash_cpu"
    if device_type != "cuda" or capability is None:
        return "math"
    capability = tuple(capability)
    lo, hi = FLASH_CUDA_CAPABILITIES
    if dtype in (torch.float16, torch.bfloat16) and lo <= capability <= hi:
        return "flash"
    if dtype == torch.bfloat16 and capability < (8, 0):
        return "math"
    return "efficient"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [B, S, H, D] and lse [B, H, S] (float32). `kernel` overrides `lse_kernel`'s choice."""
    kernel = kernel or lse_kernel(q.device.type, q.dtype, _capability(q.device))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if kernel == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    elif kernel == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True)[:2]
        lse = lse[..., : q.shape[1]]  # the kernel pads the LSE's sequence dimension
    elif kernel == "math":
        return _math_attention_with_lse(q, k, v)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return out.transpose(1, 2), lse.float()


def _math_attention_with_lse(q, k, v):
    scores = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


def merge_partials(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets: exact, since softmax weights rescale by exp(lse)."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # lse is [B, H, S]; outputs are [B, S, H, D].
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


class LocalAttention:
    """Attention over exactly the keys this rank holds."""

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        return attention(q, k, v)
