"""PipeFusion: patch-level pipeline parallelism with stale activations (xDiT, Fang et al. 2024).

The transformer's blocks are split into contiguous stages, one per pipeline rank, and the latent into
`M` patches of token rows. After `warmup_steps` synchronous steps on the whole latent, stage 0 feeds
patch after patch; while a patch flows down the stages the next one follows, and the last stage applies
the sampler update to each patch as it leaves, sending it straight back to stage 0 for the next step —
the pipeline is never flushed between steps.

A patch's queries must still attend over the whole image. Each attention layer therefore keeps a
full-sequence K/V buffer (`StaleKVCache`): the current patch writes fresh rows and reads the other rows
as the previous step left them. Diffusion inputs change little between adjacent steps, so the stale
rows cost little accuracy; the warmup steps fill the buffers with exact values.
"""
from __future__ import annotations

import torch


class StaleKVCache:
    """Per-layer K/V buffers over the full sequence [text, image] of one stage."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.buffers: dict[int, torch.Tensor] = {}
        self._companion: StaleKVCache | None = None

    def companion(self, seq_len: int) -> "StaleKVCache":
        """Buffers over a sequence of another length kept with these (a ControlNet's, which lacks the DiT's
        reference rows): they live as long as this cache, and start empty when the length changes."""
        if self._companion is None or self._companion.seq_len != seq_len:
            self._companion = StaleKVCache(seq_len)
        return self._companion

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        buf = self.buffers.get(layer)
        if buf is None:
            buf = self.buffers[layer] = k.new_zeros((2, k.shape[0], self.seq_len, *k.shape[2:]))
        buf[0].index_copy_(1, positions, k)
        buf[1].index_copy_(1, positions, v)
        return buf[0], buf[1]

    def nbytes(self) -> int:
        # A copy of the values: a worker's ping thread reads this while a job may be adding layers.
        own = sum(b.numel() * b.element_size() for b in list(self.buffers.values()))
        return own + (self._companion.nbytes() if self._companion is not None else 0)


class StaleKVAttention:
    """Write this call's fresh K/V rows into the buffer, attend over the whole (partly stale) buffer."""

    def __init__(self, cache: StaleKVCache, inner):
        self.cache, self.inner = cache, inner
        self.positions: torch.Tensor | None = None  # global rows of the current call's K/V; set per patch

    def __call__(self, q, k, v, layer: int, masked: bool = True):
        k_all, v_all = self.cache.update(layer, self.positions, k, v)
        return self.inner(q, k_all, v_all, layer, masked=masked)
