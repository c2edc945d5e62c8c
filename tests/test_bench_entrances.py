"""`bench --entrances`: Parallel Sampler's job and KSampler's way in (one runtime job per model call, the sampler loop
on the host) on the same workers, per strategy, for a Wan video. Run end to end on a tiny video; the times are the
bench's business (`python -m parallel_runtime bench --family wan --entrances`), the numbers checked here are the
record's shape and the two entrances' latents."""
from __future__ import annotations

import json

import pytest

from parallel_runtime.bench.cli import main
from parallel_runtime.bench.entrances import AGREE_RTOL

pytestmark = pytest.mark.timeout(600)

# 5 frames of 128x128 px: a 2 x 16 x 16 latent, 128 video tokens; 2 steps: PipeFusion's warm-up step, then one that
# reads stale K/V.
TINY_VIDEO = ["--family", "wan", "--quick", "--entrances", "--resolution", "128x128", "--text-tokens", "8",
              "--steps", "2"]
ROWS = {"serial", "cfg2@cfg3.5", "ulysses2", "ring2", "pp2xM2w1"}


@pytest.fixture(scope="module")
def record(tmp_path_factory, bench_workers):
    """One run on the session's workers (conftest bench_workers: no worker starts of its own)."""
    out = tmp_path_factory.mktemp("entrances") / "bench.json"
    assert main([*TINY_VIDEO, "--json", str(out)], workers=bench_workers) == 0
    return json.loads(out.read_text())


def test_every_strategy_runs_both_entrances_with_a_time_per_step(record):
    rows = {row["label"]: row for row in record["entrances"]["rows"]}
    assert set(rows) == ROWS and record["entrances"]["not_applicable"] == []
    assert record["family"] == "wan" and record["latent_shape"] == [1, 16, 2, 16, 16]
    for row in rows.values():
        for entrance in ("parallel_sampler", "per_call"):
            best = row[entrance]
            assert len(best["runs"]) == 1  # --quick: one repeat
            assert best["run_s"] > 0 and best["steady_s"] > 0
            assert best["runs"][0]["load_s"] == 0  # the untimed warm-up call loaded the model: no load inside a run
        assert row["ratio_run"] == pytest.approx(row["per_call"]["run_s"] / row["parallel_sampler"]["run_s"])
    assert rows["cfg2@cfg3.5"]["cfg"] == 3.5 and rows["ring2"]["ranks"] == 2 and rows["serial"]["ranks"] == 1


def test_the_two_entrances_latents_agree(record):
    rows = {row["label"]: row for row in record["entrances"]["rows"]}
    for label, row in rows.items():
        # Same model inputs, same float32 maths (the host's sampler in another order at most): round-off.
        assert row["rel_diff"] <= AGREE_RTOL, f"{label}: {row['rel_diff']:.1e}"
    assert rows["ulysses2"]["rel_err_vs_serial"] <= AGREE_RTOL and rows["ring2"]["rel_err_vs_serial"] <= AGREE_RTOL
    # PipeFusion's second step read stale K/V (it is not serial's result), and per call read the same stale K/V.
    assert rows["pp2xM2w1"]["rel_err_vs_serial"] > 100 * AGREE_RTOL
    assert record["entrances"]["latents_agree"] is True


def test_targets_are_reported_per_strategy(record):
    targets = {t["target"]: t["status"] for t in record["targets"]}
    for label in ROWS:
        assert targets[f"{label}: both entrances' latents agree (rel L2 <= {AGREE_RTOL:g})"
                       + (" (after warm-up: the same one-evaluation-old K/V in both)" if label.startswith("pp") else "")
                       ] == "PASS"
        assert targets[f"{label}: Parallel Sampler at most 2% slower than per call (whole run)"] in ("PASS", "FAIL")
    assert targets["pp2xM2w1: cross-step pipeline >= 1.08x per call (steady step)"] in ("PASS", "FAIL")
