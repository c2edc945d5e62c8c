"""Random draws that reproduce ComfyUI's: the initial noise and the ancestral step noise."""
from __future__ import annotations

from typing import Sequence

import torch


def prepare_noise(latent: torch.Tensor, seed: int, batch_index: Sequence[int] | None = None) -> torch.Tensor:
    """comfy.sample.prepare_noise: one CPU randn of the latent's shape.

    ComfyUI reseeds the global CPU generator; a private generator with the same
    seed yields the same numbers without touching global RNG state. With a
    LATENT's `batch_index` (e.g. from Latent From Batch), image k gets the noise
    that position batch_index[k] of a full batch would have got.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    if batch_index is None:
        return torch.randn(latent.size(), dtype=latent.dtype, layout=latent.layout, generator=generator,
                           device="cpu")
    wanted = sorted(set(batch_index))
    draws = {}
    for i in range(wanted[-1] + 1):
        noise = torch.randn([1, *latent.shape[1:]], dtype=latent.dtype, layout=latent.layout, generator=generator,
                            device="cpu")
        if i in wanted:
            draws[i] = noise
    return torch.cat([draws[i] for i in batch_index])


class StepNoise:
    """The noise ComfyUI's default_noise_sampler hands an ancestral sampler, by step.

    default_noise_sampler seeds a fresh generator on the device of x (the
    model's load device, so CUDA under ComfyUI on a GPU) and each call draws
    randn(x.shape). Calls happen in step order, but only on steps that renoise:
    for the RF (CONST) euler_ancestral that is every step with sigmas[i+1] != 0.
    Pass `sigmas` so that mapping is exact; without it step i is draw i.

    at(i) makes all earlier draws first, then caches draws so regions of the same
    step asked for in any order get the same tensor. drop_before() frees the
    cache; a dropped draw asked for again is replayed from the seed.
    """

    def __init__(self, seed: int, latent_shape: Sequence[int], sigmas: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.seed = seed
        self.shape = tuple(int(n) for n in latent_shape)
        self.device = torch.device(device)
        self.dtype = dtype
        # draw_of[i] = index of the noise-sampler call made at step i, or None.
        self._draw_of: list[int | None] | None = None
        if sigmas is not None:
            self._draw_of, k = [], 0
            for i in range(len(sigmas) - 1):
                draws = float(sigmas[i + 1]) != 0.0
                self._draw_of.append(k if draws else None)
                k += int(draws)
        self._cache: dict[int, torch.Tensor] = {}
        self._generator: torch.Generator | None = None
        self._next = 0  # index of the next draw the live generator will make

    def draws_at(self, i: int) -> bool:
        """Whether ComfyUI calls the noise sampler on step i."""
        return self._draw_index(i) is not None

    def _draw_index(self, i: int) -> int | None:
        if i < 0:
            raise IndexError(f"Step index must be >= 0, got {i}.")
        if self._draw_of is None:
            return i
        if i >= len(self._draw_of):
            raise IndexError(f"Step {i} is past the last step {len(self._draw_of) - 1}.")
        return self._draw_of[i]

    def _restart(self) -> None:
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(self.seed)
        self._next = 0

    def _draw(self) -> torch.Tensor:
        out = torch.randn(self.shape, dtype=self.dtype, device=self.device, generator=self._generator)
        self._next += 1
        return out

    def at(self, i: int) -> torch.Tensor:
        """Step i's full [B, C, H, W] noise (the same tensor on every call while cached)."""
        k = self._draw_index(i)
        if k is None:
            raise ValueError(f"ComfyUI draws no ancestral noise at step {i} (its next sigma is 0).")
        if k in self._cache:
            return self._cache[k]
        if self._generator is None or k < self._next:
            # First use, or a draw that was dropped: replay the stream from the seed.
            self._restart()
            while self._next < k:
                self._draw()
            self._cache[k] = self._draw()
            return self._cache[k]
        # Keep intervening draws: regions lagging behind will ask for them.
        while self._next <= k:
            idx = self._next
            drawn = self._draw()
            self._cache.setdefault(idx, drawn)
        return self._cache[k]

    def drop_before(self, i: int) -> None:
        """Forget cached draws of steps before i (they stay reproducible by replay)."""
        if self._draw_of is None:
            limit = i
        else:
            later = [k for k in self._draw_of[i:] if k is not None]
            limit = later[0] if later else (max([k for k in self._draw_of if k is not None], default=-1) + 1)
        for k in [k for k in self._cache if k < limit]:
            del self._cache[k]
