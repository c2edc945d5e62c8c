"""Several ranks of one job in one process, over a loopback torch.distributed whose transfers land late.

Each rank runs in its own thread with its own `WorkerState`: the worker's own load, bind and denoise code
(`worker._denoise`) and the real `Comm`, whose `torch.distributed` is swapped for a `LoopbackDist` of that rank.
Transfers are matched as NCCL matches them (the n-th collective of every member of one communicator; sends and
receives in posting order per communicator and direction) and moved by a `Fabric`:

- immediate (CPU, delay 0): a transfer's data moves the moment its last member posts it: a synchronous comm.
- delayed (CPU): an asynchronous transfer moves `delay_s` after its last member posted it, on a delivery thread,
  each communicator's transfers in posting order (NCCL runs one communicator on one stream); a blocking one moves
  behind the transfers of its communicator still in flight, and its caller waits for it.
- CUDA: every transfer moves on its communicator's side stream, after the members' streams reached the point where
  they posted it and behind `torch.cuda._sleep(sleep_cycles)`; `wait()` makes the caller's stream wait for it, as
  ProcessGroupNCCL's does, and never the host.

A strategy that writes a buffer it handed to a transfer, or reads one before waiting, computes the same as over a
synchronous comm only while the transfer lands at once: delayed, it reads the other rank's data late (or not at
all), and the result differs. Data always moves from one rank's tensor into another's, so every input is read and
every output written by the transfer itself, as on a wire.
"""
from __future__ import annotations

import collections
import contextlib
import heapq
import threading
import time
import types
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed

from parallel_runtime.distributed.comm import Comm, GroupPool
from parallel_runtime.distributed.topology import Topology, stage_speeds

WAIT_S = 120.0  # a transfer whose peers never post fails the run with its name instead of hanging the suite
COLLECTIVE_TIMEOUT = timedelta(seconds=77)  # the runtime's configured one, as the client sends it to every worker


class LoopbackGroup(NamedTuple):
    serial: int  # the n-th group every rank created: one communicator
    ranks: tuple[int, ...]
    backend: str | None
    timeout: object


class _Transfer:
    """One matched collective or point-to-point transfer: its members' tensors, and `move`, which reads the inputs
    and writes the outputs."""

    def __init__(self, name: str, kind: str, ranks: tuple[int, ...], asynchronous: bool):
        self.name, self.kind, self.ranks, self.asynchronous = name, kind, ranks, asynchronous
        self.members: dict = {}  # rank (or "send"/"recv") -> that member's payload
        self.ready: list = []  # CUDA: each member's stream at the time it posted
        self.launched = False  # every member posted it
        self.landed = threading.Event()  # CPU: data moved; CUDA: moves enqueued on the side stream
        self.done = None  # CUDA: event after the moves
        self.error: BaseException | None = None

    def move(self) -> None:
        getattr(self, f"_move_{self.kind}")()

    def _ordered(self) -> list:
        return [self.members[r] for r in self.ranks]

    def _move_all_to_all(self) -> None:
        members = self._ordered()
        n = len(members)

        def parts(t, splits):
            splits = list(splits) if splits else [t.shape[0] // n] * n
            if sum(splits) != t.shape[0]:
                raise ValueError(f"{self.name}: splits {splits} do not add up to {t.shape[0]} rows")
            return t.split(splits)

        outs = [parts(out, out_splits) for out, _, out_splits, _ in members]
        ins = [parts(inp, in_splits) for _, inp, _, in_splits in members]
        for i in range(n):
            for j in range(n):
                _copy(self.name, outs[i][j], ins[j][i])

    def _move_all_gather(self) -> None:
        members = self._ordered()
        for parts, _ in members:
            for j, (_, t) in enumerate(members):
                _copy(self.name, parts[j], t)

    def _move_all_gather_into(self) -> None:
        members = self._ordered()
        for out, _ in members:
            rows = out.view(len(members), -1)  # `out` must be one contiguous buffer, as NCCL writes it
            for j, (_, t) in enumerate(members):
                _copy(self.name, rows[j], t.reshape(-1))

    def _move_all_reduce(self) -> None:
        members = self._ordered()
        op = members[0][1]
        acc = members[0][0].clone()
        for t, _ in members[1:]:
            acc = torch.maximum(acc, t) if op == torch.distributed.ReduceOp.MAX else acc + t
        for t, _ in members:
            t.copy_(acc)

    def _move_broadcast(self) -> None:
        source = self.members[self.members[self.ranks[0]][1]][0]
        for r in self.ranks:
            t, src = self.members[r]
            if r != src:
                _copy(self.name, t, source)

    def _move_p2p(self) -> None:
        _copy(self.name, self.members["recv"], self.members["send"])


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"{name}: {tuple(src.shape)} {src.dtype} sent into {tuple(dst.shape)} {dst.dtype}")
    dst.copy_(src)


