"""The only module that calls torch.distributed: process groups, collectives and p2p, with byte counters.

Every byte a strategy moves goes through `Comm`, so the benchmark's traffic figures are counted, not
estimated. Counters record the bytes this rank sends to and receives from *other* ranks (the part of an
all-to-all that stays local is not traffic). Every transfer is kept as a `Transfer` while in flight, so the heartbeat
can tell whether this rank's device waits on a peer: an asynchronous one by its work, a blocking one by two marks on
the current stream around the call.
A group of one rank is a no-op, so the same strategy code runs serially in one process without torch.distributed
at all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from .streams import StreamMark
from .topology import DIMS, STEP_ROW_DIMS, Topology


@dataclass
class Group:
    """This rank's view of one process group."""

    ranks: list[int]  # global ranks, in group order
    index: int  # this rank's position in `ranks`
    pg: object = None  # torch ProcessGroup, None for a group of one

    @property
    def size(self) -> int:
        return len(self.ranks)


class Transfer:
    """One launched collective or point-to-point transfer: the handle a strategy waits on (`wait` and `is_completed`,
    as torch's Work), and what the heartbeat reports while it is in flight. A blocking call has no work: the
    current stream (the host, on the CPU) is past it once it reached `done`, the mark made after the call."""

    __slots__ = ("op", "peers", "work", "device", "waited", "done")

    def __init__(self, op: str, peers: tuple[int, ...], work, device: torch.device):
        self.op, self.peers, self.work, self.device = op, peers, work, device
        self.waited: StreamMark | None = None  # where the device (the host, on the CPU) started waiting on it
        self.done: StreamMark | None = None  # a blocking call's: the current stream right after it

    def wait(self) -> None:
        """Block what comes next on this transfer: the host on gloo; on NCCL only the current stream, as torch's
        Work.wait does (the host goes on at once)."""
        self.waited = StreamMark(self.device)
        self.work.wait()

    def is_completed(self) -> bool:
        if self.work is None:
            done = self.done
            return done is not None and done.reached()
        return self.work.is_completed()

    def blocks(self) -> bool:
        """The device got to a wait on this transfer and the transfer has not completed: it waits for a peer."""
        waited = self.waited
        return waited is not None and waited.reached() and not self.is_completed()

    def describe(self) -> str:
        return f"{self.op} with rank {', '.join(map(str, self.peers))}"


class InFlight:
    """This rank's transfers that may not have completed, oldest first; the heartbeat thread reads them.

    On NCCL the host never waits in a transfer (calls return at once; waits order streams), so the host's stack
    cannot tell a rank that waits for a peer from one that computes: every host ends up waiting for its device at
    the step's end. What can tell them apart is asked of the device without blocking it: a rank whose device waits
    on a transfer that never completes is waiting for a peer; a rank with none such is computing, or hung."""

    def __init__(self):
        self._items: deque[Transfer] = deque()
        self._lock = threading.Lock()  # the main thread adds, the heartbeat thread reads

    def add(self, transfer: Transfer) -> None:
        """Keep `transfer`, letting go of the completed ones at the head only: transfers complete about in launch
        order, and a host that runs ahead of its device launches a whole step before any completes, so a sweep on
        every add asked O(n^2) questions per step under the lock the heartbeat takes. The heartbeat's `blocking`
        and the job's end sweep the rest."""
        with self._lock:
            while self._items and self._items[0].is_completed():
                self._items.popleft()
            self._items.append(transfer)

    def __len__(self) -> int:
        return len(self._items)

    def blocking(self) -> Transfer | None:
        """The oldest transfer this rank's device waits on and that has not completed (None: it waits on none).
        Lets go of every completed one on the way."""
        with self._lock:
            self._prune()
            return next((t for t in self._items if t.blocks()), None)

    def prune(self) -> None:
        """Let go of the completed transfers (a Work keeps its tensors, device memory, alive)."""
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        self._items = deque(t for t in self._items if not t.is_completed())


@dataclass
class Traffic:
    sent: int = 0
    recv: int = 0
    by_op: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    calls: int = 0  # transfers launched: heartbeats carry it, so a hang names the rank that fell behind
    in_flight: InFlight = field(default_factory=InFlight)

    def add(self, op: str, sent: int, recv: int) -> None:
        self.calls += 1
        self.sent += sent
        self.recv += recv
        self.by_op[op][0] += sent
        self.by_op[op][1] += recv

    def snapshot(self) -> dict:
        return {"sent": self.sent, "recv": self.recv, "by_op": {k: list(v) for k, v in self.by_op.items()}}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_timeout(pg) -> timedelta:
    """The timeout each collective of process group `pg` runs under (torch keeps it in the backend's options)."""
    return pg._get_backend(pg._device_types[0]).options._timeout


