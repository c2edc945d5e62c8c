"""`bench --batch N`: a batch per strategy on the same workers. Run end to end on the tiny model; the times are the
bench's business (`python -m parallel_runtime bench --model toy --batch 4`), the numbers checked here are the
record's shape, each image against serial's, and the targets' lines."""
from __future__ import annotations

import json

import pytest

from parallel_runtime.bench.batch import EXACT_RTOL
from parallel_runtime.bench.cli import main

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def record(tmp_path_factory, bench_workers):
    out = tmp_path_factory.mktemp("batch") / "bench.json"
    main(["--quick", "--batch", "3", "--cfg", "2.0", "--steps", "2", "--json", str(out)], workers=bench_workers)
    return json.loads(out.read_text())


def test_batch_bench_runs_every_split_on_the_batch(record):
    rows = {row["label"]: row for row in record["batch"]["rows"]}
    assert list(rows) == ["serial", "batch2", "ulysses2", "ring2", "cfg2"]  # CFG-2 at cfg 2
    assert record["batch"]["images"] == 3 and record["batch"]["not_applicable"] == []
    for label, row in rows.items():
        assert row["s_per_step"] > 0 and row["images_per_min"] == pytest.approx(60 * 3 / (row["s_per_step"] * 2))
        if label != "serial":  # every split is exact here: each of the 3 images as serial gives it
            assert row["max_image_rel_err_vs_serial"] <= EXACT_RTOL, label
            assert row["speedup_vs_serial"] == pytest.approx(rows["serial"]["s_per_step"] / row["s_per_step"])


def test_batch_bench_reports_its_targets(record):
    targets = {t["target"]: t["status"] for t in record["targets"]}
    assert targets["batch2: every image equals serial's (rel L2 <= 0.0001)"] == "PASS"
    assert "batch2: >= 1.9x serial on a batch of 3" in targets  # PASS or FAIL is the timing's, not this test's
    assert "batch2: faster than every other split of the same devices on this batch" in targets