class _Work:
    """What a loopback transfer returns: torch.distributed's Work (wait, is_completed)."""

    def __init__(self, fabric: "Fabric", transfer: _Transfer):
        self.fabric, self.transfer = fabric, transfer

    def wait(self, timeout=None) -> bool:
        t, fabric = self.transfer, self.fabric
        with fabric._cond:
            if t.launched and not t.landed.is_set():
                fabric.in_flight_waits += 1  # the strategy reached for a transfer still on the wire
        deadline = time.monotonic() + WAIT_S
        while not t.landed.wait(0.05):
            if fabric.failure is not None:
                raise RuntimeError(f"{t.name}: abandoned, {fabric.failure}")
            if time.monotonic() > deadline:
                fabric.fail(f"{t.name} never completed (a peer never posted it)")
                raise RuntimeError(fabric.failure)
        if t.error is not None:
            raise t.error
        if t.done is not None:
            torch.cuda.current_stream().wait_event(t.done)
        return True

    def is_completed(self) -> bool:
        t = self.transfer
        return t.landed.is_set() and (t.done is None or t.done.query())


class Fabric:
    """The wire between the ranks of one process (see the module's docstring)."""

    def __init__(self, world: int, device: str = "cpu", delay_s: float = 0.0, sleep_cycles: int = 0):
        self.world, self.device = world, torch.device(device)
        self.delay_s, self.sleep_cycles = delay_s, sleep_cycles
        self.failure: str | None = None
        self.in_flight_waits = 0  # waits that found their transfer on the wire: the delay took effect
        self.transfers = 0
        self.groups: list[LoopbackGroup] = []
        self._made = [0] * world  # groups each rank has created
        self._calls: collections.Counter = collections.Counter()  # (rank, group serial) -> collectives posted
        self._open: dict = {}  # (group serial, call) -> collective some members have posted
        self._p2p: dict = collections.defaultdict(collections.deque)  # (serial, src, dst) -> posted halves
        self._cond = threading.Condition()
        self._queue: list = []  # (time, n, transfer), delayed CPU transfers
        self._lane_at: dict = collections.defaultdict(float)  # group serial -> when its last transfer lands
        self._streams: dict = {}  # group serial -> CUDA side stream
        self._held: list[_Transfer] = []  # CUDA transfers whose tensors the side streams may still use
        self._deliverer: threading.Thread | None = None
        self._stopped = False

    def dist(self, rank: int) -> "LoopbackDist":
        return LoopbackDist(self, rank)

    def fail(self, why: str) -> None:
        with self._cond:
            self.failure = self.failure or why
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._deliverer is not None:
            self._deliverer.join(timeout=10)

    # -- groups, collectives, point to point --------------------------------------------------------

    def new_group(self, rank: int, ranks, backend, timeout) -> LoopbackGroup:
        with self._cond:
            serial = self._made[rank]
            self._made[rank] += 1
            if serial == len(self.groups):
                self.groups.append(LoopbackGroup(serial, tuple(ranks), backend, timeout))
            group = self.groups[serial]
            if group.ranks != tuple(ranks) or group.backend != backend:
                self.failure = f"rank {rank} made group {serial} over {list(ranks)}, another over {list(group.ranks)}"
                raise RuntimeError(self.failure)
            return group

    def post(self, rank: int, group: LoopbackGroup, kind: str, payload: tuple, asynchronous: bool) -> _Work:
        with self._cond:
            call = self._calls[(rank, group.serial)]
            self._calls[(rank, group.serial)] += 1
            t = self._open.setdefault((group.serial, call), _Transfer(
                f"{kind} #{call} on group {list(group.ranks)}", kind, group.ranks, asynchronous))
            if t.kind != kind:
                self.fail(f"rank {rank} posted {kind} as call {call} of group {list(group.ranks)}, where a peer "
                          f"posted {t.kind}: the ranks' collectives are out of order")
                raise RuntimeError(self.failure)
            t.members[rank] = payload
            self._mark_ready(t)
            if len(t.members) == len(group.ranks):
                del self._open[(group.serial, call)]
                self._launch(t, group.serial)
        return _Work(self, t)

    def post_p2p(self, rank: int, group: LoopbackGroup, kind: str, tensor: torch.Tensor, peer: int) -> _Work:
        src, dst = (rank, peer) if kind == "send" else (peer, rank)
        with self._cond:
            posted = self._p2p[(group.serial, src, dst)]
            if posted and posted[0][0] != kind:  # the other half is waiting: match it
                t = posted.popleft()[1]
                t.members[kind] = tensor
                self._mark_ready(t)
                self._launch(t, group.serial)
            else:
                t = _Transfer(f"p2p {src}->{dst} on group {list(group.ranks)}", "p2p", group.ranks, True)
                t.members[kind] = tensor
                self._mark_ready(t)
                posted.append((kind, t))
        return _Work(self, t)

    def _mark_ready(self, t: _Transfer) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()  # this member's stream as it posts
            t.ready.append(event)

    def _launch(self, t: _Transfer, lane: int) -> None:
        """Called with the lock held, once every member posted."""
        self.transfers += 1
        t.launched = True
        if self.device.type == "cuda":
            self._launch_cuda(t, lane)
        elif self.delay_s == 0:
            try:
                t.move()
            except BaseException as e:  # noqa: BLE001 - handed to the waiters
                t.error = e
            t.landed.set()
        else:
            at = max(time.monotonic() + (self.delay_s if t.asynchronous else 0.0), self._lane_at[lane])
            self._lane_at[lane] = at
            heapq.heappush(self._queue, (at, self.transfers, t))
            if self._deliverer is None:
                self._deliverer = threading.Thread(target=self._deliver, name="loopback-delivery", daemon=True)
                self._deliverer.start()
            self._cond.notify_all()

    def _launch_cuda(self, t: _Transfer, lane: int) -> None:
        side = self._streams.get(lane)
        if side is None:
            side = self._streams[lane] = torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            for event in t.ready:
                side.wait_event(event)
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            try:
                t.move()
            except BaseException as e:  # noqa: BLE001 - handed to the waiters
                t.error = e
            t.done = torch.cuda.Event()
            t.done.record(side)
        # As ProcessGroupNCCL stashes a transfer's tensors, the fabric keeps them alive until the side stream is
        # done with them: a rank that drops one sooner cannot have its memory handed out again under the copy.
        self._held = [h for h in self._held if not h.done.query()] + [t]
        t.landed.set()

    def _deliver(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._cond.wait(timeout=(self._queue[0][0] - time.monotonic()) if self._queue else None)
                if self._stopped:
                    return
                _, _, t = heapq.heappop(self._queue)
            try:
                t.move()
            except BaseException as e:  # noqa: BLE001 - handed to the waiters
                t.error = e
            t.landed.set()


class _P2POp(NamedTuple):
    op: object
    tensor: torch.Tensor
    peer: int
    group: LoopbackGroup | None = None


class LoopbackDist:
    """The part of torch.distributed that comm.py calls, for one rank of a Fabric."""

    ReduceOp = torch.distributed.ReduceOp
    P2POp = _P2POp

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank = fabric, rank

    def new_group(self, ranks=None, timeout=None, backend=None, **kwargs) -> LoopbackGroup:
        return self.fabric.new_group(self.rank, ranks, backend, timeout)

    def destroy_process_group(self, group=None) -> None:
        pass

    def _post(self, group, kind, payload, async_op):
        work = self.fabric.post(self.rank, group, kind, payload, async_op)
        if async_op:
            return work
        work.wait()
        return None

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return self._post(group, "all_to_all", (output, input, output_split_sizes, input_split_sizes), async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return self._post(group, "all_gather", (tensor_list, tensor), async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._post(group, "all_gather_into", (output_tensor, input_tensor), async_op)

    all_gather_single = all_gather_into_tensor

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        return self._post(group, "all_reduce", (tensor, op), async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._post(group, "broadcast", (tensor, src), async_op)

    def isend(self, tensor, dst, group=None, tag=0):
        return self.fabric.post_p2p(self.rank, group, "send", tensor, dst)

    def irecv(self, tensor, src=None, group=None, tag=0):
        return self.fabric.post_p2p(self.rank, group, "recv", tensor, src)

    def batch_isend_irecv(self, p2p_op_list):
        return [op.op(op.tensor, op.peer, group=op.group) for op in p2p_op_list]


def loopback_comm(fabric: Fabric, topology: Topology, rank: int, device,
                  timeout: timedelta = COLLECTIVE_TIMEOUT) -> Comm:
    """The real Comm of `rank`, its groups made and its transfers sent over `fabric`."""
    dist = fabric.dist(rank)
    pool = GroupPool(spare=0, timeout=timeout)
    pool._dist = dist  # the pool makes and destroys the groups; Comm moves the data
    comm = Comm(topology, rank, device, pool=pool)
    comm._dist = dist
    return comm


def on_ranks(fabric: Fabric, fn, streams: list | None = None) -> list:
    """fn(rank) for every rank of `fabric`, each in its own thread (on its own CUDA stream where `streams` are
    given); their results in rank order. A rank that fails fails the fabric, so its peers stop waiting for it."""
    results: list = [None] * fabric.world
    errors: list = []

    def rank_main(r: int) -> None:
        try:
            with torch.cuda.stream(streams[r]) if streams is not None else contextlib.nullcontext():
                results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append((r, e))
            fabric.fail(f"rank {r} failed: {e!r}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(fabric.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + 30)
    if any(t.is_alive() for t in threads):
        fabric.fail("a rank thread never finished")
        raise RuntimeError(f"rank threads still running: {[t.name for t in threads if t.is_alive()]}")
    if errors:
        rank, error = sorted(errors, key=lambda e: "abandoned" in str(e[1]))[0]  # the first cause, not its echoes
        raise RuntimeError(f"rank {rank} failed") from error
    return results


class LoopbackRanks:
    """The ranks of one runtime as threads of this process, each with its own WorkerState (models, stale K/V and
    comms kept from job to job as a worker keeps them)."""

    def __init__(self, fabric: Fabric, device: str = "cpu"):
        from parallel_runtime.runtime.worker import WorkerState

        self.fabric, self.device = fabric, torch.device(device)
        self.states = [WorkerState(r, fabric.world, self.device, COLLECTIVE_TIMEOUT) for r in range(fabric.world)]
        self.streams = [torch.cuda.Stream(self.device) for _ in self.states] if self.device.type == "cuda" else None

    def run(self, job, hooks=None) -> torch.Tensor:
        """The job's result (the result rank's latent, or model output). `hooks(rank)`: a context manager each
        rank's denoise runs inside (after loading)."""
        topology = Topology.from_strategy(job.strategy)
        assert topology.world_size == self.fabric.world, (topology, self.fabric.world)
        results = on_ranks(self.fabric, lambda r: self._run_rank(r, job, topology, hooks), self.streams)
        if self.streams is not None:
            torch.cuda.current_stream().wait_stream(self.streams[0])
            for s in self.streams[1:]:
                torch.cuda.current_stream().wait_stream(s)
        found = [r for r in results if r is not None]
        assert len(found) == 1, f"{len(found)} ranks returned a result"
        return found[0]

    def _run_rank(self, r: int, job, topology: Topology, hooks) -> torch.Tensor | None:
        from parallel_runtime.runtime.worker import _denoise

        state = self.states[r]
        if topology not in state.comms:  # as WorkerState.comm_for keeps one Comm, for the latest topology
            state.comms = {topology: loopback_comm(self.fabric, topology, r, self.device, state.collective_timeout)}
        state.ensure_model(job.model.to_json(), topology, stage_speeds=stage_speeds(job.strategy))
        controlnets = state.ensure_controlnets(job, topology)
        state.patcher.apply(None)
        chan = types.SimpleNamespace(send=lambda *args, **kwargs: None)
        pulse = types.SimpleNamespace(step=0, traffic=None, phase="sampling")
        with hooks(r) if hooks is not None else contextlib.nullcontext():
            _, latent = _denoise(state, chan, job, topology, pulse, controlnets)
        state.end_job(job)
        return latent
