"""A hung worker never hangs the client: frozen processes, stuck collectives, Cancel that escalates,
out-of-memory attribution, and the next job running on fresh (or kept) workers."""
from __future__ import annotations

import os
import signal
import socket
import struct
import time
from multiprocessing import Pipe

import psutil
import pytest

from conftest import make_job
from parallel_runtime.runtime.client import RuntimeClient, _bound_io, describe_exit
from parallel_runtime.errors import Cancelled, OutOfMemory, WorkerError
from parallel_runtime.runtime.protocol import encode
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.runtime.watchdog import WatchdogConfig

pytestmark = pytest.mark.timeout(240)

# Short bounds so the tests are quick; production defaults are 20 s (heartbeat) and 60 s (step grace).
FAST = WatchdogConfig(heartbeat_s=0.2, heartbeat_timeout_s=3.0, step_grace_s=4.0, cancel_grace_s=2.0)
# How late a detection may come on top of its bound: the client polls every 0.1 s, the kill and the
# error path take well under a second; 2 shared CPU cores running 2 workers add scheduling delay.
SLACK_S = 3.0


def _client(watchdog=FAST) -> RuntimeClient:
    return RuntimeClient("cpu:2", threads_per_worker=1, watchdog=watchdog)


@pytest.fixture(scope="module")
def fast(tiny_path):
    """One FAST client for the tests that inject no fault through the environment (PARADIT_FAULT is read when a
    worker starts, so those tests start their own): each test finds it with live workers, or none if the previous
    test's ended theirs, and a test that kills or freezes them makes the client start new ones, as before. Starting
    2 workers costs ~8 s on 2 shared cores; most of these tests started them anew only to run a first job."""
    client = _client()
    yield client
    client.shutdown()


def _pids(client):
    return [p.pid for p in client.procs]


