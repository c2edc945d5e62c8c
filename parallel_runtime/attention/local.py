"""Single-device attention kernels in the [batch, seq, heads, head_dim] layout Flux uses.

`attention_with_lse` also returns the log-sum-exp of each query's scores, which Ring attention needs to
merge partial results exactly. It uses the fused kernels that expose the LSE (flash on CPU and on CUDA
half precision, memory-efficient on CUDA fp32) and falls back to plain math elsewhere.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [B, S, H, D] and lse [B, H, S] (float32)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True)[:2]
        lse = lse[..., : q.shape[1]]
    else:
        return _math_attention_with_lse(q, k, v)
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
