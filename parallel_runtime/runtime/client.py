"""RuntimeClient: starts one worker per device, sends jobs, streams progress, cancels, cleans up.

Lifecycle: workers start on the first job and stay alive between jobs (they keep their weights).
The control channel is an AF_UNIX socket in a fresh 0700 directory (loopback TCP where Python has no AF_UNIX,
as on Windows), authenticated with a random key handed to each worker on its stdin. On interpreter exit (or if
this process dies, which closes the sockets) the workers end too.

Nothing here waits without a bound (see watchdog.py): idle workers answer a ping before a job; busy
workers beat; a frozen worker, a stuck collective or a Cancel the workers do not honour in time gets the
workers killed and the job failed with one sentence naming the rank and device; the next job starts
fresh workers. A job runs in two phases — every rank loads its weights and reports, then the client says
go — so a failure while loading (a file error, an out-of-memory) never leaves a peer inside a collective,
and the healthy workers are kept.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener, wait
from typing import Callable

import torch

from .. import errors
from ..distributed.devices import pinned_cores, runtime_devices, worker_threads
from ..distributed.portability import (TIMED_OUT, interface_of, loopback_interface, loopback_store, module_command,
                                       send_small_messages_now, socket_timeout, worker_environment)
from ..planning.memory import check_job_memory, keeps_other_models, settle_weight_sharding
from ..spec import Job
from .cluster import LOCAL, RankPlace, RemoteProcess, front_door, names_remote, place_ranks
from .links import p2p_setting, shared_memory_problem
from .protocol import PATCH_SETS_KEPT, Channel, encode, keep_hints, keep_recent
from .watchdog import JobWatch, WatchdogConfig

STARTUP_TIMEOUT_S = 120.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the plugin folder
# Settings of the host process that must not leak into the workers: ComfyUI picks its own CUDA allocator
# (cudaMallocAsync) for its own memory manager; the workers use torch's default unless told otherwise.
_HOST_ONLY_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_EXIT_GRACE_S = 1.0  # after a run-phase error, how long to look for a worker that exited (see _blame_an_exit)
log = logging.getLogger("paradit")


@dataclass
class JobResult:
    latent: torch.Tensor
    stats: list[dict] = field(default_factory=list)  # one per rank, see worker.run_job
    seconds: float = 0.0
    audio: torch.Tensor | None = None  # an audio-video job's audio result (Job.audio)


class _JobReplies:
    """What the workers have answered so far in one job (RuntimeClient._collect)."""

    def __init__(self, world: int, interrupted: Callable[[], bool] | None):
        self.interrupted = interrupted
        self.pending = set(range(world))  # ranks still in the job
        self.latent, self.stats, self.failures, self.cancelled = None, [None] * world, {}, False
        self.audio = None
        self.loaded: set[int] = set()
        self.load_failures: dict[int, dict] = {}
        self.gate_open = False
        self.held: list[BaseException] = []  # an exception from a callback, re-raised once the workers stopped
        self.cancel_sent = False

    def cancel_requested(self) -> bool:
        if self.held:
            return True
        try:
            return self.interrupted is not None and bool(self.interrupted())
        except BaseException as exc:  # noqa: BLE001
            self.held.append(exc)
            return True

    @property
    def peers_may_be_stuck(self) -> bool:
        """A rank failed with something other than a ConfigError: its peers may be stuck in a collective."""
        return any(m["type"] != "ConfigError" for m in self.failures.values())


class RuntimeClient:
    def __init__(self, devices: str = "auto", threads_per_worker: int | None = None,
                 watchdog: WatchdogConfig | None = None, p2p: str = "auto"):
        """`p2p`: 'off' starts the workers with NCCL_P2P_DISABLE=1 (as PARADIT_NCCL_P2P=off or NCCL_P2P_DISABLE in
        this process's environment do), for boards whose GPU peer-to-peer transfers are broken; 'auto' leaves NCCL
        to choose."""
        self.devices_spec = devices
        self.p2p = p2p_setting(p2p)
        self._threads_asked = threads_per_worker
        self._place()
        self._speeds: dict[tuple, tuple[float, ...]] = {}  # measure_speeds' results, for these workers
        self.watchdog = watchdog or WatchdogConfig.from_env()
        self.procs: list[subprocess.Popen] = []
        self.chans: list[Channel] = []
        self._stderr_tails: list[collections.deque] = []
        self._dir = None
        self.control_address = None  # the listener's: a socket path (AF_UNIX) or ("127.0.0.1", port)
        self._remote_paths: dict[tuple, str] = {}  # (host, path, mtime, size) -> that host's path of the file
        self._store = None  # the rendezvous store, here where ranks run on other machines (else rank 0 holds it)
        self._session = None  # the front door's session of those workers (cluster.Session)
        self._lock = threading.RLock()
        self.last_strategy = ""
        self.last_sec_per_step = None
        self.device_bytes: dict[int, int | None] = {}  # latest accelerator memory each rank reported (RSS is read here)
        self.memory_reports: list[dict] = []  # each rank's memory as it answered the last ping
        self._step_estimates: dict[tuple, float] = {}  # job shape (see run) -> slowest step seen
        self.model_loads = 0  # jobs for which some worker read weights from a file (status, tests)
        self._patches_on_workers = collections.OrderedDict()  # ids of the WeightPatches every worker keeps
        self.resident_models: list[str] = []  # file names of the models the workers hold, the current one last
        self.last_residency_note: str | None = None  # why the last release of a resident model happened
        self._hints_on_workers: collections.OrderedDict = collections.OrderedDict()  # ControlNet hint keys held
        # Runs when the client is collected and at interpreter exit; it takes no lock, so exit never waits
        # for a running job.
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self.chans)

    def _place(self) -> None:
        """Where each rank runs: this machine's devices (as `devices` names them) and, where it names other
        machines, those their agents lent (cluster.place_ranks: a host that has not joined is one sentence)."""
        if names_remote(self.devices_spec):
            self.places = place_ranks(self.devices_spec, front_door())
            self.notice = None
            local = [p.device for p in self.places if p.host == LOCAL]
            self.cores = [None] * len(self.places)
        else:
            local, self.notice = runtime_devices(self.devices_spec)  # the notice: shown by the nodes before loading
            self.places = [RankPlace(LOCAL, d) for d in local]
            self.cores = pinned_cores(self.devices_spec)[:len(local)]
        problem = shared_memory_problem(local, self.p2p == "off")
        if problem:
            raise errors.ConfigError(problem)
        self.devices = [p.device for p in self.places]  # each rank's device on its own host
        self.hosts = tuple(p.host for p in self.places)
        self.labels = [p.label for p in self.places]  # what messages call each rank's device ("box2 cuda:0")
        self.world = len(self.places)
        self.threads = self._threads_asked or worker_threads(local or self.devices, self.cores[:len(local) or None])

    @property
    def remote(self) -> bool:
        return any(h != LOCAL for h in self.hosts)

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> None:
        with self._lock:
            if self.alive:
                return
            self.shutdown()
            if self.notice:
                log.warning("ParaDiT: %s", self.notice)
            self._patches_on_workers.clear()  # fresh workers hold no patches
            self._hints_on_workers.clear()  # nor hints
            self.resident_models = []  # nor models
            if self.remote:
                self._place()  # the hosts that are joined now (a lost one is named before anything starts)
            key = secrets.token_bytes(32)
            listener, self._dir = _control_listener(key, self.world)
            self.control_address = listener.address
            session = secrets.token_hex(8)
            try:
                store_ports = self._start_workers(listener, key, session)
                hello = self._accept(listener, session)
                # Every worker is connected: the socket file (if any) has done its job, and removing it now means
                # no directory is left behind even if this process is later killed without cleanup.
                _close_quietly(listener)
                if self._dir:
                    shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
                for rank, chan in enumerate(self.chans):
                    chan.send("init", {"store_port": store_ports.get(self.hosts[rank], hello[0]["store_port"]),
                                       "session": session, "heartbeat_s": self.watchdog.heartbeat_s,
                                       "collective_timeout_s": self.watchdog.collective_timeout_s})
                self._await_ready()
            except (EOFError, OSError) as exc:
                _close_quietly(listener)
                self._lost_while_starting(exc)
            except BaseException:
                _close_quietly(listener)
                self.shutdown()
                raise

    def _start_workers(self, listener: Listener, key: bytes, session: str) -> dict[str, int]:
        """Start every rank: this machine's as subprocesses, other machines' through their agents. Returns the port
        each host's workers reach the rendezvous store on (none for a one-machine runtime: its rank 0 makes it)."""
        ports = {}
        if self.remote:
            # The store lives here, on loopback: other machines' workers reach it only through the front door's
            # authenticated relay (cluster.py); rank 0 may itself be on another machine.
            listen = socket.socket()
            listen.bind(("127.0.0.1", 0))
            listen.listen()
            port = listen.getsockname()[1]
            self._store = loopback_store(port, self.world, listen_fd=listen.detach())
            self._session = front_door().open_session(session, port)
            ports[LOCAL] = port
        for rank, place in enumerate(self.places):
            if place.host != LOCAL:
                continue
            proc = subprocess.Popen(
                module_command("parallel_runtime.runtime.worker", _PACKAGE_ROOT)
                + ["--rank", str(rank), "--world", str(self.world), "--device", place.device,
                   *_control_argument(listener.address), "--threads", str(self.threads)]
                + ([] if self.cores[rank] is None else ["--core", str(self.cores[rank])]),
                stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=self._worker_env(), cwd=_PACKAGE_ROOT)
            proc.stdin.write(key.hex().encode() + b"\n")
            proc.stdin.close()
            self.procs.append(proc)
            self._stderr_tails.append(_tee_stderr(proc, rank))
        for host in dict.fromkeys(h for h in self.hosts if h != LOCAL):
            agent = front_door().agent(host)
            ranks = [(r, p.device) for r, p in enumerate(self.places) if p.host == host]
            procs, ports[host] = agent.spawn(session, ranks, self.world, threads=0)
            for rank, proc in sorted(procs.items()):
                self.procs.insert(rank, proc)
                self._stderr_tails.insert(rank, proc.tail)
        self.chans.extend([None] * self.world)
        return ports

    def _worker_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY_ENV}
        if os.environ.get("PARADIT_WORKER_CUDA_ALLOC_CONF"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ["PARADIT_WORKER_CUDA_ALLOC_CONF"]
        if self.p2p == "off":
            env["NCCL_P2P_DISABLE"] = "1"
        if self.remote:
            env["PARADIT_CLIENT_STORE"] = env["PARADIT_MULTIHOST"] = "1"
        # The transfers bind to loopback, or (with ranks on other machines) to the front door's interface only.
        interface = interface_of(front_door().address[0]) if self.remote else loopback_interface()
        return worker_environment(env, _PACKAGE_ROOT, self.threads, interface, pin_interface=self.remote)

    def _accept(self, listener: Listener, session: str) -> dict[int, dict]:
        """Accept one connection per worker, failing fast (with its exit code) if a worker dies first: this
        machine's on `listener`, other machines' through the front door (already authenticated there).
        Returns each rank's hello message."""
        accepted: list = []
        done, over = threading.Event(), threading.Event()
        local = self.hosts.count(LOCAL)

        def accept_all():
            while len(accepted) < local and not over.is_set():
                try:
                    accepted.append(listener.accept())
                except (AuthenticationError, EOFError, OSError):
                    # A local stranger on the loopback port (without the key, reset, or a reply too long for the
                    # challenge): that connection is dropped, never read, and the start goes on. Once the start
                    # is over, the listener is closed and `over` ends the loop.
                    continue
            while self.remote and len(accepted) < self.world and not over.is_set():
                try:
                    accepted.append(self._session.connections.get(timeout=0.1))
                except queue.Empty:
                    continue
            done.set()

        threading.Thread(target=accept_all, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while not done.wait(0.05):
                self._check_procs()
                if time.monotonic() > deadline:
                    raise errors.WorkerError(f"workers did not connect within {STARTUP_TIMEOUT_S:.0f} s; check "
                                             f"that python can import torch in this environment.")
        finally:
            over.set()  # before the caller closes the listener
        if len(accepted) != self.world:
            self._check_procs()
            raise errors.WorkerError("workers failed to connect to the control socket; retry the job.")
        hello = {}
        for conn in accepted:
            _bound_io(conn, self.watchdog.heartbeat_timeout_s)
            chan = Channel(conn)
            _, meta, _ = self._recv(chan, STARTUP_TIMEOUT_S, expect="hello")
            self.chans[meta["rank"]] = chan
            hello[meta["rank"]] = meta
        return hello

    def _await_ready(self) -> None:
        """Wait for every worker's 'ready' at once and raise the first error any of them sends: in the link check,
        the rank that got no answer says so in one sentence while the silent one says nothing, whatever its rank."""
        waiting = {chan.conn: rank for rank, chan in enumerate(self.chans)}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            readable = wait(list(waiting), timeout=0.1)
            for conn in readable:
                kind, meta, _ = self.chans[waiting[conn]].recv()
                if kind == "error":
                    raise _worker_exception(meta)
                if kind == "ready":
                    del waiting[conn]
                elif kind != "heartbeat":
                    raise errors.WorkerError(f"worker sent {kind!r} instead of 'ready'; retry the job.")
            if not readable:
                self._check_procs()
                if time.monotonic() > deadline:
                    rank = min(waiting.values())
                    self.kill()
                    raise errors.WorkerError(f"worker {rank} ({self.labels[rank]}) did not answer ready within "
                                             f"{STARTUP_TIMEOUT_S:.0f} s; the workers were restarted — retry.")

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
            self.kill()

    def kill(self) -> None:
        """Stop every worker now: SIGKILL works on frozen and stuck processes alike."""
        with self._lock:
            _kill_all(self.procs, self.chans)
            self.procs.clear()
            self.chans.clear()
            if self._session is not None:
                front_door().close_session(self._session.token)
            self._session = self._store = None
            self._stderr_tails.clear()
            self.memory_reports = []
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    # -- jobs ----------------------------------------------------------------------------------------

    def sample(self, job: Job, progress=None, interrupted=None) -> torch.Tensor:
        return self.run(job, progress, interrupted).latent

    def run(self, job: Job, progress: Callable[[int, int, dict], None] | None = None,
            interrupted: Callable[[], bool] | None = None) -> JobResult:
        """Validate, send the job to every worker, stream progress, return the latent and per-rank stats."""
        from ..validate import validate_job

        with self._lock:
            if self.remote and not self.alive:
                self._place()  # 'all', or after a host was lost: the machines joined now, before validation
        validate_job(job, self.world)
        # Workers run in the plugin folder: a relative path must mean what it meant here.
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, path=os.path.abspath(job.model.path)))
        with self._lock:
            self.start()
            self.ping()
            job = settle_weight_sharding(job, self.devices, self.memory_reports)
            check_job_memory(job, self.devices, self.memory_reports)
            keep = keeps_other_models(job, self.devices, self.memory_reports)
            meta = {"model": job.model.to_json(), "strategy": job.strategy.to_json(), "keep_resident": keep,
                    "sampling": job.sampling.to_json(), **job.positive.meta("positive")}
            tensors = {"latent": job.latent, **job.positive.tensors("positive")}
            if "batch_index" in job.extra:
                meta["extra"] = {"batch_index": [int(i) for i in job.extra["batch_index"]]}
            if job.extra.get("rope_options") is not None:  # ScaleROPE's (scale t/y/x, shift t/y/x), validated
                meta.setdefault("extra", {})["rope_options"] = [float(v) for v in job.extra["rope_options"]]
            if "frame_rate" in job.extra:  # LTX-2's model call: RoPE's time axis in seconds (LTXVConditioning)
                meta.setdefault("extra", {})["frame_rate"] = float(job.extra["frame_rate"])
            if job.negative is not None:
                meta.update(job.negative.meta("negative"))
                tensors.update(job.negative.tensors("negative"))
            if job.audio is not None:
                tensors["audio"] = job.audio
            if job.audio_timestep is not None:
                tensors["audio_timestep"] = job.audio_timestep
            if job.video_guides is not None:
                tensors.update(job.video_guides.tensors())
            if job.audio_reference is not None:
                tensors["audio_reference"] = job.audio_reference
            if job.timestep is not None:
                tensors["timestep"] = job.timestep
                meta.update(call_step=job.call_step, call_slot=job.call_slot, call_last=job.call_last)
            if job.skip_blocks:
                meta["skip_blocks"] = [[kind, int(index)] for kind, index in job.skip_blocks]
            if job.weight_patches is not None:
                # Tensors only when new to the workers; else they keep the ones they have under that id.
                sent = job.weight_patches.id not in self._patches_on_workers
                meta["weight_patches"] = dict(job.weight_patches.meta(), sent=sent)
                if sent:
                    tensors.update(job.weight_patches.tensors())
            new_hints = self._hints_message(job, meta, tensors)
            self.last_strategy = job.strategy.label()
            # What a step costs depends on the model and its dtype too (and on whether cfg adds a branch).
            key = (job.model.path, job.model.weight_dtype, job.model.quantized_matmul, job.strategy,
                   tuple(job.latent.shape), job.sampling.steps, job.negative is not None)
            watch = JobWatch(self.watchdog, self.labels, self._step_estimates.get(key))
            t0 = time.perf_counter()
            self._send_per_host(self._messages_per_host("job", meta, tensors))
            if job.weight_patches is not None:
                keep_recent(self._patches_on_workers, job.weight_patches.id, None, PATCH_SETS_KEPT)
            keep_hints(self._hints_on_workers, meta.get("hints", []), new_hints)
            latent, stats, audio = self._collect(watch, progress, interrupted)
            self.model_loads += any(s.get("loaded") for s in stats)
            self._note_residency(job, stats, keep)
            if watch.step_seconds:
                self._step_estimates[key] = max(watch.step_seconds)
            return JobResult(latent, stats, time.perf_counter() - t0, audio)

    def _note_residency(self, job: Job, stats: list[dict], keep: bool) -> None:
        """Which models the workers now hold (the status shows them), and one log line when this job's model had
        to replace others for lack of memory."""
        self.resident_models = list(stats[0].get("resident", ())) if stats else []
        released = sorted({name for s in stats for name in s.get("released", ())})
        name = os.path.basename(job.model.path)
        if name in released:  # the same file under another plan (PipeFusion's stages hold other blocks)
            log.info("ParaDiT: re-read %s for this plan and released its copy for the last one.", name)
        others = [r for r in released if r != name]
        if others:
            why = ("the workers keep at most two models" if keep else "the workers have no room for both (a bigger "
                   "card, PipeFusion or an fp8/GGUF file would keep them resident)")
            self.last_residency_note = f"released {', '.join(others)} to load {name}: {why}"
            log.warning("ParaDiT: %s.", self.last_residency_note)

    def _hints_message(self, job: Job, meta: dict, tensors: dict) -> dict:
        """Name the job's kept inputs (ControlNet hints, attention masks) in `meta` and add those new to the
        workers to `tensors` (a sampling run's calls share them: each crosses the channel once). Returns the new
        keys, to remember once sent."""
        branches = [b for b in (job.positive, job.negative) if b is not None]
        named = list(dict.fromkeys(k for b in branches for k in b.kept_keys()))
        if not named:
            return {}
        hints = {k: t for b in branches for k, t in b.kept_inputs().items()}
        new = {k: hints[k] for k in named if k not in self._hints_on_workers and k in hints}
        missing = [k for k in named if k not in self._hints_on_workers and k not in hints]
        if missing:
            raise errors.ConfigError("this job names a ControlNet hint or attention mask it does not carry (a ParaDiT "
                                     "bug); run the prompt again.")
        meta["hints"] = named
        # In their own dtype: an attention mask is the model's (ComfyUI cast it), a hint float32.
        tensors.update({f"hint/{k}": t.detach().cpu().contiguous() for k, t in new.items()})
        return dict.fromkeys(new)

    def ping(self) -> list[dict]:
        """Check that every idle worker answers (and read its memory); a frozen one is replaced first."""
        with self._lock:
            for attempt in (1, 2):
                self.start()
                silent = self._ping_once()
                if silent is None:
                    return self.memory_reports
                log.warning("ParaDiT: worker %d (%s) did not answer within %.0f s; restarting the workers.",
                            silent, self.labels[silent], self.watchdog.heartbeat_timeout_s)
                self.kill()
            raise errors.WorkerError(f"worker {silent} ({self.labels[silent]}) did not answer twice in a row, even "
                                     f"freshly started; check that device and the console output above.")

    def _ping_once(self) -> int | None:
        """Returns the first rank that did not answer in time, or None with `memory_reports` filled."""
        reports: dict[int, dict] = {}
        try:
            self._send_all(encode("ping"))
        except errors.WorkerError:
            return 0
        deadline = time.monotonic() + self.watchdog.heartbeat_timeout_s
        by_fd = {chan.conn: rank for rank, chan in enumerate(self.chans)}
        while len(reports) < self.world:
            self._check_procs()
            left = deadline - time.monotonic()
            if left <= 0:
                return min(set(range(self.world)) - set(reports))
            for conn in wait(list(by_fd), timeout=min(left, 0.1)):
                rank = by_fd[conn]
                kind, meta, _ = self._recv_or_die(rank)
                if kind == "pong":
                    reports[rank] = meta
        self.memory_reports = [reports[r] for r in range(self.world)]
        return None

    def _messages_per_host(self, kind: str, meta: dict, tensors: dict | None = None) -> dict[str, bytes]:
        """One encoding of a message per host: another machine's workers read the model from their own disk, so
        its path there replaces this host's (cluster: found by name, checked by header), before anything is sent."""
        out = {LOCAL: encode(kind, meta, tensors)} if LOCAL in self.hosts else {}
        for host in dict.fromkeys(h for h in self.hosts if h != LOCAL):
            if meta.get("positive_control") or meta.get("negative_control"):
                raise errors.ConfigError(f"ControlNets run on this machine's devices only, but devices names {host}: "
                                         f"drop {host} from devices for this graph (or its ControlNet).")
            there = dict(meta)
            if "model" in there:
                there["model"] = dict(there["model"], path=self._remote_path(host, there["model"]["path"]))
            if "path" in there:
                there["path"] = self._remote_path(host, there["path"])
            out[host] = encode(kind, there, tensors)
        return out

    def _send_per_host(self, messages: dict[str, bytes]) -> None:
        for host, data in messages.items():
            self._send_all(data, ranks=[r for r, h in enumerate(self.hosts) if h == host])

    def _remote_path(self, host: str, path: str) -> str:
        """Where `host` keeps the file this host has at `path` (asked of its agent once per file version)."""
        from .agent import header_digest

        stat = os.stat(path)
        key = (host, path, stat.st_mtime_ns, stat.st_size)
        if key not in self._remote_paths:
            digest = header_digest(path)
            self._remote_paths[key] = front_door().agent(host).request(
                "resolve", {"name": os.path.basename(path), "digest": digest})["path"]
        return self._remote_paths[key]

    def _send_all(self, data: bytes, ranks=None) -> None:
        """Send one encoded message to each rank. A worker that stops reading makes the send time out (see
        `_bound_io`) rather than block: the workers are killed and the job fails naming that rank."""
        for rank in range(self.world) if ranks is None else ranks:
            try:
                self.chans[rank].send_bytes(data)
            except TIMED_OUT:
                self._stopped_responding(rank, "take a message")
            except OSError:
                self._worker_died(rank)

    def _collect(self, watch: JobWatch, progress, interrupted):
        """Serve one job's messages until every rank has finished, failing on the watchdog's deadlines."""
        replies = _JobReplies(self.world, interrupted)
        by_fd = {chan.conn: rank for rank, chan in enumerate(self.chans)}
        try:
            while replies.pending:
                if not replies.cancel_sent and replies.cancel_requested():
                    watch.cancel_requested()
                    self._send_all(encode("cancel"))
                    replies.cancel_sent = True
                self._read_replies(replies, watch, progress, by_fd)
                if not replies.gate_open and len(replies.loaded) + len(replies.load_failures) == self.world:
                    self._open_gate(replies, watch)
                if replies.peers_may_be_stuck:
                    break  # peers may be stuck in a collective: don't wait for them
                self._check_procs(during_job=True)
                problem = watch.check(replies.pending)
                if problem is not None:
                    self.kill()
                    raise problem
        except BaseException:
            if replies.pending:
                # Raised inside the loop itself (a bug, an interrupt) while workers are still in the job: their
                # next messages would be read as the next job's, so only fresh workers are safe.
                self.kill()
            raise
        return self._job_outcome(replies)

    def _read_replies(self, replies: _JobReplies, watch: JobWatch, progress, by_fd: dict) -> None:
        """Handle the messages that arrive within 0.1 s, then every one already waiting."""
        ready = wait(list(by_fd), timeout=0.1)
        while ready:
            for conn in ready:
                rank = by_fd[conn]
                kind, meta, tensors = self._recv_or_die(rank)
                watch.heard(rank, kind, meta)
                self._handle_reply(replies, rank, kind, meta, tensors, progress)
            if replies.held or replies.failures or not replies.pending:
                break
            if not replies.cancel_sent and replies.cancel_requested():
                break  # Cancel goes out now, not after the backlog: fast steps queue several progress reports
            # Read all that is waiting before the deadlines are judged: a client that was stalled itself
            # (a slow progress callback, a long GC) must not blame workers for messages it has not read.
            ready = wait(list(by_fd), timeout=0)

    def _handle_reply(self, replies: _JobReplies, rank: int, kind: str, meta: dict, tensors: dict, progress) -> None:
        """Record one worker message; a progress report also goes to the `progress` callback."""
        if kind == "loaded":
            replies.loaded.add(rank)
        elif kind == "progress":
            self.device_bytes[rank] = meta.get("device_bytes")
            if meta.get("report"):
                self.last_sec_per_step = meta.get("sec_per_step")
                if progress is not None and not replies.held:
                    try:
                        progress(meta["step"], meta["total"], meta)
                    except BaseException as exc:  # noqa: BLE001 - e.g. the host's own interrupt
                        replies.held.append(exc)
        elif kind == "done":
            replies.stats[rank] = meta
            replies.latent = tensors.get("latent", replies.latent)
            replies.audio = tensors.get("audio", replies.audio)
            replies.pending.discard(rank)
        elif kind in ("cancelled", "aborted"):
            replies.cancelled = replies.cancelled or kind == "cancelled" or replies.cancel_sent
            replies.pending.discard(rank)
        elif kind == "error":
            (replies.load_failures if meta.get("phase") == "load" else replies.failures)[rank] = meta
            replies.pending.discard(rank)

    def _open_gate(self, replies: _JobReplies, watch: JobWatch) -> None:
        """Every rank has its weights (or failed to get them) and none has entered a collective yet: go, or
        abort the loaded ones if a load failed or a Cancel came first."""
        replies.gate_open = True
        if replies.load_failures or replies.cancel_sent:
            self._send_all(encode("abort"), ranks=sorted(replies.loaded))
        else:
            self._send_all(encode("go"))
            watch.started_sampling()

    def _job_outcome(self, replies: _JobReplies):
        """(latent, stats, audio) of a job the workers finished; else the error that ends it: a run failure, then a
        load failure, then a callback's exception, then the Cancel."""
        failures = replies.failures
        if failures:
            if replies.peers_may_be_stuck:
                self._blame_an_exit(exclude=failures)
            _, meta = min(failures.items())
            if replies.pending or replies.peers_may_be_stuck:
                # The process group may be mid-collective: only fresh workers are safe.
                self.kill()
                meta = dict(meta, message=meta["message"] + _RESTARTED)
            raise _worker_exception(meta)
        if replies.load_failures:
            # Nobody entered a collective: the process group is intact and every worker is kept.
            raise _worker_exception(min(replies.load_failures.items())[1])
        if replies.held:
            raise replies.held[0]
        if replies.cancelled:
            raise errors.Cancelled("the job was cancelled; the workers are ready for the next one.")
        return replies.latent, replies.stats, replies.audio

    def _recv_or_die(self, rank: int):
        try:
            return self.chans[rank].recv()
        except TIMED_OUT:
            self._stopped_responding(rank, "finish a message it began")
        except (EOFError, OSError):
            self._worker_died(rank)

    def _stopped_responding(self, rank: int, what: str):
        """A send or receive timed out: the stream is cut mid-message, so only fresh workers are usable."""
        self.kill()
        raise errors.WorkerError(
            f"worker {rank} ({self.labels[rank]}) stopped responding: it did not {what} within "
            f"{self.watchdog.heartbeat_timeout_s:.0f} s (the process is frozen, swapped out or stuck in the device "
            f"driver); the workers were restarted and the next prompt runs on fresh ones.")

    def _blame_an_exit(self, exclude) -> None:
        """If a worker other than those in `exclude` exits within _EXIT_GRACE_S, fail the job naming it: the
        error of a peer whose collective broke because that worker died is a consequence, not the cause."""
        deadline = time.monotonic() + _EXIT_GRACE_S
        while True:
            dead = [r for r, proc in enumerate(self.procs) if r not in exclude and proc.poll() is not None]
            if dead:
                self._worker_died(dead[0])
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _worker_died(self, rank: int):
        proc = self.procs[rank]
        try:
            code = proc.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        tail = _last_words(self._stderr_tails[rank]) if rank < len(self._stderr_tails) else ""
        self.kill()
        how = getattr(proc, "reason", "") or f"{describe_exit(code)} during the job{tail}"
        raise errors.WorkerError(f"worker {rank} ({self.labels[rank]}) {how}; the workers were stopped and the next "
                                 f"job starts fresh ones.")

    def _check_procs(self, during_job: bool = False) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._worker_died(rank) if during_job else self._startup_failed(rank)

    def _lost_while_starting(self, exc: BaseException):
        """A worker's connection broke while starting: name the worker by its exit if it ended (it usually
        has, or is about to), else say so in one sentence. Either way the workers are stopped."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            self._check_procs()
            time.sleep(0.05)
        self.kill()
        raise errors.WorkerError(f"a worker's control connection broke while starting ({type(exc).__name__}: {exc}); "
                                 f"the workers were stopped — retry.") from exc

    def _startup_failed(self, rank: int):
        proc = self.procs[rank]
        tail = _last_words(self._stderr_tails[rank]) if rank < len(self._stderr_tails) else ""
        how = getattr(proc, "reason", "") or f"{describe_exit(proc.returncode)} while starting{tail}"
        self.kill()
        raise errors.WorkerError(f"worker {rank} ({self.labels[rank]}) {how}; "
                                 f"fix that (its full output is in the console above) and retry.")

    def _recv(self, chan: Channel, timeout: float, expect: str | None = None):
        deadline = time.monotonic() + timeout
        while True:
            while not chan.poll(0.1):
                self._check_procs()
                if time.monotonic() > deadline:
                    self.kill()
                    raise errors.WorkerError(f"a worker did not answer {expect or 'the client'} within {timeout:.0f} s; "
                                             f"the workers were restarted — retry.")
            kind, meta, tensors = chan.recv()
            if kind != "heartbeat":  # a beat sent just before its job ended
                break
        if kind == "error":
            raise _worker_exception(meta)
        if expect and kind != expect:
            raise errors.WorkerError(f"worker sent {kind!r} instead of {expect!r}; retry the job.")
        return kind, meta, tensors

    # -- device speed ------------------------------------------------------------------------------

    def measure_speeds(self, model_path: str, *, text_tokens: int, image_tokens: int, weight_dtype: str = "default",
                       seconds: float = 1.0) -> tuple[float, ...]:
        """Each worker's relative speed on this model's blocks at these token counts (the fastest is 1.0), measured
        by all workers at once and cached for this client's workers: the `device_weights` of a balanced job."""
        key = (os.path.abspath(model_path), text_tokens, image_tokens, weight_dtype)
        with self._lock:
            if key in self._speeds:  # the devices do not change for a client; restarted workers run on them too
                return self._speeds[key]
            self.start()
            meta = {"path": key[0], "text_tokens": text_tokens, "image_tokens": image_tokens,
                    "weight_dtype": weight_dtype, "seconds": seconds}
            self._send_per_host(self._messages_per_host("calibrate", meta))
            timeout = seconds + 10 * self.watchdog.heartbeat_timeout_s  # a block's first call may compile kernels
            speeds = [self._recv(chan, timeout, expect="speed")[1]["calls_per_s"] for chan in self.chans]
            fastest = max(speeds)
            self._speeds[key] = tuple(round(v / fastest, 2) for v in speeds)
            return self._speeds[key]

    def host_links(self) -> dict:
        """The links between this runtime's hosts, keyed by the sorted pair of host names, for the planner
        (planning/placement.py): each other machine's link to this one, measured once per agent (cluster.AgentLink.
        measure_link); between two other machines, the slower of their links to this one (not measured: stated
        in its source)."""
        from itertools import combinations

        from ..planning.costmodel import LinkTiming

        measured = {h: front_door().agent(h).measure_link() for h in dict.fromkeys(self.hosts) if h != LOCAL}
        links = {tuple(sorted((LOCAL, h))): LinkTiming(lat, bw, source=f"measured {LOCAL}<->{h}")
                 for h, (lat, bw) in measured.items()}
        for a, b in combinations(sorted(measured), 2):
            lat, bw = max(measured[a][0], measured[b][0]), min(measured[a][1], measured[b][1])
            links[(a, b)] = LinkTiming(lat, bw, source=f"assumed {a}<->{b}: the slower of their links to {LOCAL}")
        return links

    # -- status and memory ---------------------------------------------------------------------------

    def status(self) -> dict:
        """Safe to call from another thread while a job runs (it takes no lock)."""
        procs = list(self.procs)
        workers = [{"rank": rank, "device": self.labels[rank], "host": self.hosts[rank],
                    "alive": rank < len(procs) and procs[rank].poll() is None, "rss_bytes": _rss(procs, rank),
                    "device_bytes": self.device_bytes.get(rank)}
                   for rank in range(self.world)]
        door = front_door() if self.remote else None
        return {"devices": self.labels, "workers": workers, "strategy": self.last_strategy,
                "cluster": door.status() if door is not None else None,
                "sec_per_step": self.last_sec_per_step, "model_loads": self.model_loads,
                "weight_patches": list(self._patches_on_workers), "resident_models": self.resident_models,
                "residency_note": self.last_residency_note, "p2p": self.p2p}

    def release(self) -> None:
        """Free the workers' weights but keep the processes (and their process group) alive."""
        with self._lock:
            self.resident_models = []
            if not self.alive:
                return
            try:
                for chan in self.chans:
                    chan.send("release")
                for chan in self.chans:
                    self._recv(chan, self.watchdog.heartbeat_timeout_s, expect="released")
            except (OSError, EOFError, errors.ParaDiTError) as exc:
                # A worker that cannot take a release is frozen or gone; ending the workers frees their memory
                # just as well, and the next prompt starts fresh ones.
                log.warning("ParaDiT: releasing the workers failed (%s); they were stopped instead.", exc)
                self.kill()

    def memory_budget(self) -> int:
        """Bytes the tightest worker may use for a job, as the workers report it (starts them if needed)."""
        from ..planning.memory import rank_budgets

        with self._lock:
            return min(rank_budgets(self.devices, self.ping()))


