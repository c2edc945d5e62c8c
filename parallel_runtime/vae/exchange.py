"""An in-process band group: the few collectives a row-split decoder needs, between threads of one process.

Each band of rows runs in its own Python thread (torch ops release the GIL) on its own device. The threads meet at a
barrier for every exchange; each posts a value into its slot and reads everybody's. Two slot buffers alternate, so
one barrier per exchange suffices: a thread can only write a buffer again after the next barrier, which every other
thread reaches only once it has read that buffer.

The thread's member is found through `current()` (a thread-local), so split modules need no extra arguments.
"""
from __future__ import annotations

import threading

import torch

_LOCAL = threading.local()


class BandGroup:
    """The shared state of `size` band threads: a barrier and two alternating slot buffers."""

    def __init__(self, size: int, timeout_s: float | None = None):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[list] = [[None] * size, [None] * size]

    def member(self, rank: int, device: torch.device | str) -> "BandMember":
        return BandMember(self, rank, torch.device(device))

    def abort(self) -> None:
        """Free the other threads from their barrier (they raise BrokenBarrierError) after one failed."""
        self.barrier.abort()


class BandMember:
    """One band thread's handle on its group: rank 0 holds the top rows of the image."""

    def __init__(self, group: BandGroup, rank: int, device: torch.device):
        self.group, self.rank, self.size, self.device = group, rank, group.size, device
        self._phase = 0

    def swap(self, value) -> list:
        """Post `value`, wait for every band's, return them all in rank order (the values themselves, not copies)."""
        slots = self.group.slots[self._phase]
        self._phase ^= 1
        slots[self.rank] = value
        self.group.barrier.wait()
        return list(slots)

    def trade_edges(self, first: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post this band's `first` and `last` rows; return (the band above's last rows, the band below's first
        rows) on this band's device, None at the image's top and bottom edge. Posted as compact copies: a view
        would keep the band's whole tensor alive in the slot until the slot is reused."""
        edges = self.swap((first.clone(), last.clone()))
        above = edges[self.rank - 1][1].to(self.device) if self.rank > 0 else None
        below = edges[self.rank + 1][0].to(self.device) if self.rank < self.size - 1 else None
        return above, below

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every band's `x` concatenated along `dim` in rank order (image order), on this band's device."""
        return torch.cat([part.to(self.device) for part in self.swap(x)], dim=dim)

    def gather_list(self, value: torch.Tensor) -> list[torch.Tensor]:
        """Every band's small tensor, in rank order, on this band's device (every band then reduces them in the same
        order, so all bands hold bit-identical results)."""
        return [part.to(self.device) for part in self.swap(value)]


def current() -> BandMember | None:
    """This thread's band member while a split decode runs in it, else None (the modules then run unsplit)."""
    return getattr(_LOCAL, "member", None)


class joined:
    """`with joined(member):` makes `member` this thread's band for the split modules."""

    def __init__(self, member: BandMember):
        self.member = member

    def __enter__(self) -> BandMember:
        self.previous = current()
        _LOCAL.member = self.member
        return self.member

    def __exit__(self, *exc) -> None:
        _LOCAL.member = self.previous
