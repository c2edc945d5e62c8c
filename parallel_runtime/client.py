"""RuntimeClient: starts one worker per device, sends jobs, streams progress, cancels, cleans up.

Lifecycle: workers start on the first job and stay alive between jobs (they keep their weights).
The control channel is an AF_UNIX socket in a fresh 0700 directory, authenticated with a random key
handed to each worker on its stdin. A worker that dies mid-job, or any error that may leave the
process group inconsistent, tears every worker down; the next job starts fresh ones. On interpreter
exit (or if this process dies, which closes the sockets) the workers end too.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Listener, wait
from typing import Callable

import torch

from . import errors
from .devices import parse_devices
from .protocol import Channel
from .spec import Job

STARTUP_TIMEOUT_S = 120.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class JobResult:
    latent: torch.Tensor
    stats: list[dict] = field(default_factory=list)  # one per rank, see worker.run_job
    seconds: float = 0.0


class RuntimeClient:
    def __init__(self, devices: str = "auto", threads_per_worker: int | None = None):
        self.devices_spec = devices
        self.devices = parse_devices(devices)
        self.world = len(self.devices)
        if threads_per_worker is None:
            cpu_workers = sum(d == "cpu" for d in self.devices)
            threads_per_worker = max(1, (os.cpu_count() or 1) // max(cpu_workers, 1)) if cpu_workers else 1
        self.threads = threads_per_worker
        self.procs: list[subprocess.Popen] = []
        self.chans: list[Channel] = []
        self._dir = None
        self._lock = threading.RLock()
        self.last_strategy = ""
        self.last_sec_per_step = None
        self.device_bytes: dict[int, int | None] = {}  # latest accelerator memory each rank reported (RSS is read here)
        # Runs when the client is collected and at interpreter exit; it takes no lock, so exit never waits
        # for a running job.
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self.chans)

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> None:
        with self._lock:
            if self.alive:
                return
            self.shutdown()
            self._dir = tempfile.mkdtemp(prefix="paradit-")  # mkdtemp makes it 0700: only we can connect
            address = os.path.join(self._dir, "control.sock")
            key = secrets.token_bytes(32)
            listener = Listener(address, family="AF_UNIX", authkey=key)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(self.threads)
            try:
                for rank, device in enumerate(self.devices):
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "parallel_runtime.worker", "--rank", str(rank), "--world",
                         str(self.world), "--device", device, "--socket", address, "--threads", str(self.threads)],
                        stdin=subprocess.PIPE, env=env, cwd=_PACKAGE_ROOT)
                    proc.stdin.write(key.hex().encode() + b"\n")
                    proc.stdin.close()
                    self.procs.append(proc)
                self.chans.extend([None] * self.world)
                hello = self._accept(listener)
                # Every worker is connected: the socket file has done its job, and removing it now means
                # no directory is left behind even if this process is later killed without cleanup.
                _close_quietly(listener)
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
                port = hello[0]["store_port"]
                session = secrets.token_hex(8)
                for chan in self.chans:
                    chan.send("init", {"store_port": port, "session": session})
                for chan in self.chans:
                    self._recv(chan, STARTUP_TIMEOUT_S, expect="ready")
            except BaseException:
                _close_quietly(listener)
                self.shutdown()
                raise

    def _accept(self, listener: Listener) -> dict[int, dict]:
        """Accept one connection per worker, failing fast (with its exit code) if a worker dies first.
        Returns each rank's hello message."""
        accepted: list = []
        done = threading.Event()

        def accept_all():
            try:
                for _ in range(self.world):
                    accepted.append(listener.accept())
            except OSError:
                pass
            done.set()

        threading.Thread(target=accept_all, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not done.wait(0.05):
            self._check_procs()
            if time.monotonic() > deadline:
                raise errors.WorkerError(f"workers did not connect within {STARTUP_TIMEOUT_S:.0f} s; check that "
                                         f"python can import torch in this environment.")
        if len(accepted) != self.world:
            self._check_procs()
            raise errors.WorkerError("workers failed to connect to the control socket; retry the job.")
        hello = {}
        for conn in accepted:
            chan = Channel(conn)
            kind, meta, _ = chan.recv()
            self.chans[meta["rank"]] = chan
            hello[meta["rank"]] = meta
        return hello

    def shutdown(self) -> None:
        with self._lock:
            for chan in self.chans:
                if chan is not None:
                    try:
                        chan.send("shutdown")
                    except OSError:
                        pass
            deadline = time.monotonic() + 5
            for proc in self.procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            _kill_all(self.procs, self.chans)
            self.procs.clear()
            self.chans.clear()
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    # -- jobs ----------------------------------------------------------------------------------------

    def sample(self, job: Job, progress=None, interrupted=None) -> torch.Tensor:
        return self.run(job, progress, interrupted).latent

    def run(self, job: Job, progress: Callable[[int, int, dict], None] | None = None,
            interrupted: Callable[[], bool] | None = None) -> JobResult:
        """Validate, send the job to every worker, stream progress, return the latent and per-rank stats."""
        from .validate import validate_job

        validate_job(job, self.world)
        # Workers run in the plugin folder: a relative path must mean what it meant here.
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, path=os.path.abspath(job.model.path)))
        with self._lock:
            self.start()
            meta = {"model": job.model.to_json(), "strategy": job.strategy.to_json(),
                    "sampling": job.sampling.to_json(), "positive_guidance": job.positive.guidance}
            tensors = {"latent": job.latent, **job.positive.tensors("positive")}
            if "batch_index" in job.extra:
                meta["extra"] = {"batch_index": [int(i) for i in job.extra["batch_index"]]}
            if job.negative is not None:
                meta["negative_guidance"] = job.negative.guidance
                tensors.update(job.negative.tensors("negative"))
            self.last_strategy = job.strategy.label()
            t0 = time.perf_counter()
            try:
                for chan in self.chans:
                    chan.send("job", meta, tensors)
            except OSError:
                self._check_procs(during_job=True)
                raise
            latent, stats = self._collect(progress, interrupted)
            return JobResult(latent, stats, time.perf_counter() - t0)

    def _collect(self, progress, interrupted):
        pending = set(range(self.world))
        latent, stats, failures, cancelled = None, [None] * self.world, {}, False
        held: list[BaseException] = []  # an exception from a callback, re-raised once the workers stopped
        cancel_sent = False
        by_fd = {chan.conn: rank for rank, chan in enumerate(self.chans)}

        def cancel_requested() -> bool:
            if held:
                return True
            try:
                return interrupted is not None and bool(interrupted())
            except BaseException as exc:  # noqa: BLE001
                held.append(exc)
                return True

        while pending:
            if not cancel_sent and cancel_requested():
                try:
                    for chan in self.chans:
                        chan.send("cancel")
                except OSError:  # a worker died: report that, not a broken pipe
                    self._check_procs(during_job=True)
                cancel_sent = True
            for conn in wait(list(by_fd), timeout=0.1):
                rank = by_fd[conn]
                try:
                    kind, meta, tensors = self.chans[rank].recv()
                except (EOFError, OSError):
                    self._worker_died(rank)
                if kind == "progress":
                    self.device_bytes[rank] = meta.get("device_bytes")
                    if meta.get("report"):
                        self.last_sec_per_step = meta.get("sec_per_step")
                        if progress is not None and not held:
                            try:
                                progress(meta["step"], meta["total"], meta)
                            except BaseException as exc:  # noqa: BLE001 - e.g. the host's own interrupt
                                held.append(exc)
                elif kind == "done":
                    stats[rank] = meta
                    latent = tensors.get("latent", latent)
                    pending.discard(rank)
                elif kind == "cancelled":
                    cancelled = True
                    pending.discard(rank)
                elif kind == "error":
                    failures[rank] = meta
                    pending.discard(rank)
            if any(m["type"] != "ConfigError" for m in failures.values()):
                break  # peers may be stuck in a collective: don't wait for them
            self._check_procs(during_job=True)
        if failures:
            rank, meta = min(failures.items())
            if pending or any(m["type"] != "ConfigError" for m in failures.values()):
                # The process group may be mid-collective: only fresh workers are safe.
                self.shutdown()
            raise _worker_exception(meta)
        if held:
            raise held[0]
        if cancelled:
            raise errors.Cancelled("the job was cancelled; the workers are ready for the next one.")
        return latent, stats

    def _worker_died(self, rank: int):
        proc = self.procs[rank]
        try:
            code = proc.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        self.shutdown()
        raise errors.WorkerError(
            f"worker {rank} ({self.devices[rank]}) died (exit code {code}) during the job; the workers were "
            f"stopped and the next job starts fresh ones — if it repeats, check memory use (exit -9 is the OOM killer).")

    def _check_procs(self, during_job: bool = False) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._worker_died(rank) if during_job else self._startup_failed(rank)

    def _startup_failed(self, rank: int):
        code = self.procs[rank].returncode
        self.shutdown()
        raise errors.WorkerError(f"worker {rank} ({self.devices[rank]}) exited with code {code} while starting; "
                                 f"its error is printed above in the console — fix it and retry.")

    def _recv(self, chan: Channel, timeout: float, expect: str | None = None):
        deadline = time.monotonic() + timeout
        while not chan.poll(0.1):
            self._check_procs()
            if time.monotonic() > deadline:
                raise errors.WorkerError("a worker stopped answering while starting; retry the job.")
        kind, meta, tensors = chan.recv()
        if kind == "error":
            raise _worker_exception(meta)
        if expect and kind != expect:
            raise errors.WorkerError(f"worker sent {kind!r} instead of {expect!r}; retry the job.")
        return kind, meta, tensors

    # -- status and memory ---------------------------------------------------------------------------

    def status(self) -> dict:
        """Safe to call from another thread while a job runs (it takes no lock)."""
        procs = list(self.procs)
        workers = [{"rank": rank, "device": device, "alive": rank < len(procs) and procs[rank].poll() is None,
                    "rss_bytes": _rss(procs, rank),
                    "device_bytes": self.device_bytes.get(rank)}
                   for rank, device in enumerate(self.devices)]
        return {"devices": self.devices, "workers": workers, "strategy": self.last_strategy,
                "sec_per_step": self.last_sec_per_step}

    def release(self) -> None:
        """Free the workers' weights but keep the processes (and their process group) alive."""
        with self._lock:
            if not self.alive:
                return
            for chan in self.chans:
                chan.send("release")
            for chan in self.chans:
                self._recv(chan, 60, expect="released")


