"""The runtime where Python has no AF_UNIX and no `resource` module, as Windows' CPython, and torch no libuv, as
Windows' wheels: run here on Linux by hiding them in this process and in the workers' interpreters (a
sitecustomize the workers import first), and where torch has no NCCL (Windows' builds), with the CUDA probes
faked."""
from __future__ import annotations

import os
import socket
import shutil
import struct
import sys
import threading
from multiprocessing.connection import AuthenticationError, Client

import pytest
import torch

from conftest import make_job
from parallel_runtime.errors import Cancelled, ConfigError
from parallel_runtime.runtime import client as client_module
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.distributed.devices import NO_NCCL, runtime_devices
from parallel_runtime.distributed.portability import collective_backend, loopback_interface, peak_rss
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(300)

# Imported by every interpreter started with its folder on PYTHONPATH (site.py does so before any other import):
# the workers then start as Windows' CPython would, without socket.AF_UNIX and without `resource`, and leave a file
# named by their pid saying what they lacked. As the portable build's embedded Python (its ._pth file ignores
# PYTHONPATH and the current directory), the plugin folder is dropped from sys.path too (with PYTHONSAFEPATH=1,
# which keeps the current directory out). TCPStore refuses libuv as a torch built without it does (in its words;
# use_libuv is True unless passed), and each refusal is added to the file.
HIDING_SITECUSTOMIZE = """
import os, socket, sys
import psutil  # first: its Linux half imports resource itself (its Windows half needs none)
sys.path[:] = [p for p in sys.path if os.path.realpath(p) != os.environ["PARADIT_TEST_ROOT"]]
del socket.AF_UNIX
sys.modules["resource"] = None  # `import resource` raises ImportError, as where the module does not exist
try:
    import resource
    lacks = "nothing"
except ImportError:
    lacks = "AF_UNIX resource" if not hasattr(socket, "AF_UNIX") else "resource"
NOTE = os.path.join(os.environ["PARADIT_TEST_HIDDEN"], str(os.getpid()))
with open(NOTE, "w") as f:
    f.write(lacks)

import torch.distributed as dist

def tcp_store_without_libuv(*args, use_libuv=True, _store=dist.TCPStore, **kwargs):
    if use_libuv:
        with open(NOTE, "a") as f:
            f.write(" libuv")
        raise dist.DistStoreError("use_libuv was requested but PyTorch was built without libuv support, run with "
                                  "USE_LIBUV=0 to disable it.")
    return _store(*args, use_libuv=False, **kwargs)

dist.TCPStore = tcp_store_without_libuv
"""

JOB = dict(steps=4)  # the tiny model, 2 ranks: a few steps are enough to cross the channel and the group


@pytest.fixture(scope="module")
def normal_path(tiny_path, client2):
    """The 2-worker job's latent on the normal path (AF_UNIX, resource), on the session's 2 workers (started as this
    module's own would be: cpu:2, 1 thread each)."""
    return client2.run(make_job(tiny_path, S(ulysses_degree=2), **JOB)).latent


@pytest.fixture
def windows_like(tmp_path, monkeypatch):
    """This process and the workers it starts without socket.AF_UNIX and `resource` (the workers without the plugin
    folder on their path too); returns the folder where each worker notes what it lacked."""
    site, hidden = tmp_path / "site", tmp_path / "hidden"
    site.mkdir()
    hidden.mkdir()
    (site / "sitecustomize.py").write_text(HIDING_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))  # the client passes its environment on to the workers
    monkeypatch.setenv("PARADIT_TEST_HIDDEN", str(hidden))
    monkeypatch.setenv("PARADIT_TEST_ROOT", os.path.realpath(client_module._PACKAGE_ROOT))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    monkeypatch.delattr(socket, "AF_UNIX")
    monkeypatch.setitem(sys.modules, "resource", None)
    return hidden


def test_two_workers_run_and_cancel_without_af_unix_resource_or_libuv(tiny_path, normal_path, windows_like):
    client = RuntimeClient("cpu:2", threads_per_worker=1)
    try:
        out = client.run(make_job(tiny_path, S(ulysses_degree=2), **JOB))
        # Loopback TCP, and each worker really started without AF_UNIX and resource, and had its rendezvous store
        # (rank 0's server, rank 1's client) refused libuv once, then made without it.
        host, port = client.control_address
        assert host == "127.0.0.1" and port > 0
        assert {p.name: p.read_text() for p in windows_like.iterdir()} == {
            str(proc.pid): "AF_UNIX resource libuv" for proc in client.procs}
        # The same ranks run the same kernels in the same order: the channel must not change a bit of the result.
        assert torch.equal(out.latent, normal_path)
        # Peak RSS came from psutil: a worker that imported torch holds more than 100 MiB (about 300 here).
        assert all(s["peak_rss_bytes"] > 100 * 2**20 for s in out.stats), [s["peak_rss_bytes"] for s in out.stats]
        # The control sockets got their send and receive timeouts on TCP too (Linux reads them back as a timeval).
        sock = socket.socket(fileno=client.chans[0].conn.fileno())
        try:
            sec, usec = struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        finally:
            sock.detach()
        assert sec + usec / 1e6 == pytest.approx(client.watchdog.heartbeat_timeout_s)
        # ... and TCP_NODELAY: without it Nagle's algorithm and the delayed ACK batched the small messages ~40 ms
        # apart, and the Cancel below landed 3-4 steps after it was asked for (failing 3 runs in 4 here).
        sock = socket.socket(fileno=client.chans[0].conn.fileno())
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            sock.detach()

        # Cancel mid-run: the job stops, the same workers stay and the next job on them is unchanged.
        pids, seen = [p.pid for p in client.procs], []
        with pytest.raises(Cancelled):
            client.run(make_job(tiny_path, S(ulysses_degree=2), steps=40), progress=lambda s, t, i: seen.append(s),
                       interrupted=lambda: len(seen) >= 2)
        assert len(seen) <= 2 + 2, seen  # votes are read one step after they are cast
        assert client.alive and [p.pid for p in client.procs] == pids
        assert torch.equal(client.run(make_job(tiny_path, S(ulysses_degree=2), **JOB)).latent, normal_path)
    finally:
        client.shutdown()
    assert all(proc.poll() is not None for proc in client.procs)


