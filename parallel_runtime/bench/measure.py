"""Measuring a run: step times after warm-up, peak RSS, cores actually available, error against serial. Shared
by the bench, the demo and the soak."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading

import torch

from ..spec import StrategySpec


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def skip_steps(strategy: StrategySpec) -> int:
    """Steps left out of the per-step median: step 0 (first-call costs), and for PipeFusion its synchronous
    warm-up steps plus the step that fills the pipeline (displaced patch: its synchronous warm-up steps)."""
    if strategy.pipefusion_degree > 1:
        return strategy.warmup_steps + 1
    return max(1, strategy.warmup_steps) if strategy.patch_degree > 1 else 1


def step_seconds(stats: list[dict], skip: int, key: str = "step_times") -> float:
    """The slowest rank's median step time over the steps after `skip` (all steps if too few); key "step_cpu": the
    busiest rank's median CPU seconds per step."""
    meds = []
    for st in stats:
        times = st.get(key) or []  # a job whose runner reports no steps (a model call) has no CPU marks
        if times:
            meds.append(statistics.median(times[skip:] if len(times) > skip else times))
    return max(meds, default=0.0)


class RssSampler:
    """Polls the workers' RSS with psutil while a job runs; keeps each rank's maximum."""

    def __init__(self, client, period: float = 0.02):
        import psutil

        self.procs = [psutil.Process(p.pid) for p in client.procs]
        self.peak = [0] * len(self.procs)
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> list[int]:
        out = []
        for p in self.procs:
            try:
                out.append(p.memory_info().rss)
            except Exception:  # noqa: BLE001 - an exited worker has no RSS
                out.append(0)
        return out

    def _run(self):
        while not self._stop.is_set():
            self.peak = [max(a, b) for a, b in zip(self.peak, self.rss())]
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


_CAPACITY_PROBE = r"""
import time
import numpy as np
a = np.random.rand(384, 384).astype(np.float32)
a @ a
t0 = time.perf_counter()
for _ in range(300):
    a @ a
print(time.perf_counter() - t0)
"""


def cpu_capacity(n: int) -> float:
    """How many cores `n` concurrent single-threaded FP-bound processes get right now (n = ideal).

    Shared VMs can hand two vCPUs a single physical core for seconds at a time; the speed-ups measured
    meanwhile are bounded by this figure, so it is printed next to them.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def launch(k: int) -> list[float]:
        procs = [subprocess.Popen([sys.executable, "-c", _CAPACITY_PROBE], stdout=subprocess.PIPE, env=env)
                 for _ in range(k)]
        try:
            return [float(p.communicate(timeout=60)[0]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    try:
        solo = launch(1)[0]
        together = launch(n)
    except (ValueError, OSError, subprocess.SubprocessError):
        return float("nan")
    return n * solo / max(together)
