"""Memory over many mixed jobs on one runtime (the CI-sized `python -m parallel_runtime soak`), and the
process-group pool that lets strategies switch without rebuilding groups."""
from __future__ import annotations

from datetime import timedelta

import pytest

from parallel_runtime.distributed.comm import Comm, GroupPool
from parallel_runtime.soak import TARGET_MIB_PER_1000_JOBS, run_soak, soak_strategies
from parallel_runtime.distributed.topology import Topology

pytestmark = pytest.mark.timeout(300)

JOBS = 240  # 40 rounds of cpu:2's 6 strategies; ~20 s of jobs on 2 shared cores
# The target is +20 MiB per worker per 1,000 mixed jobs. Growth is not linear: a healthy runtime grows
# ~3 MiB over its first ~200 jobs after warm-up while the allocator's arenas settle, then ~0.3 MiB per
# 100 jobs (1,000 jobs: +6 MiB). So the bound is the target's share of these jobs plus that settling:
# 20 * 240 / 1000 + 4 = 8.8 MiB. The leak this guards against (each strategy switch that reloaded the
# model left the old model alive until a full GC) grew ~0.9 MiB per job: +90 MiB per 100 jobs.
SETTLING_MIB = 4.0
BOUND_MIB = TARGET_MIB_PER_1000_JOBS * JOBS / 1000 + SETTLING_MIB


def test_mixed_jobs_keep_worker_memory_flat():
    record = run_soak("cpu:2", jobs=JOBS, size=8, steps=3, say=print)
    # cfg2, ulysses2, ring2, pp2 (M2, M4), displaced patch2, naive2: every topology of 2 on one model slicing
    assert len(record["strategies"]) == 7
    growth_mib = [g / 2**20 for g in record["worker_growth_bytes"]]
    assert max(growth_mib) <= BOUND_MIB, f"worker RSS grew {growth_mib} MiB over {JOBS} mixed jobs"
    assert len(record["samples"]) == 11  # after warm-up, then every 10%


TIMEOUT = timedelta(seconds=300)


class FakeDist:
    """new_group / destroy_process_group bookkeeping without processes (a pool's decisions are local)."""

    NON_MEMBER = object()

    def __init__(self, rank: int):
        self.rank, self.made, self.destroyed = rank, [], []

    def new_group(self, ranks, timeout, backend=None):
        assert timeout == TIMEOUT  # every group bounds its collectives as configured
        self.made.append((tuple(ranks), backend))
        return ("pg", len(self.made)) if self.rank in ranks else self.NON_MEMBER

    def destroy_process_group(self, pg):
        self.destroyed.append(pg)


def pool_for(rank: int, spare: int) -> tuple[GroupPool, FakeDist]:
    pool = GroupPool(spare=spare, timeout=TIMEOUT)
    pool._dist = FakeDist(rank)
    return pool, pool._dist


def test_every_two_rank_strategy_shares_four_groups():
    pool, dist = pool_for(0, spare=16)
    topologies = [Topology.from_strategy(s) for s in soak_strategies(2, 8, 2.0)]
    for _ in range(10):
        for t in topologies:
            Comm(t, 0, pool=pool)
    # cfg2 first: data [0, 1] and the gloo control group; PipeFusion adds its two link directions. Made
    # once, never destroyed, whatever the order of strategies.
    assert dist.made == [((0, 1), None), ((0, 1), "gloo"), ((0, 1), None), ((0, 1), None)]
    assert dist.destroyed == [] and len(pool) == 4


def test_idle_groups_beyond_spare_are_destroyed_least_recently_used_first_and_ranks_agree():
    pp4, uly4, cfg2_uly2 = Topology(pipefusion=4), Topology(ulysses=4), Topology(cfg=2, ulysses=2)
    logs = []
    for rank in range(4):
        pool, dist = pool_for(rank, spare=2)
        sizes = []
        for t in (pp4, uly4, cfg2_uly2, uly4):
            Comm(t, rank, pool=pool)
            sizes.append((len(dist.made), len(dist.destroyed), len(pool)))
        logs.append((dist.made, sizes))
    # Same calls in the same order on every rank (new_group and destroy are collective).
    assert all(log == logs[0] for log in logs)
    # (made, destroyed, held) after each job. pp4: data + 4 links + control. uly4 reuses data and control;
    # of the 4 idle links the 2 least recently used go. cfg2 x uly2 makes 4 data groups and uses the 4 ranks' group
    # too (its step_rows: CFG x Ulysses, the step cache's decision); 2 idle, none goes. uly4 again makes nothing;
    # 6 idle, 4 go.
    assert logs[0][1] == [(6, 0, 6), (6, 2, 4), (10, 2, 8), (10, 6, 4)]


def test_a_finished_denoiser_is_freed_without_the_cycle_collector(tiny_path):
    """The Denoiser holds the model and the job's state (PipeFusion's K/V). Left in a reference cycle it lives
    until a full collection: at e0b784e, where a model reload promoted the cycle to the oldest generation,
    every strategy switch that reloaded kept the previous model alive (+280 MiB per worker over 1,000 mixed
    jobs; on CUDA, old weights in device memory). Denoiser.run drops its callbacks when it returns."""
    import gc
    import weakref

    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.bench.runs import make_job
    from parallel_runtime.strategies.denoise import Denoiser
    from parallel_runtime.models.families.flux_adapter import load_flux
    from parallel_runtime.models.families.flux_adapter import FluxAdapter
    from parallel_runtime.spec import StrategySpec

    config, model = load_flux(tiny_path)
    context = AttentionContext()
    adapter = FluxAdapter(config, model, [range(config.num_layers + config.num_single_layers)], context)
    job = make_job(tiny_path, config, StrategySpec(), (1, 16, 8, 8), 7, 2.0, 2)
    reports = []

    def one_job():  # as the worker's _denoise: a progress callback that reads the denoiser, then return
        denoiser = Denoiser(adapter, Topology(), Comm(Topology()), context)

        def progress(step, total):
            reports.append(denoiser.reports_progress)

        denoiser.run(job, progress=progress)
        return weakref.ref(denoiser)

    gc.disable()
    try:
        finished = one_job()
        assert reports == [True, True] and finished() is None
    finally:
        gc.enable()
