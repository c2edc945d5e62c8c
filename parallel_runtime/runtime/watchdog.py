"""Liveness of a job's workers: heartbeats on the worker side, deadlines on the client side.

Two different failures look alike from the outside ("the job never ends") and are caught differently:

* a **frozen process** (SIGSTOP, swapped out, stuck in the driver with the GIL held) stops beating:
  every worker runs a `Heartbeat` thread, independent of its step loop, that sends a small message
  every `heartbeat_s` while a job is active; `heartbeat_timeout_s` of silence means the process is gone.
* a **stuck collective** (a peer stalled, an NCCL or driver hang) keeps beating but makes no progress:
  each step must finish within the expected step time (measured on the job's earlier steps, or on the
  previous job of the same shape) plus `step_grace_s`.

A heartbeat carries where the worker's main thread is (from its Python stack) and the transfer its device waits
on, if any (comm.InFlight, asked without blocking the device), so the client can name the rank that is computing
or stuck while its peers merely wait for it in a collective. The stack alone cannot tell them apart on NCCL: there
the host launches a collective and goes on, and every rank's host ends up waiting for its device at the step's end.

Workers beat only while they hold a job: between jobs nobody reads the channel, and an unread stream of
beats would fill the socket buffer. The client checks idle workers with a ping before sending a job.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, fields


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds; set it to e.g. {default:g}.") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive number of seconds; set it to e.g. {default:g}.")
    return seconds


@dataclass(frozen=True)
class WatchdogConfig:
    """Bounds on how long the client waits for its workers. Every field can be set by the environment
    variable PARADIT_<FIELD> (seconds), e.g. PARADIT_STEP_GRACE_S=120 for very slow steps."""

    heartbeat_s: float = 1.0  # how often a busy worker beats
    heartbeat_timeout_s: float = 20.0  # silence that means the process is frozen (generous: swap, GIL)
    step_grace_s: float = 60.0  # how far past the expected step time a step may run
    load_timeout_s: float = 1800.0  # reading a model (tens of GB from a slow disk) before the first step
    cancel_grace_s: float = 5.0  # after Cancel, how long past the current step the workers get to stop

    @classmethod
    def from_env(cls, **overrides) -> "WatchdogConfig":
        values = {f.name: _env_seconds(f"PARADIT_{f.name.upper()}", f.default) for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def collective_timeout_s(self) -> float:
        """torch.distributed's own timeout on each collective. The client's deadlines fire first; this is
        the backstop for a worker whose client stopped supervising it: on gloo the collective raises, on
        NCCL the async error handler aborts the communicator and ends the process, so no worker waits
        forever on a dead peer."""
        return max(300.0, 2 * self.step_grace_s)


# -- worker side -------------------------------------------------------------------------------------

# Our comm layer and torch.distributed's own files; not every file under a "distributed" folder, since
# parallel_runtime/distributed/ also holds the rank layout and stage arithmetic, where no rank waits.
_WAIT_HINTS = ("comm.py", os.sep + os.path.join("torch", "distributed", ""))


def where(thread_id: int) -> tuple[str, bool]:
    """A short description of where a thread is, and whether it is waiting on a peer (inside our comm
    layer, torch.distributed, or a `.wait()` on a pending transfer)."""
    frame = sys._current_frames().get(thread_id)
    innermost = None
    waiting = False
    while frame is not None:
        path = frame.f_code.co_filename
        if any(h in path for h in _WAIT_HINTS):
            waiting = True
        if innermost is None and "parallel_runtime" in path:
            innermost = frame
        frame = frame.f_back
    if innermost is None:
        return "idle", False
    import linecache

    line = linecache.getline(innermost.f_code.co_filename, innermost.f_lineno).strip()
    waiting = waiting or ".wait()" in line or ".result()" in line
    return f"{os.path.basename(innermost.f_code.co_filename)}:{innermost.f_lineno} {innermost.f_code.co_name}", waiting


class Heartbeat:
    """Beats on a worker's channel while a job is active; the main thread updates `phase` and `step`.

    `device`: the worker's. The thread asks it about its transfers (CUDA events, NCCL work), and a thread starts on
    CUDA's device 0, whatever the main thread set: without its own set_device every worker would make a context
    (hundreds of MiB) on GPU 0."""

    def __init__(self, send, rank: int, interval_s: float, device=None):
        self._send, self.rank, self.interval_s, self.device = send, rank, interval_s, device
        self._main = threading.main_thread().ident
        self._active = threading.Event()
        self._lock = threading.Lock()  # end_job returns only once no beat is being sent
        self.phase, self.step = "idle", 0
        self.traffic = None  # the job's comm.Traffic: its `calls` count what this rank has launched
        threading.Thread(target=self._run, daemon=True, name="paradit-heartbeat").start()

    def start_job(self) -> None:
        self.phase, self.step, self.traffic = "loading", 0, None
        self._active.set()

    def end_job(self) -> None:
        """After this returns no beat follows, so the job's last message is its result."""
        with self._lock:
            self._active.clear()
            self.phase = "idle"
            if self.traffic is not None:
                self.traffic.in_flight.prune()  # the job's last transfers: their buffers go with the job

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        while True:
            self._active.wait()
            at, waiting = where(self._main)
            traffic, blocked = self.traffic, None
            if traffic is not None:  # in a job's transfers: whether the device waits on one, not where the host is
                try:
                    blocked = traffic.in_flight.blocking()
                except Exception:  # noqa: BLE001 - a device in error answers no query; the main thread reports it
                    blocked = None
                waiting = blocked is not None
            with self._lock:
                if not self._active.is_set():
                    continue
                try:
                    self._send("heartbeat", {"rank": self.rank, "phase": self.phase, "step": self.step,
                                             "where": at, "waiting": waiting,
                                             "blocked": blocked.describe() if blocked is not None else None,
                                             "launched": traffic.calls if traffic is not None else None})
                except OSError:
                    return  # the client is gone; the reader thread ends the process
            time.sleep(self.interval_s)