def _worker_exception(meta: dict) -> errors.ParaDiTError:
    """The exception a worker's error message stands for; only ParaDiT's own types are trusted by name."""
    exc_type = getattr(errors, meta["type"], None)
    if not (isinstance(exc_type, type) and issubclass(exc_type, errors.ParaDiTError)):
        exc_type = errors.WorkerError
    return exc_type(meta["message"])


def _control_listener(key: bytes, world: int) -> tuple[Listener, str | None]:
    """(the listener the workers connect to, the private directory that holds its socket file, if any).

    An AF_UNIX socket in a fresh 0700 directory where the platform's Python has AF_UNIX (Windows' has not, though
    the OS does); else a TCP socket bound to loopback only. Either way `accept` runs the HMAC challenge with `key`
    before it returns a connection, so no message from a peer without the key is ever read. The backlog holds every
    worker: accept runs each handshake in turn, and Windows refuses (resets) a connection its full queue cannot
    hold, which the worker's Client does not retry."""
    backlog = max(8, world)
    if hasattr(socket, "AF_UNIX"):
        directory = tempfile.mkdtemp(prefix="paradit-")  # mkdtemp makes it 0700: only we can connect
        sock = os.path.join(directory, "control.sock")
        return Listener(sock, family="AF_UNIX", backlog=backlog, authkey=key), directory
    return Listener(("127.0.0.1", 0), family="AF_INET", backlog=backlog, authkey=key), None


