"""PipeFusion x Ring: pipeline stages whose patch attention is split over a ring group, on CPU/gloo workers.

As xDiT combines them: each ring member keeps the stale K/V buffer of the rows it owns (its shard of every patch
and its prompt rows), writes the current patch's fresh rows into it, and RingAttention passes the whole buffers
around the ring, so a patch's queries see this step's K/V of the patch from every member and last step's K/V of
the other patches. Warm-up steps are exact, so a run that is all warm-up equals serial; after warm-up it must stay
closer to serial than naive patch parallelism. The bytes the runtime counts equal traffic.py's figure.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_job, rel_err
from test_attention_mask import call_job, make_mask
from test_controlnet import reference_call
from test_pipefusion_lanes import CASES, STEPS, adapter, host_loop  # noqa: F401 - adapter is a fixture
from parallel_runtime.bench.grid import grid
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.planning.traffic import job_traffic, shapes_of
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

# As tests/test_parallel.py: exact strategies change only summation order (~2e-7 measured here); a buffer row in
# the wrong place, a ring block of the wrong length or a bias block cut for the wrong keys is off by 1e-2 or more.
EXACT_RTOL = 1e-4
PP_RING = S(pipefusion_degree=2, ring_degree=2)
# 18 x 14 latent: 63 image tokens, so no patch or ring shard is even (as test_parallel.py's UNEVEN).
UNEVEN = torch.zeros(1, 16, 18, 14)


def warm(strategy: S, steps: int = 8) -> S:
    return dataclasses.replace(strategy, warmup_steps=steps)


@pytest.fixture(scope="module")
def serial(client1, tiny_path):
    return {"square": client1.run(make_job(tiny_path)).latent,
            "uneven": client1.run(make_job(tiny_path, latent=UNEVEN)).latent}


@pytest.mark.parametrize("strategy,latent", [
    (PP_RING, "square"), (dataclasses.replace(PP_RING, num_pipeline_patch=4), "square"),
    (dataclasses.replace(PP_RING, num_pipeline_patch=3), "uneven"),
    (dataclasses.replace(PP_RING, device_weights=(1, 3, 2, 2)), "square"),
], ids=["M2", "M4", "M3_uneven", "weighted"])
def test_all_warmup_equals_serial(client4, tiny_path, serial, strategy, latent):
    job = make_job(tiny_path, warm(strategy), latent=UNEVEN if latent == "uneven" else None)
    err = rel_err(client4.run(job).latent, serial[latent])
    print(f"\n{job.strategy.label()} (all warm-up, {latent}): {err:.2e}")
    assert err <= EXACT_RTOL


def test_stale_steps_are_closer_than_naive_patch(client4, tiny_path, serial):
    stale = rel_err(client4.run(make_job(tiny_path, PP_RING)).latent, serial["square"])
    beside = rel_err(client4.run(make_job(tiny_path, S(pipefusion_degree=2, ulysses_degree=2))).latent,
                     serial["square"])
    naive = rel_err(client4.run(make_job(tiny_path, S(naive_patch_degree=4))).latent, serial["square"])
    print(f"\npp2 x ring2 (1 warm-up step of 8): {stale:.2e}; pp2 x ulysses2: {beside:.2e}; naive4: {naive:.2e}")
    assert stale > EXACT_RTOL  # the stale K/V really was read
    assert stale < naive / 2  # one step of staleness costs far less than never seeing the other patches
    # Ring and Ulysses see the same rows, fresh and stale: only summation order differs.
    assert abs(stale - beside) <= 1e-3 * stale


@pytest.mark.parametrize("case", list(CASES))
def test_two_token_layouts_run_as_two_lanes(client1, client4, tiny_path, case):
    """Prompts of 7 and 11 tokens, or a reference latent on the positive only: each layout its own lane, its own
    ring buffers."""
    ref = client1.run(CASES[case](tiny_path)).latent
    err = rel_err(client4.run(CASES[case](tiny_path, PP_RING, warmup=STEPS)).latent, ref)
    print(f"\n{case}, pp2 x ring2 (all warm-up): {err:.2e}")
    assert err <= EXACT_RTOL


def test_a_masked_model_call_equals_the_reference(client4, tmp_path):
    """ComfyUI's attention_mask (tests/test_attention_mask.py's, which masks keys of one ring member only for some
    queries): the bias blocks are cut for each member's buffer rows."""
    files = {"dit": write_checkpoint(str(tmp_path / "flux.safetensors"), TINY, seed=5)}
    job = call_job(files, PP_RING, make_mask(3))
    err = rel_err(client4.run(job).latent, reference_call(files, job))
    print(f"\nmasked call, pp2 x ring2 (warm-up): {err:.2e}")
    assert err <= EXACT_RTOL


