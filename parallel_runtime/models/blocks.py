"""The block loop every adapter runs: a PipeFusion chunk's blocks in order, SkipLayerGuidance's skipped blocks
passing their input on, ControlNet residuals added to the image rows after each block.

An adapter that inherits `BlockLoop` writes one block (`block(i, image, text, temb, rope)` -> (image, text)) and
gets `run_blocks` as the strategies call it; an adapter whose loop differs (a fused single-stream list, a shared
modulation cut per block) walks `active_blocks(chunk)` in its own `run_blocks`.
"""
from __future__ import annotations

from typing import Iterator

import torch


def add_residual(image: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """A ControlNet residual added to the first rows of `image` (the latent's; reference rows after them stay)."""
    n = add.shape[1]
    return torch.cat([image[:, :n] + add, image[:, n:]], dim=1)


class BlockLoop:
    chunks: list[range]  # set by the adapter: the block ranges this rank runs
    skip: frozenset = frozenset()  # blocks whose output is their input this job (SkipLayerGuidance), set per job

    def active_blocks(self, chunk: int = 0) -> Iterator[int]:
        """Indices of the chunk's blocks that run this job (skipped ones pass their input on)."""
        return (i for i in self.chunks[chunk] if i not in self.skip)

    def block(self, i: int, image: torch.Tensor, text: torch.Tensor, temb, rope) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} runs its blocks in its own run_blocks")

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb, rope, chunk: int = 0,
                   residuals=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's blocks; `residuals` (strategies.control.Residuals): ControlNet residuals added to the image
        rows after each block, also after a skipped one, as ComfyUI adds `control`."""
        for i in self.chunks[chunk]:
            if i not in self.skip:
                image, text = self.block(i, image, text, temb, rope)
            add = residuals.get(i) if residuals is not None else None
            if add is not None:
                image = add_residual(image, add)
        return image, text