def _worker_exception(meta: dict) -> errors.ParaDiTError:
    """The exception a worker's error message stands for; only ParaDiT's own types are trusted by name."""
    exc_type = getattr(errors, meta["type"], None)
    if not (isinstance(exc_type, type) and issubclass(exc_type, errors.ParaDiTError)):
        exc_type = errors.WorkerError
    return exc_type(meta["message"])


def _close_quietly(listener: Listener) -> None:
    try:
        listener.close()
    except OSError:  # its socket file may already be gone with the session directory
        pass


def _rss(procs, rank) -> int | None:
    try:
        import psutil

        return psutil.Process(procs[rank].pid).memory_info().rss
    except Exception:  # noqa: BLE001 - a dead or unknown process has no RSS
        return None


def _kill_all(procs, chans) -> None:
    for chan in chans:
        if chan is not None:
            chan.close()
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


_CLIENTS: dict[str, RuntimeClient] = {}
_CLIENTS_LOCK = threading.Lock()


def active_clients() -> list[RuntimeClient]:
    with _CLIENTS_LOCK:
        return list(_CLIENTS.values())


def get_client(devices: str = "auto", threads_per_worker: int | None = None) -> RuntimeClient:
    """The process-wide client for a device set. Only one set owns devices at a time: asking for another
    shuts the previous one down, since two clients would fight over the same GPUs."""
    with _CLIENTS_LOCK:
        key = devices.strip().lower()
        client = _CLIENTS.get(key)
        if client is None:
            for other in list(_CLIENTS.values()):
                other.shutdown()
            _CLIENTS.clear()
            client = _CLIENTS[key] = RuntimeClient(devices, threads_per_worker)
        return client
