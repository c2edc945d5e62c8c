"""Every strategy over a comm whose transfers land late equals the same strategy over a synchronous comm.

The ranks of a job run as threads of this process (tests/loopback.py: the worker's own load and denoise code, the
real Comm over a loopback torch.distributed). Over the immediate fabric every transfer lands as its last member
posts it; over the delayed one an asynchronous transfer lands 10 ms later, behind the strategy's back, as NCCL's
land on their own stream. A strategy that writes a buffer still being sent, reads one before waiting for it, or
reuses a receive buffer in flight computes something else once its transfers are late. The CUDA twin
(tests/gpu/test_cuda_loopback.py) puts the transfers on a side stream behind a sleeping kernel instead.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_job, rel_err
from loopback import Fabric, LoopbackRanks, loopback_comm, on_ranks
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(300)

DELAY_S = 0.01  # a tiny-model block computes in ~1 ms on this CPU: every transfer is still on the wire when awaited
STEPS = 3
EXACT_RTOL = 1e-4  # tests/test_parallel.py's bound for exact strategies against serial (summation order only)
# 18 x 14 latent, batch 2: 63 image tokens per row of the batch, which no degree splits evenly (uneven all-to-alls).
UNEVEN = torch.zeros(2, 16, 18, 14)


@pytest.fixture(autouse=True)
def _one_thread(one_thread_per_rank):  # conftest's: the ranks are threads already; 2 cores
    yield


def _run(job, world: int, delay_s: float = 0.0) -> tuple[torch.Tensor, Fabric]:
    fabric = Fabric(world, delay_s=delay_s)
    try:
        return LoopbackRanks(fabric).run(job), fabric
    finally:
        fabric.close()


@pytest.fixture(scope="module")
def serial_jobs(tiny_path):
    """One rank's result for the two latents the strategies below run on."""
    with torch.no_grad():
        return {name: _run(make_job(tiny_path, steps=STEPS, latent=latent), 1)[0]
                for name, latent in (("even", None), ("uneven", UNEVEN))}


# -- the fabric itself: a late transfer exposes what a synchronous one hides ---------------------------------------


def _two_ranks(fn, delay_s: float) -> list:
    topology = Topology(ulysses=2)
    fabric = Fabric(2, delay_s=delay_s)
    try:
        return on_ranks(fabric, lambda r: fn(loopback_comm(fabric, topology, r, "cpu"), r))
    finally:
        fabric.close()


def test_a_late_transfer_shows_an_input_written_in_flight_and_an_output_read_before_its_wait():
    """The fabric's own check: a toy with both bugs computes the wrong thing over the delayed fabric, every time,
    and its corrected twin the right one (over a synchronous comm the bugs show only when the peer posts late)."""
    def exchange(comm, rank, racy: bool):
        group = comm.group("ulysses")
        mine = torch.full((4,), float(rank))
        work, parts = comm.all_gather_async(mine, group)
        if racy:
            mine.add_(10)  # the input changes before the gather has read it
        work.wait()
        received = torch.zeros(4)
        works = comm.ring_exchange(torch.full((4,), 100.0 + rank), received, group)
        early = received.clone() if racy else None  # read before the wait
        for w in works:
            w.wait()
        return torch.cat(parts), (early if racy else received.clone()), received

    racy = _two_ranks(lambda comm, r: exchange(comm, r, True), DELAY_S)
    right = _two_ranks(lambda comm, r: exchange(comm, r, False), DELAY_S)
    for rank in (0, 1):
        assert torch.equal(racy[rank][0], torch.tensor([10.0] * 4 + [11.0] * 4))  # read after the write
        assert torch.equal(racy[rank][1], torch.zeros(4))  # not there yet
        assert torch.equal(right[rank][0], torch.tensor([0.0] * 4 + [1.0] * 4))
        assert torch.equal(right[rank][1], torch.full((4,), 100.0 + (1 - rank)))
        assert torch.equal(racy[rank][2], right[rank][2])  # after the wait it is there


# -- every strategy ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy,latent", [
    (S(cfg_degree=2), "even"), (S(ulysses_degree=2), "uneven"), (S(ring_degree=2), "uneven"),
    (S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1), "even"),
    (S(patch_degree=2, warmup_steps=1), "uneven"), (S(tensor_degree=2), "even"),
    (S(ulysses_degree=2, shard_weights=True), "even"), (S(ring_degree=2, shard_weights=True), "uneven"),
    (S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2, warmup_steps=1), "even"),
    (S(pipefusion_degree=2, ring_degree=2, num_pipeline_patch=3, warmup_steps=1), "uneven"),
    (S(cfg_degree=2, patch_degree=2, warmup_steps=1), "even"), (S(patch_degree=2, tensor_degree=2, warmup_steps=1), "even"),
    (S(cfg_degree=2, pipefusion_degree=2, warmup_steps=1), "even"),
], ids=lambda v: v.label() if isinstance(v, S) else v)
def test_every_strategy_equals_a_synchronous_comm_when_transfers_land_late(tiny_path, serial_jobs, strategy, latent):
    job = make_job(tiny_path, strategy, steps=STEPS, latent=UNEVEN if latent == "uneven" else None)
    with torch.no_grad():
        now, _ = _run(job, strategy.world_size)
        late, fabric = _run(job, strategy.world_size, DELAY_S)
    assert fabric.in_flight_waits > 0  # the strategy did reach for transfers still on the wire
    # Same kernels on the same rows in the same order: bit for bit, unless a transfer read or wrote out of turn.
    assert torch.equal(late, now), rel_err(late, now)
    if strategy.exact:  # and the loopback ranks really compute the strategy
        assert rel_err(now, serial_jobs[latent]) <= EXACT_RTOL
    else:  # one warm-up step, then stale K/V: approximate by design, but not far
        assert EXACT_RTOL < rel_err(now, serial_jobs[latent]) < 0.1


@pytest.mark.parametrize("strategy", [
    S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1), S(patch_degree=2, warmup_steps=1),
    S(cfg_degree=2, ulysses_degree=2),
], ids=lambda s: s.label())
def test_stock_sampler_calls_keeping_stale_kv_equal_a_synchronous_comm(tiny_path, strategy):
    """A stock sampler's calls: each is a job, the stale K/V of one call is read by the next (displaced patch's
    exchange of the last call lands at its end, PipeFusion's buffers stay on their stages)."""
    base = make_job(tiny_path, strategy, cfg=2.0)
    g = torch.Generator().manual_seed(0)
    calls = []
    for step, t in enumerate((0.9, 0.7, 0.4)):
        x_in = torch.randn(1, 16, 16, 16, generator=g).repeat(2, 1, 1, 1)  # [cond chunk; uncond chunk]
        calls.append(dataclasses.replace(base, latent=x_in, timestep=torch.full((2,), t), call_step=step,
                                         call_last=step == 2))
    outputs = {}
    for delay in (0.0, DELAY_S):
        fabric = Fabric(strategy.world_size, delay_s=delay)
        try:
            ranks = LoopbackRanks(fabric)
            with torch.no_grad():
                outputs[delay] = [ranks.run(call) for call in calls]
        finally:
            fabric.close()
    for step, (now, late) in enumerate(zip(outputs[0.0], outputs[DELAY_S])):
        assert now.shape == (2, 16, 16, 16) and torch.isfinite(now).all()
        assert torch.equal(late, now), (step, rel_err(late, now))
