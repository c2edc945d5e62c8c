"""traffic.py's analytic bytes against the runtime's own counters, and the bench's quick preset."""
from __future__ import annotations

import json

import pytest

from conftest import make_job
from parallel_runtime.models.tiny import TINY
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.planning.traffic import Shapes, compare, job_traffic, shapes_of

pytestmark = pytest.mark.timeout(300)

STEPS, SIZE, TEXT = 3, 16, 7  # 7 text tokens: uneven text shards under every sequence-parallel degree
IMAGE = (SIZE // 2) ** 2


def shapes_for(strategy: S, config=TINY) -> Shapes:
    return shapes_of(config, image_tokens=IMAGE, text_tokens=TEXT, pipefusion=strategy.pipefusion_degree)


def check(client, path, strategy, cfg):
    result = client.run(make_job(path, strategy, steps=STEPS, cfg=cfg, size=SIZE, text_len=TEXT))
    measured = [st["traffic"] for st in result.stats]
    analytic = job_traffic(strategy, shapes_for(strategy), steps=STEPS, cfg=cfg)
    ok, worst = compare(measured, analytic, tolerance=0.10)
    assert ok, (strategy.label(), worst, measured, [a.by_op() for a in analytic])
    for got, want in zip(measured, analytic):  # per op too, so one op's error can't hide behind another's
        assert set(got["by_op"]) == set(want.by_op()), (got["by_op"], want.by_op())
        for op, (sent, recv) in want.by_op().items():
            assert got["by_op"][op][0] == pytest.approx(sent, rel=0.10)
            assert got["by_op"][op][1] == pytest.approx(recv, rel=0.10)


@pytest.mark.parametrize("strategy,cfg", [
    (S(cfg_degree=2), 2.0),
    (S(ulysses_degree=2), 1.0), (S(ulysses_degree=2), 2.0),
    (S(ring_degree=2), 1.0), (S(ring_degree=2), 2.0),
    (S(pipefusion_degree=2), 1.0),
    (S(pipefusion_degree=2, num_pipeline_patch=4, warmup_steps=2), 2.0),
    (S(naive_patch_degree=2), 1.0),
], ids=lambda v: v.label() if isinstance(v, S) else f"cfg{v:g}")
def test_two_workers_measured_bytes_match_analytic(client2, tiny_path, strategy, cfg):
    check(client2, tiny_path, strategy, cfg)


def test_four_worker_hybrids_measured_bytes_match_analytic(client4, tiny_path):
    for strategy, cfg in [(S(ulysses_degree=2, ring_degree=2), 1.0),
                          (S(pipefusion_degree=2, ulysses_degree=2), 2.0),
                          (S(cfg_degree=2, ring_degree=2), 2.0)]:
        check(client4, tiny_path, strategy, cfg)


def test_uneven_image_shards_measured_bytes_match_analytic(client4, tiny_path):
    """63 image tokens (an 18 x 14 latent): every degree leaves shards a row apart; the formulas follow them."""
    import torch

    for strategy, cfg in [(S(ulysses_degree=2, ring_degree=2), 2.0), (S(cfg_degree=2, ulysses_degree=2), 2.0),
                          (S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=3, warmup_steps=1), 1.0)]:
        j = make_job(tiny_path, strategy, steps=STEPS, cfg=cfg, text_len=TEXT, latent=torch.zeros(1, 16, 18, 14))
        measured = [st["traffic"]["by_op"] for st in client4.run(j).stats]
        shapes = shapes_of(TINY, image_tokens=63, text_tokens=TEXT, pipefusion=strategy.pipefusion_degree)
        analytic = [a.by_op() for a in job_traffic(strategy, shapes, steps=STEPS, cfg=cfg)]
        assert measured == analytic, strategy.label()  # exact: every row counted


# -- the formulas alone ---------------------------------------------------------------------------------

ALL = [S(ulysses_degree=4), S(ring_degree=4), S(ulysses_degree=2, ring_degree=4), S(cfg_degree=2, ulysses_degree=4),
       S(pipefusion_degree=4, num_pipeline_patch=8), S(pipefusion_degree=2, ulysses_degree=4, warmup_steps=3),
       S(cfg_degree=2, pipefusion_degree=2, ulysses_degree=2), S(naive_patch_degree=8), S(cfg_degree=2)]


@pytest.mark.parametrize("strategy,cfg", [(s, c) for s in ALL for c in (1.0, 3.5) if s.cfg_degree == 1 or c > 1],
                         ids=lambda v: v.label() if isinstance(v, S) else f"cfg{v:g}")
