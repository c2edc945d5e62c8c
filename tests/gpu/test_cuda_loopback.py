"""The strategies on one GPU, their ranks as threads of this process (tests/loopback.py: the worker's own load and
denoise code, the real Comm over a loopback torch.distributed), each rank on its own CUDA stream.

- Transfers move on side streams behind a sleeping kernel, as NCCL's run on streams of their own: every strategy
  equals the same ranks over transfers without the sleep (a buffer written while in flight, or read before its
  wait ordered the stream, reads the other rank's data late), and the exact ones equal one rank.
- No hidden host-device sync in a step of any strategy, nor in the blocks of a stock sampler's call:
  torch.cuda.set_sync_debug_mode reports every blocking copy, .item() and synchronize the ops make.
- A run of stock-sampler calls makes no new cudaMalloc once warmed up (num_device_alloc stays flat).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
import warnings

import pytest
import torch

from conftest import make_job, rel_err
from loopback import Fabric, LoopbackRanks
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.denoise import Denoiser

pytestmark = pytest.mark.timeout(600)

DEVICE = "cuda:0"
# ~1 ms at an H100's clocks: longer than a tiny block's kernels, so a transfer is still queued on its side stream
# when the compute stream reaches for it.
SLEEP_CYCLES = 2_000_000
STEPS = 3
EXACT_RTOL = 1e-4  # tests/test_parallel.py's: summation order only
# The same kernels on the same rows with and without the sleep: equal, up to cuBLAS choosing another kernel for a
# stream whose workspace differs (fp32 round-off, ~1e-7). A race reads another step's or no data: 1e-2 or NaN.
LATE_RTOL = 1e-6

STRATEGIES = [
    S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
    S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1), S(patch_degree=2, warmup_steps=1),
    S(tensor_degree=2), S(ulysses_degree=2, shard_weights=True),
    S(pipefusion_degree=2, ring_degree=2, num_pipeline_patch=2, warmup_steps=1),
    S(cfg_degree=2, patch_degree=2, warmup_steps=1),
]


def _in(job, weight_dtype: str):
    return dataclasses.replace(job, model=dataclasses.replace(job.model, weight_dtype=weight_dtype))


def _run(job, world: int, sleep_cycles: int = 0) -> torch.Tensor:
    fabric = Fabric(world, device=DEVICE, sleep_cycles=sleep_cycles)
    try:
        with torch.no_grad():
            return LoopbackRanks(fabric, DEVICE).run(job)
    finally:
        fabric.close()


@pytest.fixture(scope="module")
def serial_fp32(tiny_path):
    return _run(_in(make_job(tiny_path, steps=STEPS), "fp32"), 1)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.label())
def test_transfers_on_a_sleeping_side_stream_equal_prompt_ones(gpu, tiny_path, serial_fp32, strategy):
    job = _in(make_job(tiny_path, strategy, steps=STEPS), "fp32")
    prompt, late = _run(job, strategy.world_size), _run(job, strategy.world_size, SLEEP_CYCLES)
    err = rel_err(late, prompt)
    print(f"\n{strategy.label()}: sleeping side stream vs prompt {err:.2e}, vs one rank {rel_err(prompt, serial_fp32):.2e}")
    assert torch.isfinite(late).all() and err <= LATE_RTOL
    if strategy.exact:
        assert rel_err(prompt, serial_fp32) <= EXACT_RTOL


@pytest.mark.parametrize("strategy", [S(batch_degree=2), S(batch_degree=2, ulysses_degree=2)], ids=lambda s: s.label())
def test_batch_groups_on_sleeping_side_streams_equal_serial_per_image(gpu, tiny_path, strategy):
    """Batch parallel on one GPU: 3 images over 2 groups (2 and 1), the result rows gathered over a late side
    stream; every image equals one rank's run of the whole batch (measured on the CPU loopback: 0 to 3.9e-7)."""
    job = _in(dataclasses.replace(make_job(tiny_path, strategy, steps=STEPS), latent=torch.zeros(3, 16, 16, 16)), "fp32")
    serial = _run(dataclasses.replace(job, strategy=S()), 1)
    late = _run(job, strategy.world_size, SLEEP_CYCLES)
    errors = [rel_err(late[k], serial[k]) for k in range(3)]
    print(f"\n{strategy.label()}: per image vs one rank {', '.join(f'{e:.2e}' for e in errors)}")
    assert late.shape == serial.shape and max(errors) <= EXACT_RTOL


CACHE = dict(cache="first_block", cache_threshold=0.65)  # tests/test_step_cache.py's: skips steps 1, 2, 4 of 8


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, **CACHE), S(batch_degree=2, **CACHE),
                                      S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1, **CACHE)],
                         ids=lambda s: s.label())
def test_step_cache_on_sleeping_side_streams_equals_prompt_transfers(gpu, tiny_path, strategy):
    """The step cache's decision (an all-reduce of the change; under PipeFusion a flag sent ahead of the hidden
    rows) read while its transfer is still queued behind a sleeping side stream would skip other steps: the late
    run must equal the prompt one, and the exact strategies the one-rank cached run (on the CPU loopback: Ulysses-2
    2.3e-7 from it; PipeFusion-2 5.9e-2, stage 0 deciding a step late)."""
    images = 2 if strategy.batch_degree > 1 else 1
    job = _in(dataclasses.replace(make_job(tiny_path, strategy, steps=8),
                                  latent=torch.zeros(images, 16, 16, 16)), "fp32")
    prompt, late = _run(job, strategy.world_size), _run(job, strategy.world_size, SLEEP_CYCLES)
    serial = _run(dataclasses.replace(job, strategy=S(**CACHE)), 1)
    print(f"\n{strategy.label()}: late vs prompt {rel_err(late, prompt):.2e}, vs one rank cached {rel_err(prompt, serial):.2e}")
    assert torch.isfinite(late).all() and rel_err(late, prompt) <= LATE_RTOL
    if strategy.exact:
        assert rel_err(prompt, serial) <= EXACT_RTOL


