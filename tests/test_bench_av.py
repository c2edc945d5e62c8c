"""The audio-video families in the bench (issue 47): their bench models and sizes, the memory plans of LTX-2.3 22B on
24 GB GPUs, and the cost model's count of LTX-2's audio stream. Arithmetic only: no workers, no timings."""
from __future__ import annotations

import pytest

from parallel_runtime.bench.av_calls import AV_SIZES, av_shape
from parallel_runtime.bench.cli import parse_args
from parallel_runtime.bench.memory_plans import GIB, memory_plans
from parallel_runtime.bench.models import BENCH_FAMILIES, RELEASE_SHAPES

pytestmark = pytest.mark.timeout(120)

# diffusers' LTX2VideoTransformer3DModel with LTX-2.3's switches at 48 blocks of 4096 / 2048: its parameter count
# (the "22B" of the file adds the text connectors and the VAEs), and one block's.
LTX23_PARAMETERS, LTX23_BLOCK = 18_988_838_144, 386_695_360


@pytest.mark.parametrize("family, video, audio", [("ltx2", 13 * 20 * 32, 97), ("minimax_h3", 37 * 14 * 16, 2 * 207),
                                                 ("kandinsky6", 21 * 20 * 20, 145)])
def test_bench_runs_the_audio_video_families_at_a_video_shape_with_audio(tmp_path, family, video, audio):
    """`bench --family ltx2 / minimax_h3 / kandinsky6`: a random model with the family's blocks that reads back as
    the same config, at >= 8,000 video + audio tokens. LTX-2: 97 frames of 1024x640 (13 latent frames of 20 x 32, 25
    audio latents a second at 25 fps); MiniMax-H3: 124 frames of 512x448 (37 latent frames of 14 x 16 patches, 40
    audio latents a second at 24 fps, two stereo rows each); Kandinsky 6: 81 frames of 320x320 (21 latent frames of
    20 x 20 patches, 217 audio latents per 121 frames: 145)."""
    from parallel_runtime.models.tiny import write_checkpoint
    from parallel_runtime.validate import model_config

    config = BENCH_FAMILIES[family]
    assert model_config(write_checkpoint(str(tmp_path / f"{family}.safetensors"), config)) == config
    args = parse_args(["--family", family])
    size = AV_SIZES[family]
    assert (args.resolution, args.frames, args.text_tokens) == (size["resolution"], size["frames"], size["text_tokens"])
    width, height = (int(v) for v in args.resolution.split("x"))
    shape = av_shape(config, width, height, args.frames, size["fps"])
    assert (shape.video_tokens, shape.audio_tokens) == (video, audio)
    assert shape.tokens >= 8000
    assert parse_args(["--family", "ltx2", "--memory-plans"]).memory_plans