def test_a_workers_tcp_control_channel_sends_small_messages_at_once():
    """The worker's end of a loopback TCP control channel has TCP_NODELAY (its progress reports and vote answers are
    the small messages Nagle's algorithm would hold); an AF_UNIX socket is left as it is."""
    import argparse
    from multiprocessing.connection import Listener

    from parallel_runtime.distributed.portability import send_small_messages_now
    from parallel_runtime.runtime.worker import _control_channel

    key = os.urandom(16)
    with Listener(("127.0.0.1", 0), family="AF_INET", authkey=key) as listener:
        accepted = []
        server = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        server.start()
        args = argparse.Namespace(socket=None, join=None, port=listener.address[1])
        chan = _control_channel(args, key)
        server.join(10)
        try:
            sock = socket.socket(fileno=chan.conn.fileno())
            try:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            finally:
                sock.detach()
        finally:
            chan.conn.close()
            for conn in accepted:
                conn.close()
    if hasattr(socket, "AF_UNIX"):
        a, b = socket.socketpair(socket.AF_UNIX)
        with a, b:
            send_small_messages_now(a)  # no TCP options on a local socket: nothing to set, nothing raised


def test_peak_rss_without_resource_is_psutil_high_water(monkeypatch):
    import psutil

    monkeypatch.setitem(sys.modules, "resource", None)
    first = peak_rss()
    assert first >= psutil.Process().memory_info().rss * 0.9  # RSS moves between the two reads; 10% is plenty
    assert peak_rss() >= first  # a high-water mark never goes down


@pytest.fixture
def cuda_without_nccl(monkeypatch):
    """Two visible GPUs and a torch without NCCL, as Windows' builds (only the probes are faked: nothing starts)."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)


def test_several_gpus_without_nccl_are_refused_in_one_sentence(cuda_without_nccl):
    with pytest.raises(ConfigError) as info:
        RuntimeClient("0,1")  # before any worker starts
    message = str(info.value)
    assert message.count(". ") == 0 and message.endswith(".")
    assert "no NCCL" in message and "devices 0" in message and "cpu:N" in message
    # auto takes the first GPU and says why; one GPU and CPU workers need no NCCL.
    devices, notice = runtime_devices("auto")
    assert devices == ["cuda:0"] and NO_NCCL in notice
    assert runtime_devices("1") == (["cuda:1"], None)
    assert runtime_devices("cpu:2") == (["cpu", "cpu"], None)
    assert collective_backend("cuda") == "gloo" and collective_backend("cpu") == "gloo"


def test_workers_bind_gloo_to_the_loopback_interface(monkeypatch):
    # 'lo' on Linux; found by its address, so Windows' 'Loopback Pseudo-Interface 1' is found the same way.
    assert loopback_interface() == "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert RuntimeClient("cpu:1")._worker_env()["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize("family", ["AF_INET", "AF_UNIX"])
def test_the_control_listener_queues_every_worker_before_it_accepts_one(monkeypatch, family):
    """All 16 workers' connections wait in the queue while accept runs handshakes one at a time. A full queue
    resets the next connection on Windows (which the worker's Client does not retry); on Linux, TCP drops it (the
    connect below times out) and AF_UNIX refuses it (EAGAIN under a timeout), which is what this test sees."""
    if family == "AF_INET":
        monkeypatch.delattr(socket, "AF_UNIX")
    listener, directory = client_module._control_listener(b"k" * 32, 16)
    conns = []
    try:
        for _ in range(16):
            conn = socket.socket(getattr(socket, family))
            conns.append(conn)
            conn.settimeout(0.5)  # a queued connect completes at once on loopback; a refused one takes >= 1 s
            conn.connect(listener.address)
    finally:
        for conn in conns:
            conn.close()
        listener.close()
        if directory:
            shutil.rmtree(directory)


def test_strangers_on_the_control_port_are_dropped_and_the_start_goes_on(monkeypatch):
    """Before the worker connects, one local stranger answers the challenge with a wrong key and another resets
    the connection while the listener waits for its answer: each is dropped unread, and the worker is accepted."""
    monkeypatch.delattr(socket, "AF_UNIX")  # loopback TCP: any local process can connect
    seen, threads = [], []
    make_listener = client_module._control_listener

    def strangers(address):
        try:
            Client(address, family="AF_INET", authkey=b"not the key")
        except AuthenticationError:
            seen.append("wrong key refused")
        with socket.create_connection(address) as sock:
            sock.recv(1)  # the challenge has come: the listener now reads the answer
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a reset
        seen.append("reset")

    def listener_with_strangers(key, world):
        listener, directory = make_listener(key, world)
        threads.append(threading.Thread(target=strangers, args=(listener.address,)))
        threads[0].start()  # the worker needs seconds to import torch: the strangers come first
        return listener, directory

    monkeypatch.setattr(client_module, "_control_listener", listener_with_strangers)
    client = RuntimeClient("cpu:1", threads_per_worker=1)
    try:
        client.start()
        threads[0].join(10)
        assert seen == ["wrong key refused", "reset"]
        assert client.alive and len(client.ping()) == 1
    finally:
        client.shutdown()