def default_group_timeout() -> timedelta:
    import torch.distributed as dist

    return group_timeout(dist.group.WORLD)


class GroupPool:
    """Process groups kept across jobs and shared by every topology that needs the same one.

    Rebuilding a topology's groups on every strategy change costs a store rendezvous per group (the soak's
    mixed jobs on cpu:2: 117 ms each with rebuilds, 72 ms with this pool) and leaves something behind each
    time (torch keeps an empty tag list per destroyed group; +10 vs +6 MiB per worker over 1,000 jobs).
    Groups are keyed by role and ranks, not by topology: on 2 ranks every strategy uses the same data group
    [0, 1], so cfg / ulysses / ring / pipefusion / naive patch share 4 groups in all.
    Groups the current topology does not use stay, least recently used first, up to `spare`, and the rest
    are destroyed: NCCL communicators hold device memory. new_group and destroy_process_group are
    collective, and every rank sees the same job sequence, so every rank makes the same hits, misses and
    evictions in the same order.
    `timeout` bounds each collective of every group (WatchdogConfig.collective_timeout_s, as the default group's):
    new_group does not inherit the default group's, it falls back to the backend's own (NCCL 10 min, gloo 30).
    """

    def __init__(self, spare: int, timeout: timedelta):
        import torch.distributed as dist

        self._dist = dist
        self.spare = spare
        self.timeout = timeout
        self._groups: OrderedDict[tuple, object] = OrderedDict()  # key -> ProcessGroup (or NON_GROUP_MEMBER)

    def get(self, key: tuple, ranks: list[int], backend: str | None = None):
        if key in self._groups:
            self._groups.move_to_end(key)
        else:
            self._groups[key] = self._dist.new_group(ranks, timeout=self.timeout, backend=backend)
        return self._groups[key]

    def trim(self, keep: set) -> None:
        idle = [key for key in self._groups if key not in keep]  # least recently used first
        for key in idle[:max(0, len(idle) - self.spare)]:
            self._dist.destroy_process_group(self._groups.pop(key))  # returns at once on a non-member

    def close(self) -> None:
        self.spare = 0
        self.trim(set())

    def __len__(self) -> int:
        return len(self._groups)