def _control_argument(address) -> list[str]:
    """The worker's command-line arguments naming the control listener (see worker.main)."""
    if isinstance(address, tuple):
        return ["--port", str(address[1])]
    return ["--socket", address]


def _close_quietly(listener: Listener) -> None:
    try:
        listener.close()
    except OSError:  # its socket file may already be gone with the session directory
        pass


def _rss(procs, rank) -> int | None:
    try:
        import psutil

        if isinstance(procs[rank], RemoteProcess):
            return None  # a worker on another machine: its pid means nothing here
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


def get_client(devices: str = "auto", threads_per_worker: int | None = None, p2p: str = "auto") -> RuntimeClient:
    """The process-wide client for a device set (and p2p setting, which the workers start with). Only one owns
    devices at a time: asking for another shuts the previous one down, since two clients would fight over the
    same GPUs."""
    with _CLIENTS_LOCK:
        key = (devices.strip().lower(), p2p_setting(p2p))
        client = _CLIENTS.get(key)
        if client is None:
            for other in list(_CLIENTS.values()):
                other.shutdown()
            _CLIENTS.clear()
            client = _CLIENTS[key] = RuntimeClient(devices, threads_per_worker, p2p=p2p)
        return client


_RESTARTED = " (the workers were restarted; the next prompt runs on fresh ones)"


