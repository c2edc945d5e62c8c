"""Sharded block weights during a job: each block gathered from the replica group just before it runs, the next one
prefetched while it computes, and released once the next block starts.

The ranks of a replica group (those that would hold the same blocks: CFG, Ulysses, Ring or patch ranks of one
PipeFusion stage and tensor rank) each keep 1/N of every block's bytes (weights/sharded.py). Per-rank weight
memory is then the non-block weights + 1/N of the blocks + two whole blocks (the running one and the prefetch).

Every rank of the group must issue the same all-gathers in the same order, yet ranks do not always run the same
blocks: a SkipLayerGuidance patch skips a block in one CFG branch only. So the gathers do not follow what runs
but a walk over the blocks in pipeline order, cyclically: entering block i first lands (and drops) the gathers of
the blocks between the last one run and i, and the end of a job walks to the end of the cycle and lands the first
block's prefetch. Every rank thereby issues one gather per block per forward pass, plus one at the end, whatever
it skipped; the forward passes per job are the same on every rank of the group (one per branch, lane and patch).
A block is entered when any of its modules is called (a pre-hook on each) or anything of it is looked up on the
block (its class gains a `__getattr__` that enters first), so families that run a block through its submodules
(Lumina 2's `_block`) or read its tensors themselves (Wan's `block.modulation`) gather it as those that call it.
Only the job's own thread enters, and only while a job is bound: a status ping that counts bytes never gathers.
"""
from __future__ import annotations

import functools
import threading

import torch

from ..weights.sharded import ShardedBlock


class BlockGatherer:
    """The gather schedule of one model's sharded blocks (in pipeline order) on one rank."""

    def __init__(self, blocks: list[ShardedBlock]):
        self.blocks = blocks
        self.comm = self.group = None
        self.pending: dict[int, tuple[object, torch.Tensor]] = {}  # block -> (work, flat bytes) in flight
        self.live: int | None = None  # the block whose tensors are installed
        self.cursor = 0  # the block the walk reaches next once `live` is released
        self.started = False
        self.thread = None  # the job's thread, set while a job is bound
        for i, block in enumerate(blocks):
            touch = functools.partial(self.touch, i)
            for module in block.block.modules():
                module.register_forward_pre_hook(lambda module, args, touch=touch: touch())
            block.block.__dict__["_touch_block"] = touch
            block.block.__class__ = _entering(type(block.block))

    def bind(self, comm) -> None:
        """Gather over this job's replica group, from this thread."""
        self.comm, self.group, self.thread = comm, comm.group("weights"), threading.get_ident()

    def _next(self, i: int) -> int:
        return (i + 1) % len(self.blocks)

    def touch(self, i: int) -> None:
        """Something of block i is about to be used: enter it unless it is the installed one."""
        if self.live != i and self.thread == threading.get_ident():
            self.enter(i)

    def enter(self, i: int) -> None:
        """Block i is about to run: walk to it, install it, prefetch the next."""
        if self.comm is None:
            raise RuntimeError("a sharded model ran outside a job (no replica group bound); a ParaDiT bug")
        self.started = True
        self._walk_to(i)
        self.blocks[i].install(self._land(i))
        self.live = i
        self._issue(self._next(i))

    def finish(self) -> None:
        """The job's forward passes are over: walk to the end of the cycle, land the first block's prefetch, and
        hold no gathered block. Every rank of the group calls it at the same point (a job's end, a Cancel)."""
        if not self.started:
            return
        self._walk_to(0)
        self._land(0)
        self.started, self.thread = False, None

    def _walk_to(self, i: int) -> None:
        """Release the installed block and land (and drop) the gathers of the blocks between it and block i: those
        skipped since, or to the cycle's end."""
        if self.live is not None:
            self.cursor = self._next(self.live)
            self._release()
        while self.cursor != i:
            self._land(self.cursor)
            self.cursor = self._next(self.cursor)

    def abandon(self) -> None:
        """A failed job: drop what is gathered or in flight without waiting (its peers may never complete it;
        the client restarts the workers when a collective may be half done)."""
        if self.live is not None:
            self._release()
        self.pending.clear()
        self.cursor, self.started, self.thread = 0, False, None

    def _issue(self, i: int) -> None:
        if i in self.pending or i == self.live:
            return
        block = self.blocks[i]
        flat = block.empty_flat()
        work = self.comm.all_gather_into_async(flat, block.kept, self.group, op="weights")
        self.pending[i] = (work, flat)

    def _land(self, i: int) -> torch.Tensor:
        self._issue(i)
        work, flat = self.pending.pop(i)
        if work is not None:
            work.wait()
        return flat

    def _release(self) -> None:
        self.blocks[self.live].release()
        self.live = None


_ENTERING: dict[type, type] = {}


def _entering(base: type) -> type:
    """`base` with a __getattr__ that enters the block before a parameter, buffer or submodule is looked up
    (nn.Module keeps those outside __dict__, so every such lookup reaches __getattr__)."""
    if base not in _ENTERING:
        def __getattr__(self, name):
            touch = self.__dict__.get("_touch_block")
            if touch is not None:
                touch()
            return base.__getattr__(self, name)
        _ENTERING[base] = type(base.__name__, (base,), {"__getattr__": __getattr__, "__qualname__": base.__qualname__,
                                                         "__module__": base.__module__})
    return _ENTERING[base]


def parallelize_sharded(model: torch.nn.Module) -> None:
    """Give a model built with shard_weights (its `sharded_blocks`) its gather schedule."""
    model.weight_gatherer = BlockGatherer(model.sharded_blocks)


def bind_weight_gatherer(model: torch.nn.Module, comm) -> BlockGatherer | None:
    """Point a sharded model's gathers at this job's replica group (None for a model that holds its blocks)."""
    gatherer = getattr(model, "weight_gatherer", None)
    if gatherer is not None:
        gatherer.bind(comm)
    return gatherer