class Comm:
    def __init__(self, topology: Topology, rank: int = 0, device: torch.device | str = "cpu",
                 pool: GroupPool | None = None):
        """`pool`: where process groups come from and go back to (a worker's, shared across jobs); without
        one the Comm makes its own, with the default group's timeout, and `close` destroys them."""
        self.topology = topology
        self.rank = rank
        self.device = torch.device(device)
        self.traffic = Traffic()
        self._groups: dict[str, Group] = {}
        self._links: dict[tuple[int, int], object] = {}  # (src, dst) -> process group of that one direction
        self._control_pg = None
        distributed = topology.world_size > 1
        self._own_pool = None
        if distributed:
            import torch.distributed as dist

            self._dist = dist
            if pool is None:
                pool = self._own_pool = GroupPool(spare=0, timeout=default_group_timeout())
        used: set = set()

        def get(key, ranks, backend=None):
            used.add(key)
            return pool.get(key, ranks, backend)

        # Every rank must create every group, in the same order, even groups it is not part of.
        named = [(d, topology.groups(d)) for d in DIMS] + [("sp", topology.sp_groups()),
                                                          ("step_rows", topology.spanning_groups(STEP_ROW_DIMS))]
        for name, groups in named:
            for ranks in groups:
                # Keyed by ranks: e.g. "sp" equals "ulysses" when ring is 1, one communicator for both.
                pg = get(("data", tuple(ranks)), ranks) if distributed and len(ranks) > 1 else None
                if rank in ranks:
                    self._groups[name] = Group(ranks, ranks.index(rank), pg)
        if distributed:
            # PipeFusion's point-to-point traffic gets one group per link *direction*. NCCL runs a
            # communicator's sends and receives in posting order on one stream, so a receive posted ahead
            # of a send on a shared communicator would wait for a send the peer cannot make yet; with two
            # stages both directions join the same two ranks, so direction is what must separate them.
            for ranks in topology.groups("pipefusion"):
                for k in range(len(ranks) if len(ranks) > 1 else 0):
                    src, dst = ranks[k], ranks[(k + 1) % len(ranks)]
                    self._links[(src, dst)] = get(("link", src, dst), sorted({src, dst}))
            # Sharded weights gather on their own groups: a prefetch then never delays the attention collectives
            # queued behind it (NCCL runs one communicator's collectives in order on one stream).
            for ranks in topology.replica_groups() if topology.shard_weights else ():
                pg = get(("weights", tuple(ranks)), ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    self._groups["weights"] = Group(ranks, ranks.index(rank), pg)
            # Cancel votes travel on their own CPU group so they never queue behind NCCL kernels or p2p.
            self._control_pg = get(("control",), list(range(topology.world_size)), "gloo")
            pool.trim(used)

    def close(self) -> None:
        """Free the communicators this Comm made itself (a pool's stay in the pool). Every rank closes the
        same Comm at the same point of the job sequence, so the collective teardown lines up."""
        if self._own_pool is not None:
            self._own_pool.close()

    def group(self, name: str) -> Group:
        return self._groups[name]

    def reset_traffic(self) -> None:
        self.traffic = Traffic()

    # -- collectives -------------------------------------------------------------------------------

    def _launched(self, op: str, work, group: Group | None = None, peers: tuple[int, ...] = ()) -> Transfer:
        """Keep a launched transfer in this rank's in-flight list (`peers`: the others it needs, else the group's)."""
        if group is not None:
            peers = tuple(r for r in group.ranks if r != self.rank)
        transfer = Transfer(op, peers, work, self.device)
        self.traffic.in_flight.add(transfer)
        return transfer

    def _blocking(self, op: str, group: Group, collective, /, *args, **kwargs) -> None:
        """Run `collective(*args, **kwargs)` on `group` with async_op=False, between two marks on the current stream.

        On NCCL (torch >= 2.8) a blocking call runs on the current stream with no event syncs and nothing stashed,
        where async_op=True and an immediate wait moves it to NCCL's own stream; on gloo it blocks the host. The
        marks give the heartbeat what a Work would: the device waits in the call once it passed the first mark and
        not yet the second (on the CPU, while the host is in the call)."""
        transfer = self._launched(op, None, group)
        transfer.waited = StreamMark(self.device)
        collective(*args, group=group.pg, async_op=False, **kwargs)
        transfer.done = StreamMark(self.device)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: Group, op: str = "all_to_all") -> torch.Tensor:
        """all_to_all_single along dim 0 with (possibly uneven) splits."""
        if group.size == 1:
            out.copy_(inp)
            return out
        row = _nbytes(inp) // max(inp.shape[0], 1)
        out_row = _nbytes(out) // max(out.shape[0], 1)
        me = group.index
        self.traffic.add(op, row * (sum(in_splits) - in_splits[me]), out_row * (sum(out_splits) - out_splits[me]))
        self._blocking(op, group, self._dist.all_to_all_single, out, inp, out_splits, in_splits)
        return out

    def all_gather(self, t: torch.Tensor, group: Group, op: str = "all_gather") -> list[torch.Tensor]:
        if group.size == 1:
            return [t]
        t, parts = self._gather_parts(t, group, op)
        self._blocking(op, group, self._dist.all_gather, parts, t)
        return parts

    def all_gather_async(self, t: torch.Tensor, group: Group, op: str = "all_gather") -> tuple[Transfer | None, list]:
        """Start an all-gather; returns (work, parts): the parts are valid once work.wait() returned (work is None
        for a group of one). `t` must stay unchanged until then."""
        if group.size == 1:
            return None, [t]
        t, parts = self._gather_parts(t, group, op)
        return self._launched(op, self._dist.all_gather(parts, t, group=group.pg, async_op=True), group), parts

    def _gather_parts(self, t: torch.Tensor, group: Group, op: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`t` made contiguous, and one empty part per member to gather into (counted as sent and received)."""
        t = t.contiguous()
        n = _nbytes(t) * (group.size - 1)
        self.traffic.add(op, n, n)
        return t, [torch.empty_like(t) for _ in range(group.size)]

    def all_gather_into_async(self, out: torch.Tensor, t: torch.Tensor, group: Group,
                              op: str = "all_gather") -> Transfer | None:
        """Start gathering every member's `t` (equal sizes) into `out`, member by member along dim 0; returns the
        work (None for a group of one, where `out` is filled at once). `t` must stay unchanged until work.wait()."""
        if group.size == 1:
            out.copy_(t.reshape(out.shape))
            return None
        work = self._all_gather_single()(out, t, group=group.pg, async_op=True)
        n = _nbytes(t) * (group.size - 1)
        self.traffic.add(op, n, n)
        return self._launched(op, work, group)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, group: Group,
                        op: str = "all_gather") -> torch.Tensor:
        """all_gather_into_async's blocking twin: every member's `t` in `out`, member by member along dim 0."""
        if group.size == 1:
            out.copy_(t.reshape(out.shape))
            return out
        n = _nbytes(t) * (group.size - 1)
        self.traffic.add(op, n, n)
        self._blocking(op, group, self._all_gather_single(), out, t)
        return out

    def _all_gather_single(self):
        # all_gather_single is all_gather_into_tensor's name from torch 2.13 on (the old one warns there).
        return getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor

    def all_reduce_max(self, t: torch.Tensor, group: Group, op: str = "all_reduce") -> torch.Tensor:
        """The elementwise max of every member's `t`, in place (counted as all_reduce counts)."""
        return self._all_reduce(t, group, op, "MAX")

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "all_reduce") -> torch.Tensor:
        """The sum of every member's `t`, in place (counted as a ring all-reduce moves it: 2 (N - 1) / N of its
        bytes each way)."""
        return self._all_reduce(t, group, op, "SUM")

    def _all_reduce(self, t: torch.Tensor, group: Group, op: str, reduce_op: str) -> torch.Tensor:
        if group.size == 1:
            return t
        n = 2 * (group.size - 1) * _nbytes(t) // group.size
        self.traffic.add(op, n, n)
        self._blocking(op, group, self._dist.all_reduce, t, op=getattr(self._dist.ReduceOp, reduce_op))
        return t

    def broadcast(self, t: torch.Tensor, group: Group, op: str = "broadcast") -> torch.Tensor:
        """The group's first member's `t` into every member's `t` (counted as the source sending one copy to
        each other member)."""
        if group.size == 1:
            return t
        n = _nbytes(t)
        if group.index == 0:
            self.traffic.add(op, n * (group.size - 1), 0)
        else:
            self.traffic.add(op, 0, n)
        self._blocking(op, group, self._dist.broadcast, t, src=group.ranks[0])
        return t

    # -- point to point ----------------------------------------------------------------------------

    def isend(self, t: torch.Tensor, dst: int, op: str = "p2p") -> Transfer:
        """Send along a pipeline link (this rank -> dst), on that direction's own group."""
        self.traffic.add(op, _nbytes(t), 0)
        return self._launched(op, self._dist.isend(t, dst, group=self._links[(self.rank, dst)]), peers=(dst,))

    def irecv(self, t: torch.Tensor, src: int, op: str = "p2p") -> Transfer:
        self.traffic.add(op, 0, _nbytes(t))
        return self._launched(op, self._dist.irecv(t, src, group=self._links[(src, self.rank)]), peers=(src,))

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, group: Group, op: str = "ring") -> list[Transfer]:
        """Send to the next rank of the ring and receive from the previous one, asynchronously."""
        nxt = group.ranks[(group.index + 1) % group.size]
        prv = group.ranks[(group.index - 1) % group.size]
        ops = [self._dist.P2POp(self._dist.isend, send, nxt, group=group.pg),
               self._dist.P2POp(self._dist.irecv, recv, prv, group=group.pg)]
        self.traffic.add(op, _nbytes(send), _nbytes(recv))
        return [self._launched(op, work, peers=(prv, nxt)) for work in self._dist.batch_isend_irecv(ops)]

    # -- control -----------------------------------------------------------------------------------

    def vote_async(self, flag: bool) -> tuple[Transfer | None, torch.Tensor]:
        """Start an all-ranks OR of `flag`; returns (work, tensor). Not counted: it is control, not data."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        if self._control_pg is None:
            return None, t
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._control_pg, async_op=True)
        others = tuple(r for r in range(self.topology.world_size) if r != self.rank)
        # On the CPU group: its wait blocks the host, whatever the device.
        transfer = Transfer("cancel vote", others, work, torch.device("cpu"))
        self.traffic.in_flight.add(transfer)
        return transfer, t
