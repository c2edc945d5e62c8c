"""Every `bench --family` grid in --quick form runs to its end: a row the model or the latent cannot take is
reported as not applicable with the runtime's sentence, never a traceback halfway through the grid (issue 43:
`--family wan` offered tensor parallel on a bench model whose MLP width, 1493, no degree divides). The families
share one pool of workers, so the test pays for starting them once."""
from __future__ import annotations

import json

import pytest

from parallel_runtime.bench.av_calls import AV_FAMILIES
from parallel_runtime.bench.cli import main
from parallel_runtime.bench.models import BENCH_FAMILIES
from parallel_runtime.spec import StrategySpec

pytestmark = pytest.mark.timeout(900)

# The smallest run that still takes every row kind: 64-128 tokens (PixArt: 289, its smallest image), 2 steps (the
# first is left out of the timing), no calibration, no references, no VAE.
SMOKE = ["--quick", "--text-tokens", "8", "--steps", "2", "--no-auto", "--no-overhead", "--vae-frames", "0"]


def smallest(family: str) -> list[str]:
    side = max(128, -(-getattr(BENCH_FAMILIES[family], "min_mean_latent_side", 0) * 8 // 16) * 16)
    return ["--resolution", f"{side}x{side}"]
# The 2-device grid's row kinds (bench/grid.py): each family either runs a row or names why it cannot.
ROW_KINDS = {"serial", "serial@cfg3.5", "cfg2@cfg3.5", "ulysses2", "ulysses2+shard", "ring2", "pp2xM2w1",
             "pp2xM4w1", "tp2", "patch2xw1", "naive2"}
EXACT_RTOL = 1e-4  # exact strategies differ from serial by float summation order only


@pytest.fixture(scope="module")
def workers(bench_workers):
    return bench_workers


@pytest.mark.parametrize("family", sorted(set(BENCH_FAMILIES) - set(AV_FAMILIES)))  # test_bench_av: the AV ones
def test_quick_grid_runs_every_row_or_says_why_not(family, workers, tmp_path, monkeypatch):
    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--family", family, *SMOKE, *smallest(family), "--json", str(out)], workers=workers) == 0
    record = json.loads(out.read_text())
    ran = {row["label"]: row for row in record["rows"]}
    refused = {row["label"]: row["reason"] for row in record["not_applicable"]}
    assert ROW_KINDS <= set(ran) | set(refused), f"{family}: rows neither run nor refused"
    assert not set(ran) & set(refused)
    assert {"serial", "ulysses2", "pp2xM2w1"} <= set(ran)  # every family splits by heads and by blocks
    assert all(reason.endswith(".") and "; " in reason for reason in refused.values()), refused  # names the fix
    for label, row in ran.items():
        if row["ranks"] > 1 and StrategySpec(**row["strategy"]).exact:
            assert row["rel_err"] < EXACT_RTOL, f"{family} {label}: {row['rel_err']:.1e}"
        # every rank timed its steps' CPU seconds (the work column): serial's against itself is 1
        assert row["cpu_step_s"] > 0 and row["work_speedup"] > 0, (family, label, row["cpu_step_s"])
    assert ran["serial"]["work_speedup"] == 1.0


def test_wan_grid_names_why_tensor_parallel_does_not_fit(workers, tmp_path, monkeypatch):
    # The row that stopped the grid before: Wan's bench MLP (1493 units) splits over no degree.
    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--family", "wan", *SMOKE, *smallest("wan"), "--configs", "tp2", "--json", str(out)],
                workers=workers) == 0
    refused = {row["label"]: row["reason"] for row in json.loads(out.read_text())["not_applicable"]}
    assert "MLP width of 1493" in refused["tp2"]
