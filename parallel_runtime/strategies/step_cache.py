"""First-Block Cache in the workers' step loop, decided once per step for every rank.

The rule (ParaAttention's and cache-dit's FBCache): each step runs the DiT's first block, and compares the
residual it adds to the image stream with the one it added at the last computed step, as a relative L1 change
sum|r - r_prev| / sum|r_prev|. Under the threshold, the remaining blocks are skipped and their output delta of the
last computed step (final hidden rows minus the first block's output) is added to this step's first-block output;
otherwise they run and refresh the cache.

Under parallelism one rank sees only its rows (a sequence shard, one CFG branch), so each rank's sums go through
one all-reduce over the ranks holding different rows of the step (topology.STEP_ROW_DIMS: CFG, sequence and patch
shards; tensor ranks hold the same rows and pipeline stages other blocks, so neither adds to it): the change is the
whole step's, and every rank takes the same decision. The sums are float64, so a rank count changes them only at
round-off.

Under PipeFusion the first patch leaves stage 0 before the step's last patch has run the first block, so stage 0
decides step i from the change measured at step i-1 over all its patches (against the last computed step, as
above), and each stage passes the decision on to the next ahead of the step's hidden rows. Each stage caches the
delta its own blocks add to each patch, so a skipped step adds them stage by stage: together, serial's delta.
Warm-up steps always compute (they fill the stale K/V every patch reads afterwards), so the first step that may
skip is warmup_steps + 2 (the first patch step has no earlier patch step to compare with).

Blocks are split generically over the family seam: an adapter runs `self.chunks[chunk]` in `run_blocks`, so the
first block and the rest run as two one-chunk passes (`run_block_range`), for every family alike.
"""
from __future__ import annotations

import contextlib
from typing import Hashable

import torch

from ..distributed.comm import Comm
from ..spec import StrategySpec

FIRST_BLOCKS = 1  # how many blocks measure the change (FBCache's one; more is DBCache's Fn)


@contextlib.contextmanager
def block_range(adapter, blocks: range):
    """The adapter's chunk 0 narrowed to `blocks` (one forward pass runs chunk 0: the whole model off a pipeline)."""
    chunks = adapter.chunks
    adapter.chunks = [blocks]
    try:
        yield
    finally:
        adapter.chunks = chunks


def split_first(blocks: range) -> tuple[range, range]:
    """A run of blocks as (the FIRST_BLOCKS that measure the change, the rest a skipped step reuses)."""
    return range(blocks.start, blocks.start + FIRST_BLOCKS), range(blocks.start + FIRST_BLOCKS, blocks.stop)


def run_block_range(adapter, blocks: range, image, text, temb, rope, **extra):
    with block_range(adapter, blocks):
        return adapter.run_blocks(image, text, temb, rope, **extra)


class FirstBlockCache:
    """One job's cache state on one rank: per forward pass (a branch group), the first block's last computed
    residual and the remaining blocks' last output delta, both over this rank's rows; and the steps skipped."""

    def __init__(self, spec: StrategySpec, n_steps: int, comm: Comm):
        self.threshold, self.n_steps = float(spec.cache_threshold), n_steps
        self.start, self.end = spec.cache_start, spec.cache_end
        self.comm, self.group = comm, comm.group("step_rows")
        self.residual: dict[Hashable, torch.Tensor] = {}  # key -> first block's residual of the last computed step
        self.delta: dict[Hashable, torch.Tensor] = {}  # key -> remaining blocks' output - input, same step
        self.skipped: list[int] = []
        self.changes: list[tuple[int, float]] = []  # (step, the whole step's relative change it was decided on)
        self._sums: list[torch.Tensor] = []  # this step's [changed, previous] L1 sums, one pair per pass

    def in_window(self, i: int) -> bool:
        return self.start <= i / self.n_steps < self.end

    def measure(self, key: Hashable, residual: torch.Tensor) -> None:
        """Add one forward pass's first-block residual (this rank's rows) to the step's sums."""
        previous = self.residual.get(key)
        if previous is not None:
            prev = previous.double()
            self._sums.append(torch.stack([(residual.double() - prev).abs().sum(), prev.abs().sum()]))

    def decide(self, i: int, keys: list[Hashable]) -> bool:
        """Whether step i skips the remaining blocks, the same on every rank (one all-reduce of the step's sums).
        Outside the window, or before every pass has a cache, the step computes (and no rank waits for a sum):
        both are the same on every rank, which run the same steps."""
        sums, self._sums = self._sums, []
        if not self.in_window(i) or not sums or any(k not in self.delta for k in keys):
            return False
        total = self.comm.all_reduce(torch.stack(sums).sum(0), self.group, op="cache").tolist()
        if total[1] <= 0:  # the first block added nothing last time: nothing to measure against
            return False
        change = total[0] / total[1]
        self.changes.append((i, change))
        skip = change < self.threshold
        if skip:
            self.skipped.append(i)
        return skip

    def refresh(self, key: Hashable, first_out: torch.Tensor, final: torch.Tensor,
                residual: torch.Tensor | None = None) -> None:
        """A computed step's remaining-block delta of one pass, and its first-block residual where this rank ran
        the first block (a PipeFusion stage past the first keeps only its own blocks' delta)."""
        if residual is not None:
            self.residual[key] = residual
        self.delta[key] = final - first_out

    def reuse(self, key: Hashable, first_out: torch.Tensor) -> torch.Tensor:
        """A skipped step's output rows: this step's first-block output plus the cached remaining-block delta."""
        return first_out + self.delta[key]
