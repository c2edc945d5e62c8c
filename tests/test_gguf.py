"""GGUF block formats: ParaDiT's torch dequantizers against the `gguf` package's reference (numpy) ones.

Q8_0 and Q4_0 blocks come from gguf's own quantizer; the K-quants (which gguf-py can read but not write)
from random bytes with finite fp16 scales, which exercises every bit of their packing. Equal bit for bit:
both follow ggml's float32 arithmetic in the same order.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as reference  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from parallel_runtime.models.gguf_quants import BLOCKS, dequantize, row_bytes  # noqa: E402

ROWS, VALUES = 6, 512  # two K super-blocks, sixteen 32-blocks per row


def random_blocks(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, bytes_per_row] of random blocks whose fp16 fields are finite, moderate numbers."""
    per_block, size = BLOCKS[fmt]
    blocks = rng.integers(0, 256, size=(ROWS * VALUES // per_block, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[fmt]
    for start in halves:
        blocks[:, start:start + 2] = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_dequantize_equals_the_reference_bit_for_bit(fmt):
    rng = np.random.default_rng(3)
    if fmt in ("Q8_0", "Q4_0"):
        raw = quantize(rng.standard_normal((ROWS, VALUES)).astype(np.float32), getattr(T, fmt))
    else:
        raw = random_blocks(fmt, rng)
    assert raw.shape == (ROWS, row_bytes(fmt, VALUES))
    want = torch.from_numpy(reference(raw, getattr(T, fmt)).copy())
    got = dequantize(torch.from_numpy(raw), fmt, (ROWS, VALUES), torch.float32)
    assert got.shape == want.shape and torch.equal(got, want)
    # a slice of rows dequantizes on its own (a rank holds only its rows of a fused tensor)
    part = dequantize(torch.from_numpy(raw[2:5]), fmt, (3, VALUES), torch.float32)
    assert torch.equal(part, want[2:5])


def test_gguf_row_bytes_refuse_partial_blocks():
    assert row_bytes("Q4_K", 512) == 288 and row_bytes("Q8_0", 64) == 68
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        row_bytes("Q4_K", 100)
