"""`bench --family wan`: the Wan row's model and video latent, its targets, the VAE decode timed apart from the DiT,
and the 14B projection, each small and fast (the real grid: `python -m parallel_runtime bench --family wan`)."""
from __future__ import annotations

import argparse
import json

import pytest

from parallel_runtime.bench.cli import bench_latent, main, parse_args
from parallel_runtime.bench.grid import grid, row_label
from parallel_runtime.bench.models import BENCH_FAMILIES, RELEASE_SHAPES, RELEASE_VIDEO_SIZES
from parallel_runtime.distributed.topology import latent_plane
from parallel_runtime.spec import StrategySpec as S

WAN = BENCH_FAMILIES["wan"]


def test_wan_bench_model_has_wan_13b_blocks():
    assert WAN.family == "wan" and WAN.video
    assert WAN.head_dim == 128 and WAN.num_heads == 2  # Wan's 128-wide heads; Ulysses-2 divides 2 of them
    # The 1.3B's MLP ratio 8960/1536: an integer width lands within half a unit of it.
    assert abs(WAN.ffn_dim - WAN.hidden_size * 8960 / 1536) <= 0.5
    # Self-attention over the video, then cross-attention to the prompt (not in the attention sequence).
    assert {kind.attention for kind in WAN.block_kinds} == {("image", "prompt")}


def test_wan_bench_latent_is_a_video_of_at_least_8000_tokens():
    args = parse_args(["--family", "wan"])
    assert (args.resolution, args.frames, args.text_tokens) == ("320x320", 81, 512)  # umT5's 512 prompt tokens
    shape, tokens = bench_latent(WAN, 320, 320, args.frames)
    assert shape == (1, 16, 21, 40, 40) and tokens == 21 * 20 * 20 == 8400
    rows = grid(2, cfg=1.0, heads=WAN.num_heads, num_blocks=WAN.num_blocks, latent_hw=latent_plane(shape[2:]))
    assert {"ulysses2", "ring2", "cfg2@cfg3.5", "pp2xM2w1", "pp2xM4w1"} <= {row_label(s, c) for s, c in rows}


def test_wan_quick_preset_and_frame_counts():
    args = parse_args(["--quick", "--family", "wan"])
    assert (args.frames, args.vae_frames) == (5, "1")
    assert bench_latent(WAN, 256, 256, 5) == ((1, 16, 2, 32, 32), 2 * 16 * 16)
    with pytest.raises(SystemExit, match="4k \\+ 1"):
        bench_latent(WAN, 256, 256, 6)
    with pytest.raises(SystemExit, match="video models"):
        bench_latent(BENCH_FAMILIES["pixart"], 256, 256, 5)
    with pytest.raises(SystemExit, match="vae-frames"):
        parse_args(["--family", "wan", "--vae-frames", "some"])


def _row(label: str, strategy, speedup: float, cfg: float = 1.0) -> dict:
    return {"label": label, "strategy": strategy, "speedup": speedup, "step_s": 1.0 / speedup, "cfg": cfg,
            "stats": [{"param_bytes": 1}], "traffic_ok": True, "traffic_diff": 0.0, "rel_err": 0.0}


def _statuses(family: str | None, results: list[dict]) -> dict:
    from parallel_runtime.bench.targets import measured_targets

    got = {}
    measured_targets(argparse.Namespace(cfg=1.0, model="wan"), results, {1.0: {"step_s": 1.0}, 3.5: {"step_s": 1.0}},
                     None, None, lambda name, ok, detail: got.__setitem__(name, ok), family=family)
    return got


def test_wan_targets_ask_18x_of_exact_strategies_and_185x_of_cfg2():
    results = [_row("ulysses2", S(ulysses_degree=2), 1.81), _row("ring2", S(ring_degree=2), 1.79),
               _row("cfg2@cfg3.5", S(cfg_degree=2), 1.84, cfg=3.5)]
    wan = _statuses("wan", results)
    assert wan["Ulysses-2 >= 1.8x serial"] is True and wan["Ring-2 >= 1.8x serial"] is False
    assert wan["CFG-2 (cfg > 1) >= 1.85x serial"] is False  # 1.84x misses ComfyUI core's split ratio
    assert wan["PipeFusion-2 (stale KV) >= 1.6x serial"] is None  # not run: no verdict either way
    # Other families keep their 1.6x targets, with no Ring target.
    assert _statuses("flux", results)["CFG-2 (cfg > 1) >= 1.6x serial"] is True
    assert not any(name.startswith("Ring-2") for name in _statuses("flux", results))


