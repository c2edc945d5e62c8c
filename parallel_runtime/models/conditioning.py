"""How the timestep conditions the blocks: its sinusoid features and adaLN's modulation of the normed rows.

Written as ComfyUI writes them, so a family that uses these rounds where ComfyUI's model rounds: the sinusoid in
float32 (comfy's timestep_embedding), the modulation as one fused multiply-add (torch.addcmul).
"""
from __future__ import annotations

import torch


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """comfy's timestep_embedding: [cos, sin] of t x 10000^(-i / half), in float32."""
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs.to(t.device)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x (already normed) x (1 + scale) + shift, in one addcmul as ComfyUI's Wan, HunyuanVideo and MiniMax
    write it (a separate multiply and add rounds differently in the last bit)."""
    return torch.addcmul(shift, x, 1 + scale)
