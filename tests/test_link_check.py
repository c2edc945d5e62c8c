"""The startup link check (every pair of workers exchanges a test message before the runtime reports ready), the
/dev/shm check where NCCL goes through it, and the p2p setting (Strategy Selector, environment) that turns GPU
peer-to-peer off in the workers."""
from __future__ import annotations

import os
import time
from collections import namedtuple

import psutil
import pytest
import torch
import torch.distributed as dist

from parallel_runtime.errors import ConfigError, WorkerError
from parallel_runtime.runtime import client as client_module
from parallel_runtime.runtime import links
from parallel_runtime.runtime.client import RuntimeClient, get_client

pytestmark = pytest.mark.timeout(300)


def _one_sentence(message: str) -> bool:
    return message.endswith(".") and ". " not in message


@pytest.mark.parametrize("silent, answering", [(1, 0), (0, 1)])
def test_a_peer_that_never_answers_fails_the_start_in_one_sentence_and_leaves_no_process(monkeypatch, silent,
                                                                                         answering):
    # One rank never joins the check, as behind a link that drops everything; the other waits 2 s, then says so.
    # Its sentence is the error whichever rank is silent (not a generic "did not answer ready" after 120 s).
    monkeypatch.setenv("PARADIT_FAULT", f"link_silent:rank={silent}")
    monkeypatch.setenv("PARADIT_LINK_CHECK_S", "2")
    client = RuntimeClient("cpu:2", threads_per_worker=1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with pytest.raises(WorkerError) as info:
            client.start()
    finally:
        client.shutdown()
    message = str(info.value)
    assert message.startswith(f"at startup, rank {answering} (cpu) got no answer within 2 s in a 64 KiB test exchange")
    assert "loopback TCP (127.0.0.1)" in message and _one_sentence(message)
    # Both workers are gone (the silent one was killed), and the client holds none.
    assert not client.procs
    time.sleep(0.2)  # psutil may still list a child the kill just reaped
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        return True


def test_the_nccl_sentences_name_the_fix(monkeypatch):
    """check_links's sentence on NCCL, with the exchange faked: a link that never completes names
    NCCL_P2P_DISABLE=1 (and, with it already set, /dev/shm's size); one that delivers wrong bytes is broken too."""
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, async_op: _Work(False))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    hang = links.check_links(1, 2, torch.device("cpu"), "nccl", timeout_s=0.1)
    assert "NCCL_P2P_DISABLE=1" in hang and "p2p: off" in hang and "PARADIT_NCCL_P2P=off" in hang
    assert hang.startswith("at startup, rank 1 (cpu) got no answer within 0.1 s") and _one_sentence(hang)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    shm = links.check_links(1, 2, torch.device("cpu"), "nccl", timeout_s=0.1)
    assert "even with NCCL_P2P_DISABLE=1" in shm and "--shm-size=1g or --ipc=host" in shm and _one_sentence(shm)

    def corrupting(out, inp, async_op):
        out.zero_()  # rank 0's chunk to rank 1 would hold 0 * 2 + 1 = 1
        return _Work(True)

    monkeypatch.setattr(dist, "all_to_all_single", corrupting)
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    bad = links.check_links(1, 2, torch.device("cpu"), "nccl", timeout_s=0.1)
    assert "received corrupted data" in bad and "NCCL_P2P_DISABLE=1" in bad


def test_the_exchange_checks_each_senders_chunk(monkeypatch):
    """What arrives equals what every sender must have sent: a faithful all_to_all passes the check."""
    world, rank = 3, 2

    def faithful(out, inp, async_op):
        n = out.numel() // world
        for sender in range(world):  # the chunk `sender` sends to `rank` holds sender * world + rank
            out[sender * n:(sender + 1) * n] = sender * world + rank
        return _Work(True)

    monkeypatch.setattr(dist, "all_to_all_single", faithful)
    assert links.check_links(rank, world, torch.device("cpu"), "gloo", timeout_s=1) is None


StatVfs = namedtuple("StatVfs", "f_bavail f_frsize")


@pytest.fixture
def two_gpus_with_nccl(monkeypatch, tmp_path):
    """Two GPUs that may or may not reach each other, NCCL, and a /dev/shm of a chosen size (only the probes are
    faked: nothing starts)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    state = {"peer": True, "free": 64 * 2**20}  # Docker's default /dev/shm
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: state["peer"])
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: StatVfs(state["free"] // 4096, 4096) if p == "/dev/shm"
                        else real_statvfs(p))
    monkeypatch.setattr(os.path, "isdir", lambda p, real=os.path.isdir: p == "/dev/shm" or real(p))
    return state


def test_a_small_dev_shm_is_refused_where_nccl_goes_through_it(two_gpus_with_nccl, monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("PARADIT_NCCL_P2P", raising=False)
    gpus = ["cuda:0", "cuda:1"]
    assert links.shared_memory_problem(gpus, p2p_off=False) is None  # peer-to-peer: NCCL does not use /dev/shm
    with pytest.raises(ConfigError) as info:
        RuntimeClient("0,1", p2p="off")  # before any worker starts
    message = str(info.value)
    assert message.startswith("/dev/shm has 64 MB free") and "peer-to-peer is off" in message
    assert "--shm-size=1g or --ipc=host" in message and _one_sentence(message)
    two_gpus_with_nccl["peer"] = False  # consumer cards: NCCL goes through /dev/shm on its own
    assert "these GPUs have no peer-to-peer access" in links.shared_memory_problem(gpus, p2p_off=False)
    two_gpus_with_nccl["free"] = 8 * 2**30  # a host's /dev/shm, or --ipc=host
    assert links.shared_memory_problem(gpus, p2p_off=True) is None
    assert links.shared_memory_problem(["cuda:0"], p2p_off=True) is None


def test_p2p_off_reaches_the_workers_from_the_selector_or_the_environment(monkeypatch):
    for var in ("NCCL_P2P_DISABLE", "PARADIT_NCCL_P2P"):
        monkeypatch.delenv(var, raising=False)
    assert "NCCL_P2P_DISABLE" not in RuntimeClient("cpu:2")._worker_env()
    assert RuntimeClient("cpu:2", p2p="off")._worker_env()["NCCL_P2P_DISABLE"] == "1"
    monkeypatch.setenv("PARADIT_NCCL_P2P", "off")
    assert RuntimeClient("cpu:2").p2p == "off"
    assert RuntimeClient("cpu:2")._worker_env()["NCCL_P2P_DISABLE"] == "1"
    monkeypatch.delenv("PARADIT_NCCL_P2P")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")  # the host's own setting is honoured (and passed on as is)
    assert RuntimeClient("cpu:2").p2p == "off"
    with pytest.raises(ConfigError, match=r"^p2p must be one of auto, off, got 'on'\.$"):
        RuntimeClient("cpu:2", p2p="on")


def test_another_p2p_setting_is_another_runtime(monkeypatch):
    """The workers start with the setting, so changing it on the Selector replaces the runtime (nothing started
    here: get_client only builds clients)."""
    for var in ("NCCL_P2P_DISABLE", "PARADIT_NCCL_P2P"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(client_module, "_CLIENTS", {})
    auto = get_client("cpu:1")
    assert get_client("cpu:1", p2p="auto") is auto
    off = get_client("cpu:1", p2p="off")
    assert off is not auto and off.p2p == "off" and list(client_module._CLIENTS.values()) == [off]
