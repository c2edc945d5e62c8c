"""The fp64 attention reference and the kernel tolerances, shared by the CPU checks (tests/test_gpu_readiness.py)
and the CUDA ones (tests/gpu/test_cuda_kernels.py) of `attention_with_lse` and Ring's `merge_partials`."""
from __future__ import annotations

import math

import torch

from parallel_runtime.strategies.attention.local import attention_with_lse, merge_partials

# Relative L2 error of the attention output against fp64 on the same (already rounded) inputs. A kernel
# rounds twice in its dtype, the softmax weights before P @ V and the output, at 2^-(mantissa bits + 1)
# relative each; Ring's merge adds one more rounding of the merged output.
OUT_RTOL = {
    torch.float32: 1e-5,  # 6e-8 per rounding, growing with the 128-long dot products; CPU measured 1.0e-6
    torch.float16: 2e-3,  # 4.9e-4 per rounding; CPU measured 2.4e-4 (one kernel), 3.1e-4 (three merged)
    torch.bfloat16: 1e-2,  # 3.9e-3 per rounding; CPU measured 1.9e-3 (one kernel), 2.5e-3 (three merged)
}
# Max abs error of the float32 log-sum-exp (|lse| ~ 10 here). Scores accumulate in fp32 and half-precision
# products are exact in fp32, so only the kernels' exp/log approximations remain: CPU measured 5e-5. A
# wrong scale, log base or unstripped padding is off by 0.1 or more.
LSE_ATOL = 1e-3


def inputs(device, dtype, queries: int = 300, keys: int = 421, heads: int = 4, head_dim: int = 128, seed: int = 0):
    """q, k, v [B, S, H, D] in `dtype`. Lengths that no kernel tile divides, so the LSE padding shows."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, n, heads, head_dim, generator=g, dtype=torch.float64) * 1.5).to(device, dtype)
                 for n in (queries, keys, keys))


def attention_bias(q, k, seed: int = 1) -> torch.Tensor:
    """An attention mask's block [1, 1, Sq, Sk] in q's dtype: random biases, a few keys masked out (-inf) for
    every query, and queries that see only the last block's keys (so Ring meets blocks it must ignore)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(1, 1, q.shape[1], k.shape[1], generator=g, dtype=torch.float64)
    bias[..., 5:9] = float("-inf")
    bias[..., 40:50, :-60] = float("-inf")
    return bias.to(q.device, q.dtype)


def reference(q, k, v, bias=None):
    """Softmax attention and its log-sum-exp in float64."""
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.double()
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v.double()), scores.logsumexp(-1)


def errors(q, k, v, kernel: str, cuts=(100, 101), bias=None) -> dict[str, float]:
    """One kernel call over all keys, and Ring's way (blocks of keys split at `cuts`, merged by LSE), each
    against fp64: relative L2 of the output, max abs of the LSE. `bias`: an attention mask's block, cut with
    the keys."""
    ref_out, ref_lse = reference(q, k, v, bias)

    def err(out, lse):
        return (float((out.double() - ref_out).norm() / ref_out.norm()), float((lse.double() - ref_lse).abs().max()))

    out, lse = attention_with_lse(q, k, v, kernel=kernel, bias=bias)
    merged = merged_lse = None
    bounds = [0, *cuts, k.shape[1]]
    for a, b in zip(bounds, bounds[1:]):
        block_bias = None if bias is None else bias[..., a:b]
        block_out, block_lse = attention_with_lse(q, k[:, a:b], v[:, a:b], kernel=kernel, bias=block_bias)
        merged, merged_lse = merge_partials(merged, merged_lse, block_out, block_lse)
    (o, l), (mo, ml) = err(out, lse), err(merged.to(q.dtype), merged_lse)
    return {"out": o, "lse": l, "merged_out": mo, "merged_lse": ml}
