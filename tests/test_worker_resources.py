"""How a worker uses its device's allocator, its CPU threads and its host-to-device copies: the habits that cost
nothing on CPU workers and time on every GPU call, checked here without a GPU.

- The caching allocator's blocks are returned to the device once a run is over, after a failure and on a model
  release, never between the calls of a stock sampler's run (each empty_cache is a device-wide sync, and the next
  call's cudaMallocs start over).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_job
from parallel_runtime.runtime.worker import WorkerState
from parallel_runtime.spec import StrategySpec as S


# -- the allocator's cache -------------------------------------------------------------------------------------


def ksampler_calls(steps: int, strategy: S) -> list:
    """The jobs of a stock KSampler's run of `steps` model calls (one job per call; the last one says so)."""
    call = dataclasses.replace(make_job("unused.safetensors", strategy), timestep=torch.tensor([0.5]))
    return [dataclasses.replace(call, call_step=i, call_last=i == steps - 1) for i in range(steps)]


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(pipefusion_degree=2)], ids=lambda s: s.label())
def test_a_stock_sampler_run_empties_the_cache_once_not_per_call(monkeypatch, strategy):
    """A CUDA worker's state (no model: end_job's bookkeeping only) ends the jobs of KSampler runs of 4 and 12 calls:
    one empty_cache per run, at its last call, whatever its length; a failed job empties it too (an out-of-memory
    error leaves cached blocks no tensor uses)."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    state = WorkerState(0, 2, torch.device("cuda", 0))
    counts = []
    for steps in (4, 12):
        emptied.clear()
        for job in ksampler_calls(steps, strategy):
            state.end_job(job)
        counts.append(len(emptied))
    assert counts == [1, 1]
    emptied.clear()
    state.end_job(make_job("unused.safetensors", strategy))  # a Parallel Sampler job: the whole run in one job
    state.end_job(None)  # a failure
    assert len(emptied) == 2
