"""Displaced patch parallelism (DistriFusion, Li et al. 2024): each rank computes its patch of every layer, and
its attention reads the other patches' K/V as the previous step left them.

Every rank holds the whole model and a shard of the token sequence (text, image and reference rows, cut as the
TokenLayout cuts them). At each attention layer it writes its own fresh K/V into a full-sequence buffer
(`StaleKVCache`, as PipeFusion's), attends over the whole buffer, and starts an all-gather of its fresh K/V;
the exchange runs while the rest of the block computes and lands in that layer's buffer (read again only at the
next step) when the next layer starts its own, where it becomes the next step's stale rows. So one layer's
gathered K/V is in flight at a time, not every layer's whole sequence until the pass ends (Flux at 1024^2 with
CFG in bf16: 6 GiB more per rank). Activations change little between adjacent steps, so one step's staleness
costs little accuracy — less than naive patch parallelism, whose patches never see each other. Warm-up steps
gather before attending instead: exact, and they fill the buffers.

Versus PipeFusion: no pipeline bubble and no weight split (every rank holds every block), one all-gather of K/V
per layer per step instead of point-to-point activations.
"""
from __future__ import annotations

import torch

from ..distributed.comm import Comm, Group
from .pipefusion import StaleKVCache


class DisplacedPatchAttention:
    """One rank's attention under displaced patch parallelism, for one kind of attention (joint or image-only).

    `positions[j]`: the rows of the buffer's sequence that member j of `group` holds; `inner`: the attention of
    this rank's queries over the whole buffer (with the attention mask's block for them, if any)."""

    def __init__(self, cache: StaleKVCache, comm: Comm, group: Group, positions: list[torch.Tensor], inner):
        self.cache, self.comm, self.group, self.positions, self.inner = cache, comm, group, positions, inner
        self.longest = max(len(p) for p in positions)
        self.sync = True  # warm-up: this step's K/V of every patch before attending (exact)
        self.pending: list = []  # (layer, work, parts) of the exchange in flight, at most one

    def __call__(self, q, k, v, layer: int, masked: bool = True):
        kv = self._padded(torch.stack([k, v]))  # one message per layer instead of two
        if self.sync:
            for j, part in enumerate(self._gather(kv, blocking=True)):
                self._write(layer, j, part)
            del part  # a view of the whole gather: gone before attention allocates
        else:
            self.land()  # the previous layer's buffer was read for this step: its temporaries go before ours
            self._write(layer, self.group.index, kv)
            self.pending.append((layer, *self._gather(kv, blocking=False)))
        buf = self.cache.buffers[layer]
        return self.inner(q, buf[0], buf[1], layer, masked=masked)

    def land(self) -> None:
        """Wait for the exchange in flight and write the other patches' K/V into its layer's buffer for the next
        step (also at the end of the forward pass: its last layer's)."""
        for layer, work, parts in self.pending:
            if work is not None:
                work.wait()
            for j, part in enumerate(parts):
                if j != self.group.index:
                    self._write(layer, j, part)
        self.pending.clear()

    def _gather(self, kv: torch.Tensor, blocking: bool):
        """Every member's `kv` into one tensor, the parts its views (a list of outputs costs NCCL a flat temporary
        as large and a copy out of it): the parts once gathered, or (work, parts) of the gather started."""
        gathered = kv.new_empty((self.group.size * kv.shape[0], *kv.shape[1:]))  # concatenated: gloo takes no stack
        if blocking:
            return self.comm.all_gather_into(gathered, kv, self.group, op="patch").chunk(self.group.size)
        return self.comm.all_gather_into_async(gathered, kv, self.group, op="patch"), gathered.chunk(self.group.size)

    def _padded(self, kv: torch.Tensor) -> torch.Tensor:
        """All-gather needs one shape on every member: shards that are a row short are padded (rows dropped again
        in _write)."""
        short = self.longest - kv.shape[2]
        return torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, short)) if short else kv

    def _write(self, layer: int, member: int, kv: torch.Tensor) -> None:
        n = len(self.positions[member])
        self.cache.update(layer, self.positions[member], kv[0, :, :n], kv[1, :, :n])