def test_every_byte_sent_is_received(strategy, cfg):
    shapes = Shapes(image_tokens=4096, text_tokens=77, hidden=3072, heads=24, num_blocks=57, batch=2, act_bytes=2)
    traffic = job_traffic(strategy, shapes, steps=5, cfg=cfg)
    assert len(traffic) == strategy.world_size
    assert sum(t.sent for t in traffic) == sum(t.recv for t in traffic)
    ops = {op for t in traffic for op in t.ops}
    for op in ops:
        assert sum(t.ops.get(op, [0, 0])[0] for t in traffic) == sum(t.ops.get(op, [0, 0])[1] for t in traffic)


def test_closed_forms_for_even_splits():
    b, e, h, s_len, layers, steps = 1, 4, 256, 4096 + 128, 6, 5
    shapes = Shapes(image_tokens=4096, text_tokens=128, hidden=h, heads=4, num_blocks=layers, act_bytes=e)
    # Ulysses: 4 b e H S (U-1)/U^2 each way per layer (q, k, v out; attention output back).
    for u in (2, 4):
        t = job_traffic(S(ulysses_degree=u), shapes, steps=steps, cfg=1.0)[0]
        assert t.ops["ulysses"][0] == 4 * b * e * h * s_len * (u - 1) // u ** 2 * layers * steps
        assert t.ops["result"][0] == (u - 1) * 4096 * 64 * 4
    # Ring: R-1 hops of this rank's K and V block per layer.
    for r in (2, 4):
        t = job_traffic(S(ring_degree=r), shapes, steps=steps, cfg=1.0)[0]
        assert t.ops["ring"][0] == (r - 1) * 2 * b * e * h * (s_len // r) * layers * steps
    # CFG: the denoised rows once per step.
    t = job_traffic(S(cfg_degree=2), shapes, steps=steps, cfg=3.5)[0]
    assert t.ops["cfg"] == [4096 * 64 * 4 * steps] * 2 + [steps]
    # PipeFusion: hidden [text; patch] rows per patch to the next stage, x rows back after all but the last step.
    m = 4
    first, last = job_traffic(S(pipefusion_degree=2, num_pipeline_patch=m), shapes, steps=steps, cfg=1.0)
    hidden = (128 + 4096) * h * e + (steps - 1) * (m * 128 + 4096) * h * e
    assert first.ops["pipefusion"][:2] == [hidden, 0] and last.ops["pipefusion"][:2] == [0, hidden]
    assert last.ops["pipefusion_x"][:2] == [(steps - 1) * 4096 * 64 * 4, 0]
    assert "result" not in last.ops  # no Ulysses inside the stage: nothing to gather


def test_serial_moves_nothing():
    shapes = Shapes(image_tokens=64, text_tokens=7, hidden=128, heads=4, num_blocks=4)
    [t] = job_traffic(S(), shapes, steps=3, cfg=2.0)
    assert t.sent == t.recv == 0


# -- the bench's smoke preset ----------------------------------------------------------------------------


def test_bench_quick_preset(bench_workers, tmp_path, monkeypatch):
    from parallel_runtime.bench.cli import main

    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--quick", "--repeats", "1", "--json", str(out)], workers=bench_workers) == 0
    record = json.loads(out.read_text())
    labels = {r["label"] for r in record["rows"]}
    assert {"serial", "cfg2@cfg3.5", "ulysses2", "ring2", "pp2xM2w1", "pp2xM4w1", "naive2"} <= labels
    assert all(r["traffic_ok"] for r in record["rows"])
    assert all(r["rel_err"] < 1e-4 for r in record["rows"] if r["label"] in ("ulysses2", "ring2", "cfg2@cfg3.5"))
    statuses = {t["target"]: t["status"] for t in record["targets"]}
    assert statuses["measured bytes within 10% of analytic"] == "PASS"
    assert all(s in ("PASS", "FAIL", "n/a") for s in statuses.values())
    assert record["auto"] is not None and isinstance(record["auto"]["reason"], str)
    assert len(record["projection"]) == 6


@pytest.mark.parametrize("family", ["chroma", "sd35_medium"])
def test_bench_family_rows_name_their_family(bench_workers, tmp_path, monkeypatch, family):
    """`bench --family`: the grid runs on that family's bench model; exact strategies stay exact."""
    from parallel_runtime.bench.cli import main
    from parallel_runtime.bench.models import BENCH_FAMILIES

    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--quick", "--family", family, "--configs", "serial,ulysses2,ring2", "--no-auto",
                       "--no-overhead", "--json", str(out)], workers=bench_workers) == 0
    record = json.loads(out.read_text())
    expected = BENCH_FAMILIES[family].family
    assert record["family"] == expected and {r["family"] for r in record["rows"]} == {expected}
    assert {r["label"] for r in record["rows"]} == {"serial", "ulysses2", "ring2"}
    assert all(r["rel_err"] < 1e-4 for r in record["rows"] if r["label"] != "serial")
