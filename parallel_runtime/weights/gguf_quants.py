"""GGUF block formats dequantized with torch, on the device that holds the blocks.

A quantized GGUF tensor is rows of fixed-size blocks (each row: its values' blocks, back to back), so a rank
keeps its rows as raw bytes [rows, bytes_per_row] and a layer dequantizes its weight just before it runs: on
a GPU that is a few elementwise kernels, where a round trip through numpy would stall every layer.

The arithmetic runs in `math` dtype in ggml's order of operations. float16 (the runtime's choice) is what
ComfyUI-GGUF computes by default (its block scales stay fp16, so every product rounds to fp16), which makes a
GGUF model give ComfyUI-GGUF's numbers; float32 gives the `gguf` package's reference values bit for bit
(tests/test_gguf.py).
"""
from __future__ import annotations

import torch

QK_K = 256  # values per K-quant super-block

# format -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def _f16(raw: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    """Little-endian fp16 pairs of bytes -> [n, 1] in math dtype `m`."""
    return raw.contiguous().view(torch.float16).to(m)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes] values: per run of `width` bytes, their low nibbles, then their high ones."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return ((qs.reshape(n, -1, 1, width) >> shifts) & 0x0F).reshape(n, -1)


def _q8_0(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    return _f16(b[:, :2], m) * b[:, 2:].contiguous().view(torch.int8).to(m)


def _q4_0(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return _f16(b[:, :2], m) * q.to(m)


def _q4_1(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    return _f16(b[:, :2], m) * _nibbles(b[:, 4:], 16).to(m) + _f16(b[:, 2:4], m)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] values of bit j << 4 (value j's fifth bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).reshape(1, 1, 8)
    return ((qh.reshape(-1, 4, 1) >> shifts) & 0x01).reshape(-1, 32) << 4


def _q5_0(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    q = (_nibbles(b[:, 6:], 16) | _fifth_bits(b[:, 2:6])).to(torch.int8) - 16
    return _f16(b[:, :2], m) * q.to(m)


def _q5_1(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 16) | _fifth_bits(b[:, 4:8])
    return _f16(b[:, :2], m) * q.to(m) + _f16(b[:, 2:4], m)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks -> two [n, 8] uint8."""
    d, m, m_d = scales.reshape(scales.shape[0], 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _scaled(b: torch.Tensor, q: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    """Q4_K/Q5_K: d * scale * q - dmin * min per 32-value sub-block."""
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2], m) * sc.to(m)).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4], m) * mn.to(m)).reshape(n, 8, 1)
    return (d * q.reshape(n, 8, 32).to(m) - dm).reshape(n, QK_K)


def _q4_k(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    return _scaled(b, _nibbles(b[:, 16:], 32), m)


def _q5_k(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 0x01  # bit k of each byte: sub-block k's fifth bit
    return _scaled(b, low | (high << 4), m)


def _q6_k(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    d = (_f16(d, m) * scales.contiguous().view(torch.int8).to(m)).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).to(m)).reshape(n, QK_K)


def _shifted(q: torch.Tensor, shifts: list[int], width: int) -> torch.Tensor:
    """[n, bytes] -> [n, len(shifts) * bytes]: per run of `width` bytes, the bytes shifted by each of `shifts`."""
    n = q.shape[0]
    s = torch.tensor(shifts, dtype=torch.uint8, device=q.device).reshape(1, 1, len(shifts), 1)
    return (q.reshape(n, -1, 1, width) >> s).reshape(n, -1)


def _q2_k(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b[:, 80:82], m) * (scales & 0x0F).to(m)).reshape(n, 16, 1)
    ml = (_f16(b[:, 82:84], m) * (scales >> 4).to(m)).reshape(n, 16, 1)
    q = (_shifted(qs, [0, 2, 4, 6], 32) & 0x03).reshape(n, 16, 16)
    return (dl * q.to(m) - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor, m: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = _shifted(scales[:, :8], [0, 4], 8)
    high = _shifted(scales[:, 8:], [0, 2, 4, 6], 4)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (_f16(b[:, 108:110], m) * sc.to(m)).reshape(n, 16, 1)
    ql = (_shifted(qs, [0, 2, 4, 6], 32) & 0x03).reshape(n, 16, 16)
    qh = ((_shifted(hmask, list(range(8)), 32) & 0x01) ^ 0x01).reshape(n, 16, 16)
    q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
    return (dl * q.to(m)).reshape(n, QK_K)


_DEQUANTIZE = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


COMFYUI_GGUF_MATH = torch.float16  # ComfyUI-GGUF's default (dequant_dtype "default"): fp16 block arithmetic


def dequantize(data: torch.Tensor, fmt: str, shape: tuple[int, ...], dtype: torch.dtype,
               math: torch.dtype = COMFYUI_GGUF_MATH) -> torch.Tensor:
    """Raw rows of `fmt` blocks (uint8 [rows, bytes_per_row]) -> a `dtype` tensor of `shape`, the block
    arithmetic done in `math` (see the module docstring)."""
    per_block, size = BLOCKS[fmt]
    blocks = data.reshape(-1, size)
    return _DEQUANTIZE[fmt](blocks, math).reshape(shape).to(dtype)


def row_bytes(fmt: str, values: int) -> int:
    """Bytes of one row of `values` values (a whole number of blocks)."""
    per_block, size = BLOCKS[fmt]
    if values % per_block:
        raise ValueError(f"{values} values are not whole {fmt} blocks of {per_block}")
    return values // per_block * size
