"""Rotary position tables and the ids they are built from.

Every family here rotates with the formula of ComfyUI's EmbedND (angles in float64, pairs interleaved, one
frequency band per id axis), which diffusers' FluxPosEmbed reproduces; a family only says where each token sits
(its ids) and how wide each axis's band is. Ids are built for the whole canonical sequence, so any shard indexes
its own rows.
"""
from __future__ import annotations

import math

import torch


def rope_table(ids: torch.Tensor, axes: tuple[int, ...], theta: float = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [L, head_dim] of ids [L, len(axes)] (EmbedND's formula, float64 angles, float32 tables)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    return FluxPosEmbed(theta=theta, axes_dim=list(axes))(ids)


def grid_ids(rows: int, cols: int, index: int = 0, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """Ids [index, row0 + r, col0 + c] of a rows x cols token grid, row-major (an image's, a reference's)."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 0] = index
    ids[..., 1] = row0 + torch.arange(rows)[:, None]
    ids[..., 2] = col0 + torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


def video_grid_ids(frames: int, rows: int, cols: int) -> torch.Tensor:
    """Ids [frame, row, column] of a frames x rows x cols token grid, in token order."""
    ids = torch.zeros(frames, rows, cols, 3)
    ids[..., 0] = torch.arange(frames)[:, None, None]
    ids[..., 1] = torch.arange(rows)[None, :, None]
    ids[..., 2] = torch.arange(cols)[None, None, :]
    return ids.reshape(-1, 3)


def probe_ids(text: int, image: int) -> torch.Tensor:
    """Ids of a cost probe's sequence (`DiTFamily.block_inputs`): `text` prompt rows at 0, then the first `image`
    tokens of a near-square grid, as a job of that many tokens would place them."""
    cols = max(1, math.isqrt(image))
    return torch.cat([torch.zeros(text, 3), grid_ids(-(-image // cols), cols)[:image]])
