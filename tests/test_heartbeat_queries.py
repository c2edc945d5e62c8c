"""What a worker's heartbeat thread asks of its device about the transfers in flight: on the worker's device, and at
a cost that grows with the transfers launched, not with their square.

No GPU is needed: the device calls the thread makes are recorded in this process (a CUDA device object can be named
without CUDA), and transfers are fakes that count how often they are asked whether they completed.
"""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from parallel_runtime.runtime.comm import InFlight, Transfer
from parallel_runtime.runtime.watchdog import Heartbeat

pytestmark = pytest.mark.timeout(60)


def test_the_heartbeat_thread_sets_the_workers_device_before_asking_it_anything(monkeypatch):
    """A new thread starts on CUDA device 0 whatever the main thread set: a rank-1 worker whose heartbeat queried
    an event or an NCCL work from there made a CUDA context on GPU 0 (about 534 MiB per worker)."""
    calls: list[tuple] = []
    beaten = threading.Event()
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append(("set_device", torch.device(device), threading.current_thread().name)))

    class AskedInFlight:  # what the thread asks the device: whether it waits on a transfer
        def blocking(self):
            calls.append(("query", None, threading.current_thread().name))
            return None

    def send(kind, meta):
        calls.append(("beat", None, threading.current_thread().name))
        beaten.set()

    pulse = Heartbeat(send, 1, interval_s=0.01, device=torch.device("cuda:1"))
    pulse.start_job()
    pulse.phase, pulse.traffic = "sampling", types.SimpleNamespace(calls=0, in_flight=AskedInFlight())
    try:
        assert beaten.wait(10.0)
    finally:
        pulse.traffic = None  # end_job prunes the traffic's transfers; this fake has none
        pulse.end_job()
    assert calls[:3] == [("set_device", torch.device("cuda:1"), "paradit-heartbeat"),
                         ("query", None, "paradit-heartbeat"), ("beat", None, "paradit-heartbeat")], calls
    assert [c for c in calls if c[0] == "set_device"] == [calls[0]]  # once, when the thread starts


def test_a_cpu_workers_heartbeat_sets_no_cuda_device(monkeypatch):
    calls: list = []
    beaten = threading.Event()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    pulse = Heartbeat(lambda kind, meta: beaten.set(), 0, interval_s=0.01, device=torch.device("cpu"))
    pulse.start_job()
    try:
        assert beaten.wait(10.0)
    finally:
        pulse.end_job()
    assert calls == []
