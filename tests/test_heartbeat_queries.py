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

from parallel_runtime.distributed.comm import InFlight, Transfer
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


class _Work:
    """A transfer's work that counts how often it is asked whether it completed."""

    asked = 0

    def __init__(self):
        self.completed = False

    def is_completed(self) -> bool:
        _Work.asked += 1
        return self.completed


def test_keeping_n_transfers_in_flight_asks_about_them_o_n_times(monkeypatch):
    """A host ahead of its device launches a step's transfers before any completes (Ulysses on Flux: ~230 per step).
    Sweeping the whole list on every launch asked n (n - 1) / 2 questions (79,800 at n = 400); now one per launch,
    and one per transfer in each sweep of the heartbeat or the job's end."""
    monkeypatch.setattr(_Work, "asked", 0)
    n = 400
    in_flight = InFlight()
    works = [_Work() for _ in range(n)]
    for work in works:
        in_flight.add(Transfer("all_to_all", (1,), work, torch.device("cpu")))
    assert _Work.asked == n - 1  # the head, once per add after the first
    assert len(in_flight) == n
    for work in works[1:]:  # the device catches up on all but the oldest (say an isend still in flight)
        work.completed = True
    asked = _Work.asked
    in_flight.add(Transfer("all_to_all", (1,), _Work(), torch.device("cpu")))
    assert _Work.asked == asked + 1 and len(in_flight) == n + 1  # the head is still in flight: nothing goes
    assert in_flight.blocking() is None  # CPU transfers never waited on: none blocks
    assert len(in_flight) == 2  # the heartbeat's sweep let go of the n - 1 completed ones behind the head
    works[0].completed = True
    in_flight.prune()
    assert len(in_flight) == 1  # the job's end: only the last one, not completed, stays