# -- client side -------------------------------------------------------------------------------------

@dataclass
class RankPulse:
    """What the client last heard from one rank during a job."""

    seen: float  # monotonic time of the last message of any kind
    progressed: float  # monotonic time of the last completed step (or of the job's start)
    phase: str = "loading"
    step: int = 0
    where: str = ""
    waiting: bool = False
    launched: int | None = None  # collectives and transfers this rank has launched in this job
    blocked: str | None = None  # the transfer its device waits on, e.g. "all_to_all with rank 1"


class JobWatch:
    """Deadlines for one job. `check` returns a one-sentence failure, or None while all is well."""

    def __init__(self, config: WatchdogConfig, devices: list[str], expected_step_s: float | None):
        now = time.monotonic()
        self.config, self.devices = config, devices
        self.ranks = [RankPulse(now, now) for _ in devices]
        self.expected_step_s = expected_step_s
        self.step_seconds: list[float] = []
        self.cancel_at: float | None = None

    # -- what the workers tell us ----------------------------------------------------------------------

    def heard(self, rank: int, kind: str, meta: dict) -> None:
        now = time.monotonic()
        pulse = self.ranks[rank]
        pulse.seen = now
        if kind == "heartbeat":
            pulse.phase, pulse.where, pulse.waiting = meta["phase"], meta["where"], meta["waiting"]
            pulse.launched, pulse.blocked = meta.get("launched"), meta.get("blocked")
        elif kind == "progress":
            pulse.progressed, pulse.step, pulse.phase = now, meta["step"], "sampling"
            if meta.get("sec_per_step") is not None:
                self.step_seconds.append(float(meta["sec_per_step"]))
        elif kind == "loaded":
            pulse.progressed, pulse.phase = now, "loaded"

    def started_sampling(self) -> None:
        """All ranks loaded and were told to go: the step deadlines start now."""
        now = time.monotonic()
        for pulse in self.ranks:
            pulse.progressed, pulse.phase = now, "sampling"

    def cancel_requested(self) -> None:
        if self.cancel_at is None:
            self.cancel_at = time.monotonic()

    @property
    def step_estimate_s(self) -> float:
        """The longest step seen in this job, else the previous job's, else 0 (the grace alone)."""
        if self.step_seconds:
            return max(self.step_seconds)
        return self.expected_step_s or 0.0

    # -- the deadlines ---------------------------------------------------------------------------------

    def check(self, pending: set[int]) -> Exception | None:
        """The error to fail the job with (the caller kills the workers first), or None while all is well."""
        from ..errors import Cancelled, WorkerError

        problem = self._problem(pending)
        if problem is None:
            return None
        kind, message = problem
        return Cancelled(message) if kind == "cancel" else WorkerError(message)

    def _problem(self, pending: set[int]) -> tuple[str, str] | None:
        now = time.monotonic()
        c = self.config
        silent = [r for r in sorted(pending) if now - self.ranks[r].seen > c.heartbeat_timeout_s]
        if silent:
            r = silent[0]
            return "hung", (f"worker {r} ({self.devices[r]}) stopped responding: no heartbeat for "
                    f"{now - self.ranks[r].seen:.0f} s while {self._doing(r)} (the process is frozen, swapped "
                    f"out or stuck in the device driver); the workers were restarted and the next prompt runs on "
                    f"fresh ones — if it repeats, check that process and the device.")
        if self.cancel_at is not None:
            limit = c.cancel_grace_s + 2 * self.step_estimate_s  # a cancel is voted on one step later
            if now - self.cancel_at > limit:
                return "cancel", (f"cancelled: the workers did not stop within {limit:.0f} s "
                                  f"({self._stuck_ranks(pending)}), so they were killed and the next prompt starts "
                                  f"fresh ones.")
        loading = [r for r in sorted(pending) if self.ranks[r].phase == "loading"]
        for r in loading:
            if now - self.ranks[r].progressed > c.load_timeout_s:
                return "hung", (f"worker {r} ({self.devices[r]}) spent over {c.load_timeout_s:.0f} s loading the model "
                        f"({self.ranks[r].where}); the workers were restarted — check the disk, or raise "
                        f"PARADIT_LOAD_TIMEOUT_S.")
        limit = self.step_estimate_s + c.step_grace_s
        late = [r for r in sorted(pending) if self.ranks[r].phase == "sampling"
                and now - self.ranks[r].progressed > limit]
        if late:
            expected = f"{self.step_estimate_s:.2g} s expected" if self.step_estimate_s else "no step measured yet"
            return "hung", (f"step {max(self.ranks[r].step for r in late) + 1} made no progress for {limit:.0f} s "
                    f"({expected}; {self._stuck_ranks(late)}); the workers were killed and the next prompt starts "
                    f"fresh ones — raise PARADIT_STEP_GRACE_S if such steps are expected.")
        return None

    def _doing(self, r: int) -> str:
        pulse = self.ranks[r]
        return f"{pulse.phase} step {pulse.step + 1}" if pulse.phase == "sampling" else pulse.phase

    def _loading_state(self, r: int) -> str:
        pulse = self.ranks[r]
        state = "loading the model" if pulse.phase == "loading" else "loaded, waiting for the others"
        return f"rank {r} ({self.devices[r]}) {state}" + (f" in {pulse.where}" if pulse.where else "")

    def _fewest_launched(self, ranks) -> list[int]:
        """The ranks that launched fewer transfers than the others (empty when all are level or unknown)."""
        counts = {r: self.ranks[r].launched for r in ranks}
        if None in counts.values() or len(set(counts.values())) < 2:
            return []
        low = min(counts.values())
        return [r for r, n in counts.items() if n == low]

    def _blocked_on(self, ranks) -> str:
        """What the waiting ranks' devices wait on, where their heartbeats said."""
        said = [f"rank {r}: {self.ranks[r].blocked}" for r in ranks if self.ranks[r].blocked]
        return f" ({'; '.join(said)})" if said else ""

    def _stuck_ranks(self, ranks) -> str:
        """Name the ranks that compute (or hang) while the others wait for them in a collective."""
        ranks = sorted(ranks)
        loading = [r for r in ranks if self.ranks[r].phase in ("loading", "loaded")]
        if loading:
            # Before "go" no rank is in a sampling collective: a stack in torch.distributed then is an import or
            # a group being created, not a peer to blame.
            return ", ".join(self._loading_state(r) for r in loading)
        busy = [r for r in ranks if not self.ranks[r].waiting]
        waiting = [r for r in ranks if self.ranks[r].waiting]
        if busy and waiting:
            names = ", ".join(f"rank {r} ({self.devices[r]}) in {self.ranks[r].where or self._doing(r)}" for r in busy)
            return (f"{names} never reached the collective that rank(s) {', '.join(map(str, waiting))} wait in"
                    + self._blocked_on(waiting))
        if waiting:
            behind = self._fewest_launched(waiting)
            if behind:
                # On NCCL the host launches collectives and waits later, so every stack reads "waiting"; the
                # rank that launched fewer is the one its peers' collective is missing.
                names = ", ".join(f"rank {r} ({self.devices[r]}) launched {self.ranks[r].launched}" for r in behind)
                most = max(self.ranks[r].launched for r in waiting)
                return f"{names} of the {most} transfers its peers launched; its peers wait for it"
            return (f"every rank waits in a collective "
                    f"({', '.join(f'rank {r}: {self.ranks[r].blocked or self.ranks[r].where}' for r in waiting)})"
                    f" — a stuck communicator or device")
        return ", ".join(f"rank {r} ({self.devices[r]}) in {self.ranks[r].where or self._doing(r)}" for r in ranks)
