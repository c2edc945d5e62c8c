"""The watchdog names a stalled rank when transfers are asynchronous, as on NCCL.

On NCCL a collective returns as soon as it is queued and `work.wait()` only orders a stream: no host waits in a
transfer, every host ends up waiting for its device at the step's end, and the hosts' stacks all read "busy". Here
two ranks' real `Comm`s run over a fake torch.distributed with NCCL's host-side behaviour (calls and waits return
at once; a transfer completes once every member launched it, else never), and their real `Heartbeat`s feed a
`JobWatch`. Each rank's device is a fake compute stream: a blocking call (async_op=False, which NCCL runs on the
current stream since torch 2.8) and a work's wait queue the transfer on it, and a mark on it is reached once every
transfer queued before the mark completed. Rank 1 stalls between two collectives of a step; rank 0 goes on to the
next one and its device waits.
"""
from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import pytest
import torch

from parallel_runtime.distributed import comm as comm_module
from parallel_runtime.distributed.comm import Comm
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.runtime.watchdog import Heartbeat, JobWatch, WatchdogConfig

pytestmark = pytest.mark.timeout(60)


class AsyncWire:
    """Several ranks' transfers in one process, matched as NCCL matches them: the n-th call of every member of one
    group is one transfer, complete once all members launched it."""

    def __init__(self):
        self.launched: dict[tuple, set[int]] = defaultdict(set)  # (group ranks, n) -> members that launched it
        self.count: dict[tuple, int] = defaultdict(int)  # (rank, group ranks) -> calls launched on that group
        self.streams: dict[int, list] = defaultdict(list)  # rank -> the transfers its compute stream runs, in order
        self.asynchronous = 0  # calls made with async_op=True

    def post(self, rank: int, group: tuple[int, ...], async_op: bool):
        n = self.count[(rank, group)]
        self.count[(rank, group)] += 1
        self.launched[(group, n)].add(rank)
        work = _Work(self, rank, (group, n), set(group))
        if async_op:
            self.asynchronous += 1
            return work
        self.streams[rank].append(work)  # blocking, on NCCL: queued on the current stream, the host goes on
        return None

    def mark(self, device: torch.device) -> "_Mark":
        """comm's StreamMark on the compute stream of rank `device.index`."""
        return _Mark(tuple(self.streams[device.index]))


class _Work:
    def __init__(self, wire: AsyncWire, rank: int, key: tuple, members: set[int]):
        self.wire, self.rank, self.key, self.members = wire, rank, key, members

    def wait(self) -> bool:
        self.wire.streams[self.rank].append(self)  # NCCL: the current stream waits, the host goes on
        return True

    def is_completed(self) -> bool:
        return self.wire.launched[self.key] >= self.members


class _Mark:
    def __init__(self, before: tuple):
        self.before = before

    def reached(self) -> bool:
        return all(work.is_completed() for work in self.before)


class AsyncDist:
    """The calls Comm makes, for one rank."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, wire: AsyncWire, rank: int):
        self.wire, self.rank = wire, rank

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        return self.wire.post(self.rank, group, async_op)

    def all_reduce(self, t, op=None, group=None, async_op=False):
        return self.wire.post(self.rank, group, async_op)


def test_a_rank_that_stalls_behind_asynchronous_collectives_is_named(monkeypatch):
    # Comm builds its groups through torch.distributed's new_group: here a group is its ranks.
    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks, *a, **k: tuple(ranks))
    monkeypatch.setattr(comm_module, "default_group_timeout", lambda: timedelta(seconds=300), raising=False)
    wire, topology = AsyncWire(), Topology(ulysses=2)
    monkeypatch.setattr(comm_module, "StreamMark", wire.mark)
    comms, beats, pulses = [], {0: [], 1: []}, []
    for rank in range(2):
        comm = Comm(topology, rank, f"cuda:{rank}")  # only named: its device is the fake stream
        comm._dist = AsyncDist(wire, rank)
        comms.append(comm)
        pulse = Heartbeat(lambda kind, meta, rank=rank: beats[rank].append(meta), rank, interval_s=0.02)
        pulse.start_job()
        pulse.phase, pulse.traffic = "sampling", comm.traffic
        pulses.append(pulse)

    def attention(comm: Comm) -> None:  # one Ulysses all-to-all, as a block's attention launches it
        comm.all_to_all(torch.empty(4, 2), torch.zeros(4, 2), [2, 2], [2, 2], comm.group("ulysses"))

    try:
        for _ in range(2):  # two blocks on both ranks
            for comm in comms:
                attention(comm)
        attention(comms[0])  # the third block: rank 1 stalled before it, rank 0 queued it and went on
        # Each rank's beats from after the last launch (the beats run on their own threads).
        seen = {rank: len(beats[rank]) for rank in beats}
        deadline = time.monotonic() + 10.0
        while any(len(beats[r]) < seen[r] + 2 for r in beats) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for pulse in pulses:
            pulse.end_job()

    watch = JobWatch(WatchdogConfig(step_grace_s=1.0), ["cuda:0", "cuda:1"], None)
    watch.started_sampling()
    for rank in (0, 1):
        watch.heard(rank, "heartbeat", beats[rank][-1])
        watch.ranks[rank].progressed = time.monotonic() - 5.0  # the step is 4 s past its 1 s bound
    message = str(watch.check({0, 1}))
    # Blocking all-to-alls stay blocking calls, on the current stream: async_op=True and a wait moved each onto
    # NCCL's stream, with two cross-stream event syncs and the tensors stashed on the host.
    assert wire.asynchronous == 0, wire.asynchronous
    assert beats[0][-1]["launched"] == 3 and beats[1][-1]["launched"] == 2, (beats[0][-1], beats[1][-1])
    assert "step 1 made no progress" in message, message
    assert "rank 1 (cuda:1)" in message and "never reached the collective that rank(s) 0 wait in" in message, message
    assert "rank 0: all_to_all with rank 1" in message, message  # what rank 0's device waits on