def _freeze(pid: int) -> None:
    """SIGSTOP, and wait until the kernel has really stopped the process: on a loaded machine a thread that
    is already running can still answer a message for a moment after kill() returns."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def _gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_frozen_worker_fails_the_job_within_the_heartbeat_bound_and_the_next_job_runs(tiny_path, fast):
    client = fast
    client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))  # load, so the stop lands mid-sampling
    old = _pids(client)
    stopped = []

    def progress(step, total, info):
        if not stopped:
            _freeze(old[1])
            stopped.append(time.monotonic())

    with pytest.raises(WorkerError, match=r"worker 1 \(cpu\) stopped responding: no heartbeat .*restarted"):
        client.run(make_job(tiny_path, S(ulysses_degree=2), steps=30), progress=progress)
    waited = time.monotonic() - stopped[0]
    assert waited <= FAST.heartbeat_timeout_s + SLACK_S, waited
    assert _gone(old)  # SIGKILL ends a stopped process too: nothing is left behind
    out = client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))
    assert out.latent.shape == (1, 16, 16, 16) and set(_pids(client)).isdisjoint(old)


def test_a_stuck_collective_fails_within_the_step_bound_naming_the_rank_that_never_arrived(tiny_path, monkeypatch):
    monkeypatch.setenv("PARADIT_FAULT", "stall:rank=1:step=2")  # rank 1 hangs, heartbeat alive; rank 0 waits
    client = _client()
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"step 3 made no progress .*rank 1 \(cpu\) in worker\.py.* never "
                                              r"reached the collective that rank\(s\) 0 wait in"):
            client.run(make_job(tiny_path, S(ulysses_degree=2), steps=8))
        assert time.monotonic() - t0 <= 30 + FAST.step_grace_s  # start + load + 2 steps, then the bound
        monkeypatch.delenv("PARADIT_FAULT")
        assert client.run(make_job(tiny_path, S(ring_degree=2), steps=2)).latent.isfinite().all()
    finally:
        client.shutdown()


def test_cancel_during_a_stuck_collective_returns_within_the_cancel_bound(tiny_path, monkeypatch):
    monkeypatch.setenv("PARADIT_FAULT", "stall:rank=1:step=2")
    patient = WatchdogConfig(heartbeat_s=0.2, heartbeat_timeout_s=3.0, step_grace_s=120.0, cancel_grace_s=2.0)
    client = _client(patient)
    try:
        pressed = []

        def interrupted():
            # Cancel once the stall has surely begun (rank 0 waits in step 3's first all-to-all).
            if client.last_sec_per_step is not None and not pressed:
                time.sleep(1.0)
                pressed.append(time.monotonic())
            return bool(pressed)

        with pytest.raises(Cancelled, match=r"did not stop within .* killed"):
            client.run(make_job(tiny_path, S(ulysses_degree=2), steps=8), interrupted=interrupted)
        # The cancel bound is the grace plus two expected steps (the vote is read one step later).
        waited = time.monotonic() - pressed[0]
        assert waited <= patient.cancel_grace_s + 2 * 1.0 + SLACK_S, waited
        monkeypatch.delenv("PARADIT_FAULT")
        assert client.run(make_job(tiny_path, S(cfg_degree=2), steps=2)).latent.isfinite().all()
    finally:
        client.shutdown()


def test_a_frozen_idle_worker_is_replaced_before_the_next_job(tiny_path, fast):
    client = fast
    client.run(make_job(tiny_path, S(cfg_degree=2), steps=1, size=8))
    old = _pids(client)
    _freeze(old[0])
    out = client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))  # ping finds it, restarts, runs
    assert out.latent.isfinite().all() and set(_pids(client)).isdisjoint(old) and _gone(old)


def test_a_send_to_a_worker_that_stopped_reading_fails_within_the_heartbeat_bound(tiny_path, fast):
    client = fast
    client.start()
    old = _pids(client)
    _freeze(old[1])
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^worker 1 \(cpu\) stopped responding: it did not take a message within "
                                          r"3 s .*restarted"):
        for _ in range(100_000):  # small messages: each one fits, until the frozen reader's buffer is full
            client._send_all(encode("cancel"), ranks=[1])
    waited = time.monotonic() - t0
    assert waited <= FAST.heartbeat_timeout_s + SLACK_S, waited
    assert _gone(old)


def test_control_sockets_time_out_on_a_message_cut_short_and_stay_blocking():
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)  # a host may set one; the connection must not turn non-blocking
    try:
        ours, worker = Pipe()
        _bound_io(ours, 0.5)
    finally:
        socket.setdefaulttimeout(previous)
    try:
        assert os.get_blocking(ours.fileno())
        os.write(worker.fileno(), struct.pack("!i", 100) + b"x" * 10)  # a header, and only part of the body
        t0 = time.monotonic()
        with pytest.raises(BlockingIOError):
            ours.recv_bytes()
        assert time.monotonic() - t0 < 0.5 + SLACK_S
    finally:
        ours.close()
        worker.close()


def test_a_client_stalled_past_the_heartbeat_bound_keeps_its_healthy_workers(tiny_path, fast):
    client = fast
    client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))
    pids = _pids(client)
    stalled = []

    def progress(step, total, info):
        if not stalled:  # e.g. the host paused by a long GC: the workers' beats wait unread in the sockets
            stalled.append(step)
            time.sleep(FAST.heartbeat_timeout_s + 1.5)

    out = client.run(make_job(tiny_path, S(ulysses_degree=2), steps=30), progress=progress)
    assert stalled and out.latent.isfinite().all() and _pids(client) == pids


def test_a_worker_that_dies_while_starting_is_named_with_its_exit(tiny_path, monkeypatch):
    monkeypatch.setenv("PARADIT_FAULT", "die_starting:rank=1")
    client = _client()
    try:
        with pytest.raises(WorkerError, match=r"^worker 1 \(cpu\) exited with code 3 while starting \(its last "
                                              r"output: 'injected: dying before hello'\)"):
            client.start()
        assert not client.procs
    finally:
        client.shutdown()


def test_a_failure_in_the_workers_control_thread_ends_it_instead_of_leaving_it_deaf(tiny_path, monkeypatch):
    monkeypatch.setenv("PARADIT_FAULT", "ping_fails:rank=1")
    client = _client()
    try:
        client.start()
        old = _pids(client)
        with pytest.raises(WorkerError, match=r"^worker 1 \(cpu\) exited with code 1 .*RuntimeError: injected: the "
                                              r"memory report failed"):
            client.ping()
        assert _gone(old)
    finally:
        client.shutdown()


def test_out_of_memory_while_loading_names_the_rank_and_keeps_the_workers(tiny_path, monkeypatch):
    monkeypatch.setenv("PARADIT_FAULT", "oom_load:rank=1")
    client = _client()
    try:
        client.start()
        pids = _pids(client)
        with pytest.raises(OutOfMemory, match=r"^rank 1 \(cpu\) ran out of memory while loading the model.*"
                                              r"pipefusion_degree"):
            client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))
        # No rank entered a collective, so the process group is intact: same workers, still alive.
        assert _pids(client) == pids and client.alive
        status = client.status()
        assert all(w["alive"] for w in status["workers"])
    finally:
        client.shutdown()


def test_exit_codes_are_described_in_words_a_user_can_act_on():
    assert "OOM killer" in describe_exit(-signal.SIGKILL)
    assert "NCCL's watchdog" in describe_exit(-signal.SIGABRT)
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(None) == "stopped answering"


def test_workers_do_not_inherit_the_hosts_allocator_settings(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # what ComfyUI sets for itself
    env = RuntimeClient("cpu:1")._worker_env()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)
    monkeypatch.setenv("PARADIT_WORKER_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert RuntimeClient("cpu:1")._worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_watchdog_settings_come_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("PARADIT_STEP_GRACE_S", "90")
    assert WatchdogConfig.from_env().step_grace_s == 90.0
    assert WatchdogConfig.from_env().step_grace_s <= 90 and WatchdogConfig().step_grace_s <= 60
    monkeypatch.setenv("PARADIT_STEP_GRACE_S", "nan")
    with pytest.raises(ValueError, match="PARADIT_STEP_GRACE_S='nan' must be a positive number"):
        WatchdogConfig.from_env()


def test_a_job_leaves_no_per_job_state_referenced_on_the_worker():
    """PipeFusion's stale K/V hangs off the attention strategy the processors point at: end_job drops it."""
    import torch

    from parallel_runtime.strategies.attention import LocalAttention
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.strategies.pipefusion import StaleKVAttention, StaleKVCache
    from parallel_runtime.runtime.worker import WorkerState

    state = WorkerState(0, 1, torch.device("cpu"))
    cache = StaleKVCache(16)
    cache.update(0, torch.arange(4), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))
    state.context = AttentionContext(StaleKVAttention(cache, LocalAttention()))
    state.end_job()
    assert isinstance(state.context.attention, LocalAttention)
    import sys

    assert sys.getrefcount(cache) == 2  # only this test's own name (and getrefcount's argument) hold it


