"""The runtime's First-Block Cache (strategies/step_cache.py, StrategySpec.cache), decided across ranks.

Each rank sees only its rows of a step (a sequence shard, one CFG branch), so a cache decided per rank would
skip on one rank and compute on another; the runtime all-reduces the first block's change over the ranks holding
different rows, so every rank skips the same steps, those of the serial run, and the cached parallel run equals
the cached serial one at fp32 round-off.

On the tiny model (make_job: 8 steps, cfg 2) the first block's relative change between steps is 0.51-0.81, so a
threshold of 0.65 skips steps 1, 2 and 4 (the closest change to it, 0.629 and 0.694, is 2e-2 away: far more than
the ~1e-6 a rank count moves a float64 sum of float32 rows).
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import make_job, rel_err
from parallel_runtime.distributed.topology import validate_strategy
from parallel_runtime.errors import ConfigError
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

EXACT_RTOL = 1e-4  # exact strategies reorder float32 sums (~1e-7 per op); a cached step adds one more sum
THRESHOLD = 0.65
SKIPPED = [1, 2, 4]  # the tiny job's skipped steps at THRESHOLD (see the module docstring)


def cached(path: str, strategy: S = S(), **cache) -> object:
    settings = dict(cache="first_block", cache_threshold=THRESHOLD) | cache
    return make_job(path, dataclasses.replace(strategy, **settings))


def skipped_per_rank(result) -> list[list[int]]:
    return [stats["cache_skipped"] for stats in result.stats]


@pytest.fixture(scope="module")
def serial_cached(tiny_path, client1):
    return client1.run(cached(tiny_path))


def test_cache_threshold_zero_equals_the_uncached_run_bit_for_bit(tiny_path, client1, serial):
    # Threshold 0 never skips, and the first block and the rest run as the same ops as one pass: identical.
    result = client1.run(cached(tiny_path, cache_threshold=0.0))
    assert skipped_per_rank(result) == [[]]
    assert result.latent.equal(serial)


def test_cache_serial_skips_the_steps_under_the_threshold_within_its_window(tiny_path, client1, serial,
                                                                            serial_cached):
    assert skipped_per_rank(serial_cached) == [SKIPPED]
    err = rel_err(serial_cached.latent, serial)
    assert 1e-3 < err < 0.5, err  # a skipped step changes the result, by less than the whole latent
    # Steps outside [start, end) of the schedule always compute: 0.3 <= i / 8 < 0.45 leaves step 3 alone, whose
    # change after computed steps 0-2 is 0.614 (steps 1 and 2, at 0.580 and 0.510, would skip without the window).
    window = client1.run(cached(tiny_path, cache_start=0.3, cache_end=0.45))
    assert skipped_per_rank(window) == [[3]]


# Displaced patch with every step a warm-up step is exact too (its stale steps are approximate with or without the
# cache); sharded weights gather blocks a skipped step does not run, in the same order on every rank.
@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2), S(tensor_degree=2),
                                      S(patch_degree=2, warmup_steps=8), S(ulysses_degree=2, shard_weights=True)],
                         ids=lambda s: s.label())
def test_cache_decisions_agree_on_every_rank_and_equal_serial(tiny_path, client2, serial_cached, strategy):
    result = client2.run(cached(tiny_path, strategy))
    assert skipped_per_rank(result) == [SKIPPED, SKIPPED]
    # Each decision read the whole step's change, serial's up to float32 round-off of the rows (~1e-6 relative);
    # a rank's own rows (half the sequence, one CFG branch) differ from it by 1e-3 or more.
    serial_changes = serial_cached.stats[0]["cache_changes"]
    assert len(serial_changes) == 7  # steps 1-7 (step 0 has no step before it to compare with)
    for stats in result.stats:
        assert [step for step, _ in stats["cache_changes"]] == [step for step, _ in serial_changes]
        for (_, change), (_, reference) in zip(stats["cache_changes"], serial_changes):
            assert abs(change - reference) < 1e-5 * reference, (stats["rank"], change, reference)
    err = rel_err(result.latent, serial_cached.latent)
    assert err < EXACT_RTOL, err


@pytest.mark.parametrize("settings, words", [
    (dict(cache_threshold=math.nan), "cache_threshold=nan"),
    (dict(cache_threshold=-0.1), "cache_threshold=-0.1"),
    (dict(cache_start=0.8, cache_end=0.2), "cache_start=0.8 is after cache_end=0.2"),
    (dict(cache_end=1.5), "cache_end=1.5"),
    (dict(cache="teacache"), "cache='teacache'"),
])
def test_cache_bad_settings_get_one_sentence(settings, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as caught:
        S(**{"cache": "first_block", **settings})
    assert str(caught.value).count(". ") == 0 and str(caught.value).endswith(".")


PIPEFUSION = S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1)
# Stage 0 decides step i on step i-1's change of both patches, against the last computed step: step 1 is the first
# patch step (nothing to compare), step 2's change (0.502) decides step 3, step 3's (0.595) step 4, step 4's (0.610,
# still against step 2) step 5; then 0.795 and 0.973 compute. The nearest change is 4e-2 from THRESHOLD.
PIPEFUSION_SKIPPED = [3, 4, 5]


@pytest.fixture(scope="module")
def pipefusion_uncached(tiny_path, client2):
    return client2.run(make_job(tiny_path, PIPEFUSION)).latent


def test_cache_under_pipefusion_every_stage_skips_the_steps_stage_0_decided(tiny_path, client2):
    validate_strategy(dataclasses.replace(PIPEFUSION, cache="first_block"), world_size=2)  # once refused
    result = client2.run(cached(tiny_path, PIPEFUSION))
    assert skipped_per_rank(result) == [PIPEFUSION_SKIPPED, PIPEFUSION_SKIPPED]
    decided = result.stats[0]["cache_changes"]  # stage 0's: the later stage only receives the decisions
    assert [step for step, _ in decided] == [3, 4, 5, 6, 7]
    assert [step for step, change in decided if change < THRESHOLD] == PIPEFUSION_SKIPPED


def test_cache_under_pipefusion_threshold_zero_equals_uncached_bit_for_bit(tiny_path, client2, pipefusion_uncached):
    # The first block and the rest of stage 0's chunk run as the same ops as one pass, and nothing skips.
    result = client2.run(cached(tiny_path, PIPEFUSION, cache_threshold=0.0))
    assert skipped_per_rank(result) == [[], []]
    assert result.latent.equal(pipefusion_uncached)


def test_cache_under_pipefusion_all_warm_up_computes_every_step_and_equals_serial(tiny_path, client2, serial):
    # Warm-up steps always compute (they fill the stale K/V every later patch reads): with every step a warm-up
    # step the cache never skips, and PipeFusion stays exact against serial's uncached run (not its cached one).
    result = client2.run(cached(tiny_path, dataclasses.replace(PIPEFUSION, warmup_steps=8)))
    assert skipped_per_rank(result) == [[], []]
    err = rel_err(result.latent, serial)
    assert err < EXACT_RTOL, err


def test_cache_under_pipefusion_stays_nearer_serial_cached_than_naive_patch(tiny_path, client2, serial,
                                                                            serial_cached, pipefusion_uncached):
    """Approximate twice over: PipeFusion's stale K/V after warm-up (uncached: 1.0e-2 from serial), and decisions
    one step late, skipped steps [3, 4, 5] against serial's [1, 2, 4], with no stale K/V refreshed by a skipped
    step's skipped blocks. Cached: 5.9e-2 from serial's cached run; naive patch cached at the same settings: 6.4e-2."""
    assert rel_err(pipefusion_uncached, serial) < 1.5e-2  # measured 1.05e-2: PipeFusion's own staleness
    err = rel_err(client2.run(cached(tiny_path, PIPEFUSION)).latent, serial_cached.latent)
    naive = rel_err(client2.run(cached(tiny_path, S(naive_patch_degree=2))).latent, serial_cached.latent)
    assert 4e-2 < err < naive, (err, naive)  # measured 5.9e-2 < 6.4e-2; a late decision costs more than 4e-2 here


def test_cache_bench_rows_agree_on_decisions_and_stay_exact(bench_workers, tmp_path):
    """`bench --cache` on the session's workers: serial and each exact strategy at 2 workers, off and on."""
    import json

    from parallel_runtime.bench.cli import main

    out = tmp_path / "cache.json"
    assert main(["--quick", "--cache", str(THRESHOLD), "--steps", "6", "--json", str(out)],
                workers=bench_workers) == 0
    record = json.loads(out.read_text())["cache"]
    rows = {row["strategy"]: row for row in record["rows"]}
    assert set(rows) == {"serial", "cfg2", "ulysses2", "ring2", "tp2"} and record["threshold"] == THRESHOLD
    assert rows["serial"]["skipped"], "the bench's job must skip some steps, or it measures nothing"
    for label, row in rows.items():
        assert row["ranks_agree"] and row["skipped"] == rows["serial"]["skipped"], label
        assert row["cached_vs_serial_cached"] < EXACT_RTOL, (label, row["cached_vs_serial_cached"])
        assert row["uncached_error"] < EXACT_RTOL, (label, row["uncached_error"])
        assert row["cache_gain"] > 0 and row["speedup"] > 0


def test_cache_under_displaced_patch_stale_steps_stays_near_serial_cached(tiny_path, client2, serial_cached):
    """After its warm-up, displaced patch reads the other patch's K/V from the previous step; a skipped step sends
    none for the skipped blocks, so the next computed step reads them two steps old. Uncached it is 1.5e-2 from
    serial on this job (naive patch 6.4e-2); cached, 1.8e-2 from serial's cached run."""
    result = client2.run(cached(tiny_path, S(patch_degree=2)))
    assert skipped_per_rank(result) == [SKIPPED, SKIPPED]
    err = rel_err(result.latent, serial_cached.latent)
    assert err < 3e-2, err  # displaced patch's own 1.5e-2, and the staler K/V after a skip: still < naive's 6.4e-2