def test_model_calls_keep_each_ring_members_buffers(client1, client4, adapter, tiny_path):  # noqa: F811
    job = make_job(tiny_path, steps=STEPS)
    serial = host_loop(client1, adapter, job, S())
    warm_err = rel_err(host_loop(client4, adapter, job, warm(PP_RING, STEPS)), serial)
    stale = rel_err(host_loop(client4, adapter, job, PP_RING), serial)
    naive = rel_err(host_loop(client4, adapter, job, S(naive_patch_degree=4)), serial)
    print(f"\nper call: pp2 x ring2 all warm-up {warm_err:.2e}, 1 warm-up call {stale:.2e}, naive4 {naive:.2e}")
    assert warm_err <= EXACT_RTOL
    assert EXACT_RTOL < stale < naive / 2


def test_measured_bytes_match_analytic(client4, tiny_path):
    """Per op and rank, exactly: the pipeline's hidden rows and x, and each layer's ring hops of whole buffers."""
    strategy = dataclasses.replace(PP_RING, num_pipeline_patch=4)
    measured = [st["traffic"] for st in client4.run(make_job(tiny_path, strategy, steps=3)).stats]
    shapes = shapes_of(TINY, image_tokens=64, text_tokens=7, pipefusion=2, batch=1)
    analytic = job_traffic(strategy, shapes, steps=3, cfg=2.0)
    assert any(st["by_op"].get("ring") for st in measured)
    for got, want in zip(measured, analytic):
        assert {op: tuple(v) for op, v in got["by_op"].items()} == {op: tuple(v) for op, v in want.by_op().items()}


def test_the_bench_grid_has_a_pipefusion_times_ring_row():
    rows = grid(4, cfg=1.0, heads=24, num_blocks=57, latent_hw=(64, 64))
    assert [s.label() for s, _ in rows if s.pipefusion_degree == 2 and s.ring_degree == 2] == ["pp2xring2xM2w1"]


def test_eight_workers_ring_beside_ulysses_and_cfg(tiny_path, serial):
    """Ulysses inside each ring member (its group's rows gathered per head slice, then the ring of buffers), and
    CFG parallel beside the pipeline: exact in warm-up, and the bytes as traffic.py counts them."""
    client = RuntimeClient("cpu:8", threads_per_worker=1)
    try:
        for strategy in (S(pipefusion_degree=2, ulysses_degree=2, ring_degree=2), dataclasses.replace(PP_RING, cfg_degree=2)):
            err = rel_err(client.run(make_job(tiny_path, warm(strategy))).latent, serial["square"])
            print(f"\n{warm(strategy).label()} (all warm-up): {err:.2e}")
            assert err <= EXACT_RTOL
        strategy = S(pipefusion_degree=2, ulysses_degree=2, ring_degree=2)
        measured = [st["traffic"] for st in client.run(make_job(tiny_path, strategy, steps=3)).stats]
    finally:
        client.shutdown()
    analytic = job_traffic(strategy, shapes_of(TINY, image_tokens=64, text_tokens=7, pipefusion=2, batch=1), steps=3,
                           cfg=2.0)
    for got, want in zip(measured, analytic):
        assert {op: tuple(v) for op, v in got["by_op"].items()} == {op: tuple(v) for op, v in want.by_op().items()}