def test_a_cancel_not_honoured_while_loading_says_loading_not_a_stuck_collective():
    from parallel_runtime.runtime.watchdog import JobWatch

    watch = JobWatch(WatchdogConfig(cancel_grace_s=1.0), ["cuda:0", "cuda:1"], None)
    watch.heard(0, "loaded", {})
    # Rank 1 is in an import under torch/distributed: its stack looks like waiting, but nothing is collective yet.
    watch.heard(1, "heartbeat", {"phase": "loading", "where": "flux.py:120 load_flux", "waiting": True})
    watch.cancel_at = time.monotonic() - 2.0
    problem = watch.check({0, 1})
    assert isinstance(problem, Cancelled)
    assert ("rank 0 (cuda:0) loaded, waiting for the others, rank 1 (cuda:1) loading the model in flux.py:120"
            in str(problem)) and "collective" not in str(problem)


def test_an_error_inside_the_clients_loop_mid_job_replaces_the_workers(tiny_path, monkeypatch, fast):
    from parallel_runtime.runtime.watchdog import JobWatch

    client = fast
    client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))
    old = _pids(client)
    heard = JobWatch.heard

    def broken(self, rank, kind, meta):
        if kind == "progress":
            raise RuntimeError("a bug in the client's loop")
        return heard(self, rank, kind, meta)

    monkeypatch.setattr(JobWatch, "heard", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        client.run(make_job(tiny_path, S(ulysses_degree=2), steps=6))
    # The workers were still in that job: their late messages must not be read as the next job's.
    assert not client.procs and _gone(old)
    monkeypatch.setattr(JobWatch, "heard", heard)
    assert client.run(make_job(tiny_path, S(ring_degree=2), steps=2)).latent.isfinite().all()


def test_when_every_rank_waits_the_one_that_launched_fewer_transfers_is_named():
    """NCCL's host side launches collectives and waits later, so every stack reads "waiting": the
    heartbeats' launch counts tell which rank its peers' collective is missing."""
    from parallel_runtime.runtime.watchdog import JobWatch

    def stuck(launched):
        watch = JobWatch(WatchdogConfig(step_grace_s=1.0), ["cuda:0", "cuda:1"], None)
        watch.started_sampling()
        for rank, n in enumerate(launched):
            watch.heard(rank, "heartbeat", {"phase": "sampling", "where": "comm.py:159 all_to_all", "waiting": True,
                                           "launched": n})
            watch.ranks[rank].progressed = time.monotonic() - 5.0
        return str(watch.check({0, 1}))

    assert "rank 1 (cuda:1) launched 40 of the 42 transfers its peers launched" in stuck([42, 40])
    assert "every rank waits in a collective" in stuck([42, 42]) and "stuck communicator" in stuck([42, 42])
    assert "every rank waits in a collective" in stuck([None, 40])  # a worker from before the counts


def test_heartbeats_carry_the_ranks_launch_count(tiny_path, monkeypatch, fast):
    from parallel_runtime.runtime.watchdog import JobWatch

    counts: dict[int, list[int]] = {0: [], 1: []}
    heard = JobWatch.heard

    def record(self, rank, kind, meta):
        if kind == "heartbeat" and meta.get("launched") is not None:
            counts[rank].append(meta["launched"])
        return heard(self, rank, kind, meta)

    monkeypatch.setattr(JobWatch, "heard", record)
    fast.run(make_job(tiny_path, S(ulysses_degree=2), steps=20, size=32))
    # Ulysses launches all_to_alls every block of every step: each rank's count only goes up, beat by beat.
    assert all(c and c == sorted(c) and c[-1] > 0 for c in counts.values()), counts


def test_releasing_a_frozen_worker_stops_the_workers_instead_of_hanging(tiny_path, fast):
    client = fast
    client.run(make_job(tiny_path, S(cfg_degree=2), steps=1, size=8))
    old = _pids(client)
    _freeze(old[1])
    t0 = time.monotonic()
    client.release()  # what ComfyUI's "free model memory" asks for
    assert time.monotonic() - t0 <= FAST.heartbeat_timeout_s + SLACK_S
    assert not client.procs and _gone(old)  # the memory is free either way
    assert client.run(make_job(tiny_path, S(cfg_degree=2), steps=1, size=8)).latent.isfinite().all()


def test_a_worker_killed_mid_sampling_is_named_rather_than_the_peer_whose_collective_broke(tiny_path, fast):
    client = fast
    client.run(make_job(tiny_path, S(ulysses_degree=2), steps=2))
    old = _pids(client)
    killed = []

    def progress(step, total, info):
        if not killed:
            # Hold rank 0 while rank 1 beats on unread, so rank 1's end of stream queues behind those beats
            # and rank 0's "connection closed" error is read first; then kill rank 1 as the OOM killer would.
            _freeze(old[0])
            time.sleep(1.0)
            os.kill(old[1], signal.SIGKILL)
            os.kill(old[0], signal.SIGCONT)
            killed.append(step)
            time.sleep(1.0)

    with pytest.raises(WorkerError, match=r"^worker 1 \(cpu\) was killed \(SIGKILL"):
        client.run(make_job(tiny_path, S(ulysses_degree=2), steps=30), progress=progress)
    assert _gone(old)