def test_ltx23_22b_memory_plans_on_24_gb_gpus():
    """bf16 LTX-2.3 does not fit a 24 GB GPU where the model is replicated (CFG, Ulysses, Ring) and fits sharded over
    four (Ulysses-4 with shard_weights) or split by tensor parallelism over four; fp8 (a byte per weight) fits
    replicated at cfg 1 on two. Weight bytes are exact: whole blocks and embedders, no estimate."""
    lines: list[str] = []
    out = memory_plans(lines.append, "ltx2", 24.0)
    plans = {(p["gpus"], p["plan"]): p for p in out["plans"]}
    assert out["parameters"] == LTX23_PARAMETERS
    assert out["budget_bytes"] == int(24 * GIB * 0.9)  # memory.CUDA_USABLE of the GPU
    # Replicated: every weight on every rank, 2 bytes (bf16) or 1 (fp8).
    assert plans[(2, "ulysses2")]["weights"] == {"bf16": 2 * LTX23_PARAMETERS, "fp8": LTX23_PARAMETERS}
    # Sharded over 4: 1/4 of the 48 blocks kept, the running and the prefetched block whole, the embedders whole.
    rest = LTX23_PARAMETERS - 48 * LTX23_BLOCK
    assert plans[(4, "ulysses4+shard")]["weights"]["bf16"] == 2 * (rest + 48 * LTX23_BLOCK // 4 + 2 * LTX23_BLOCK)
    for plan in ((2, "cfg2"), (2, "ulysses2"), (2, "ring2"), (4, "ulysses4"), (4, "cfg2xulysses2")):
        assert not any(fits for key, fits in plans[plan]["fits"].items() if key.startswith("bf16")), plan
    for plan in ((4, "ulysses4+shard"), (4, "tp4"), (4, "ulysses2xtp2+shard")):
        assert all(plans[plan]["fits"].values()), plan
    assert plans[(2, "ulysses2")]["fits"]["fp8@cfg1"]
    # LTX-2's call runs PipeFusion alone or beside CFG, not inside Ulysses / Ring / TP (LTX2Config.strategy_problem)
    assert plans[(2, "pp2xM2w1")]["runs"] and plans[(2, "tp2")]["runs"]
    assert not any(p["runs"] for (gpus, label), p in plans.items() if "pp" in label and ("ulysses" in label or
                                                                                      "ring" in label or "tp" in label))
    assert any("18.99 B parameters" in line for line in lines)


def test_cost_model_counts_ltx2s_audio_stream():
    """One LTX-2.3 block's FLOPs as the cost model counts them on the meta device: each attention layer at its own
    rows (video over video, over the prompt; audio over audio, over the prompt; video over audio; audio over video)
    and width (the audio stream's for the four audio layers), and the rest equal to 2 x every matmul's weights x the
    rows through it (video rows through the video stream's, audio rows through the audio's, the prompt's rows through
    the cross-attentions' keys and values)."""
    from parallel_runtime.planning import costmodel

    for config in (BENCH_FAMILIES["ltx2"], RELEASE_SHAPES["ltx2"][0]):
        t, n = 64, 960
        a = config.audio_rows(n)
        h, ha = config.hidden_size, config.audio_hidden_size
        linear, attention = costmodel.kind_flops(config, t, n)["audio-video"]
        assert attention == (4 * n * n * h, 4 * n * t * h, 4 * a * a * ha, 4 * a * t * ha, 4 * n * a * ha,
                             4 * a * n * ha)
        # attn1 q/k/v/out, attn2 q/out, MLP 4x in and out; a2v q and out (video <-> audio width), v2a k and v
        video = (n * (4 * h * h + 2 * h * h + 8 * h * h + 2 * h * ha + 2 * h * ha)
                 + t * 2 * config.cross_attention_dim * h)
        # the same in the audio stream, a2v k and v and v2a q and out (audio width)
        audio = a * (4 + 2 + 8 + 2 + 2) * ha * ha + t * 2 * config.audio_cross_attention_dim * ha
        gates = 3 * (n * h * config.num_heads + a * ha * config.audio_heads)  # LTX-2.3's per-head gate logits
        # the counter's matmuls and this sum differ by the v2a gate's few (3e-4 measured): 0.1% covers it
        assert linear == pytest.approx(2 * (video + audio + gates), rel=1e-3)


@pytest.fixture(scope="module")
def workers(bench_workers):
    return bench_workers


@pytest.mark.parametrize("family", ["ltx2", "minimax_h3", "kandinsky6"])
def test_quick_av_bench_times_every_exact_strategy_and_each_equals_serial(family, workers, tmp_path, monkeypatch):
    """`bench --family ltx2 / minimax_h3 / kandinsky6 --quick` on the shared workers: the model call of serial,
    Ulysses-2, Ring-2, TP-2 and CFG-2, each timed and its video and audio outputs equal to serial's (the command exits
    1 otherwise)."""
    import json

    from parallel_runtime.bench.cli import main

    monkeypatch.setenv("PARADIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["--family", family, "--quick", "--text-tokens", "8", "--steps", "2", "--no-auto", "--resolution",
                 "128x128", "--json", str(out)], workers=workers) == 0
    record = json.loads(out.read_text())
    rows = {row["label"]: row for row in record["av_calls"]["rows"]}
    assert set(rows) == {"serial", "ulysses2", "ring2", "tp2", "serial@cfg3.5", "cfg2@cfg3.5"}
    # 5 frames: 5 LTX latents, 8 H3 x 2, 9 Kandinsky 6 (5 / 24 s at 43.04 a second)
    assert record["audio_tokens"] == {"ltx2": 5, "minimax_h3": 16, "kandinsky6": 9}[family]
    for label, row in rows.items():
        assert row["call_s"] > 0 and row["cpu_s"] > 0, label
        if row["ranks"] > 1:
            assert row["rel_err"] < 1e-4, (label, row["rel_err"])  # float32 summation order only
            assert row["sent_bytes"] > 0, label  # the split really exchanged rows
