"""The fused kernels Ring attention takes its log-sum-exp from, on this GPU, against float64: flash,
memory-efficient and plain math, alone and merged over split K/V as Ring merges them."""
from __future__ import annotations

import pytest
import torch

from parallel_runtime.strategies.attention.local import FLASH_CUDA_CAPABILITIES, attention_with_lse, lse_kernel

from .numerics import LSE_ATOL, OUT_RTOL, attention_bias, errors, inputs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _runs_here(kernel: str, dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    if kernel == "flash":  # half precision only, on the architectures torch builds flash for
        lo, hi = FLASH_CUDA_CAPABILITIES
        return dtype != torch.float32 and lo <= capability <= hi
    if kernel == "efficient":
        return not (dtype == torch.bfloat16 and capability < (8, 0))
    return True


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kernel", ["flash", "efficient", "math"])
def test_kernel_and_ring_merge_match_float64(gpu, kernel, dtype, masked):
    """`bias`: an attention mask (ComfyUI's attention_mask), which the efficient kernel takes aligned and
    expanded; flash takes none (lse_kernel never picks it for a bias)."""
    capability = torch.cuda.get_device_capability(gpu)
    if not _runs_here(kernel, dtype, capability) or (masked and kernel == "flash"):
        pytest.skip(f"{kernel} has no {dtype}{' biased' if masked else ''} kernel on compute capability {capability}")
    q, k, v = inputs(gpu, dtype)
    e = errors(q, k, v, kernel, bias=attention_bias(q, k) if masked else None)
    print(f"\n{kernel} {dtype} {'bias' if masked else 'plain'}: {e}")
    assert e["out"] <= OUT_RTOL[dtype] and e["merged_out"] <= OUT_RTOL[dtype], e
    assert e["lse"] <= LSE_ATOL and e["merged_lse"] <= LSE_ATOL, e


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_automatic_choice_runs_on_this_gpu(gpu, dtype):
    capability = torch.cuda.get_device_capability(gpu)
    kernel = lse_kernel("cuda", dtype, capability)
    assert _runs_here(kernel, dtype, capability)
    q, k, v = inputs(gpu, dtype)
    out, lse = attention_with_lse(q, k, v)  # what Ring calls
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, 4, q.shape[1])