# -- hidden host-device syncs ----------------------------------------------------------------------------------


class HostSyncs:
    """The host-device syncs each rank thread makes inside its watched spans, as torch.cuda's sync debug mode reports
    them ('warn': the mode is one switch for the whole process, and a rank outside its span, uploading a job's
    inputs, may sync while another computes; each report is kept with the thread it came from)."""

    def __init__(self):
        self.local, self.found = threading.local(), []

    @contextlib.contextmanager
    def watching(self):
        self.local.on = True
        try:
            yield
        finally:
            self.local.on = False

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message) and getattr(self.local, "on", False):
            self.found.append(f"{threading.current_thread().name}: {message} at {filename}:{lineno}\n"
                              + "".join(traceback.format_stack(limit=12)))

    @contextlib.contextmanager
    def reporting(self):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self.showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("strategy", [S(), *STRATEGIES], ids=lambda s: s.label())
def test_no_step_of_any_strategy_syncs_the_host_with_the_device(gpu, tiny_path, monkeypatch, strategy):
    """Steps 1 and 2 of a bf16 job (step 0 uploads the job's inputs), without each step's end (_step_done waits
    for the compute stream on purpose, to time the step)."""
    syncs = HostSyncs()
    step_done = Denoiser._step_done

    def watched_step_done(self, i, t0):
        syncs.local.on = False
        step_done(self, i, t0)
        syncs.local.on = i + 1 < len(self.sigmas) - 1  # the next step is watched, if there is one

    monkeypatch.setattr(Denoiser, "_step_done", watched_step_done)
    with syncs.reporting():
        _run(_in(make_job(tiny_path, strategy, steps=STEPS), "bf16"), strategy.world_size)
    assert not syncs.found, f"{len(syncs.found)} host syncs, the first:\n{syncs.found[0]}"


def _calls(tiny_path, strategy, count: int, weight_dtype: str = "bf16") -> list:
    """A stock sampler's run of `count` model calls: [cond chunk; uncond chunk] of one latent, the timestep going
    down (the inputs' values matter little; their shapes and the stale K/V carried between calls do)."""
    base = _in(make_job(tiny_path, strategy, cfg=2.0), weight_dtype)
    g = torch.Generator().manual_seed(0)
    return [dataclasses.replace(base, latent=torch.randn(1, 16, 16, 16, generator=g).repeat(2, 1, 1, 1),
                                timestep=torch.full((2,), 1.0 - k / count), call_step=k, call_last=k == count - 1)
            for k in range(count)]


@pytest.mark.parametrize("strategy", [S(), *STRATEGIES], ids=lambda s: s.label())
def test_no_stock_sampler_call_syncs_the_host_inside_the_model(gpu, tiny_path, strategy):
    """The blocks and the head of a call after a warm-up call (which fills the stale K/V), every rank: the call's
    inputs arrive from the host and its output goes back there, around them."""
    syncs = HostSyncs()
    fabric = Fabric(strategy.world_size, device=DEVICE)
    ranks = LoopbackRanks(fabric, DEVICE)

    @contextlib.contextmanager
    def watch_the_model(rank):
        adapter = ranks.states[rank].adapter

        def watched(fn):
            def call(*args, **kwargs):
                with syncs.watching():
                    return fn(*args, **kwargs)
            return call

        adapter.run_blocks, adapter.head = watched(adapter.run_blocks), watched(adapter.head)
        try:
            yield
        finally:
            del adapter.run_blocks, adapter.head  # the class's again

    try:
        warm_up, call = _calls(tiny_path, strategy, 2)
        with torch.no_grad():
            ranks.run(warm_up)
            with syncs.reporting():
                ranks.run(call, hooks=watch_the_model)
    finally:
        fabric.close()
    assert not syncs.found, f"{len(syncs.found)} host syncs, the first:\n{syncs.found[0]}"


# -- no allocations once warmed up -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [
    S(), S(ulysses_degree=2), S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1),
    S(patch_degree=2, warmup_steps=1),
], ids=lambda s: s.label())
def test_device_allocations_stay_flat_over_20_model_calls(gpu, tiny_path, strategy):
    """After 4 warm-up calls (stale K/V buffers, kernel workspaces, the allocator's pools), 20 more calls of the same
    shapes are served from the caching allocator: no cudaMalloc, so no device-wide sync either (the worker keeps
    its cache between the calls of a run, see WorkerState.end_job)."""
    calls = _calls(tiny_path, strategy, 24)
    fabric = Fabric(strategy.world_size, device=DEVICE)
    ranks = LoopbackRanks(fabric, DEVICE)
    try:
        with torch.no_grad():
            for call in calls[:4]:
                ranks.run(call)
            before = torch.cuda.memory_stats(DEVICE)["num_device_alloc"]
            for call in calls[4:]:
                ranks.run(call)
            after = torch.cuda.memory_stats(DEVICE)["num_device_alloc"]
    finally:
        fabric.close()
    print(f"\n{strategy.label()}: cudaMalloc calls {before} after warm-up, {after} after 20 more calls")
    assert after == before