def describe_exit(code: int | None) -> str:
    """What an exit code says about how a worker ended, in words a user can act on."""
    if code is None:
        return "stopped answering"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    reasons = {"SIGKILL": "was killed (SIGKILL: usually the kernel's OOM killer when RAM ran out — check `dmesg`)",
               "SIGABRT": "aborted (SIGABRT: e.g. NCCL's watchdog after a collective timed out, or a CUDA error — "
                          "see its last output)",
               "SIGSEGV": "crashed (SIGSEGV)", "SIGBUS": "crashed (SIGBUS: often /dev/shm or the disk ran full)",
               "SIGTERM": "was terminated (SIGTERM)"}
    return reasons.get(name, f"ended by {name}")


def _tee_stderr(proc: subprocess.Popen, rank: int) -> collections.deque:
    """Forward a worker's stderr to ours, keeping its last lines to quote when it dies."""
    tail: collections.deque = collections.deque(maxlen=20)

    def pump():
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            tail.append(line.rstrip())
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # our stderr closed: keep draining so the worker never blocks
                pass
        proc.stderr.close()

    threading.Thread(target=pump, daemon=True, name=f"paradit-stderr-{rank}").start()
    return tail


def _last_words(tail: collections.deque) -> str:
    time.sleep(0.05)  # let the pump take the last lines of a process that just ended
    lines = [line for line in list(tail) if line.strip()]
    return f" (its last output: {lines[-1][:200]!r})" if lines else ""


def _bound_io(conn, seconds: float) -> None:
    """Give a control connection's socket a send and a receive timeout: a send to a worker that stopped
    reading, or the rest of a message that never comes, then fails with one of TIMED_OUT instead of blocking
    the client forever (any size of message: a full socket buffer blocks even a small one)."""
    # A socket object over conn's own descriptor (family read from it: AF_UNIX or loopback TCP), detached after,
    # so it never closes what conn still uses.
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, socket_timeout(seconds))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, socket_timeout(seconds))
        send_small_messages_now(sock)
        # A host's socket.setdefaulttimeout() makes the new socket object switch the descriptor to non-blocking;
        # multiprocessing's Connection needs it blocking.
        sock.setblocking(True)
    finally:
        sock.detach()