def test_wan_vae_decode_is_timed_per_frame_and_extrapolated():
    from parallel_runtime.bench.vae import describe, dilution, time_decode

    rec = time_decode((1, 16, 4, 4, 4), 2)  # 2 of 4 latent frames of a 32x32 px video
    assert (rec["decoded_latent_frames"], rec["decoded_video_frames"], rec["video_frames"]) == (2, 5, 13)
    assert len(rec["frame_s"]) == 2 and rec["extrapolated"] and rec["in_dit_speedup"] is False
    # First two frames measured, the other two at the second's time: the extrapolation's arithmetic, up to rounding.
    assert rec["whole_s"] == pytest.approx(rec["decoded_s"] + 2 * rec["frame_s"][1])
    assert 126e6 < rec["parameters"] < 128e6  # the full-size Wan 2.1 VAE (126.9M parameters), not a scaled one
    assert "NOT part of the DiT" in describe(rec) and "extrapolated" in describe(rec)
    assert dilution({"whole_s": 10.0}, 20.0, 10.0) == pytest.approx(1.5)  # (20 + 10) / (10 + 10)


def test_wan_projection_is_14b_at_480p_and_720p_beside_xdits_figures():
    from parallel_runtime.bench.projection import video_projection, xdit_published

    config, name = RELEASE_SHAPES["wan"]
    assert (config.hidden_size, config.num_heads, config.num_layers, config.ffn_dim) == (5120, 40, 40, 13824)
    sizes = RELEASE_VIDEO_SIZES["wan"]
    assert [f * (r // 2) * (c // 2) for _, f, r, c in sizes] == [32760, 75600]
    lines: list[str] = []
    rows = video_projection(lines.append, config, name, sizes, 512, 1.0, 400.0)
    assert len(rows) == 2 * 6 and [r["size"] for r in rows[::6]] == [s[0] for s in sizes]  # 2/4/8 GPUs x 2 links
    assert all(float(r["speed-up"].rstrip("x")) > 1.0 for r in rows)
    published = xdit_published(lines.append)
    assert published["speedup"][8] == pytest.approx(1904.08 / 337.58)  # the published latencies' own ratio
    assert "no Wan figures" in lines[-1]


def test_wan_bench_quick_grid_runs_end_to_end(bench_workers, tmp_path, monkeypatch):
    """The CLI wiring on a 512-token video: exact strategies stay exact, bytes match traffic.py, the VAE line and
    record are there (decoding a tiny latent instead of the bench's, which takes seconds per frame)."""
    from parallel_runtime.bench import vae

    real = vae.time_decode
    monkeypatch.setattr(vae, "time_decode", lambda shape, frames: real((*shape[:3], 4, 4), frames))
    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--quick", "--family", "wan", "--configs", "serial,ulysses2,ring2", "--no-auto", "--no-overhead",
                 "--json", str(out)], workers=bench_workers) == 0
    record = json.loads(out.read_text())
    assert record["family"] == "wan" and record["latent_shape"] == [1, 16, 2, 32, 32] and record["frames"] == 5
    assert record["image_tokens"] == 512 and {r["label"] for r in record["rows"]} == {"serial", "ulysses2", "ring2"}
    assert all(r["traffic_ok"] for r in record["rows"])
    # Ulysses and Ring are exact: only float summation order differs from serial.
    assert all(r["rel_err"] < 1e-4 for r in record["rows"] if r["label"] != "serial")
    decode = record["vae_decode"]
    assert decode["in_dit_speedup"] is False and decode["decoded_latent_frames"] == 1
    assert decode["diluted"]["label"] in ("ulysses2", "ring2")
    assert {t["target"] for t in record["targets"]} >= {"Ulysses-2 >= 1.8x serial", "Ring-2 >= 1.8x serial"}
