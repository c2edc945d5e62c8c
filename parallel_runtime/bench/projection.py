"""The cost model's projection to 2/4/8 GPUs on NVLink and PCIe, for machines the bench does not have."""
from __future__ import annotations

from ..models.families.flux import FluxConfig
from ..planning import auto, costmodel
from ..spec import StrategySpec
from .grid import CFG_PARALLEL_SCALE
from .report import fmt_table

# xDiT's published HunyuanVideo latencies, Ulysses, H100, seconds end to end (1280x720, 129 frames, 50 steps):
# xdit-project/xDiT docs/performance/hunyuanvideo.md (last changed in commit 57eb27fb, Dec 2024). The same docs
# folder has no Wan figures (checked at commit 175e0bfe), so none are shown for Wan.
XDIT_HUNYUANVIDEO_720P_H100 = {1: 1904.08, 2: 925.04, 4: 514.08, 8: 337.58}
# HunyuanVideo's latent at that size: 33 latent frames x 45 x 80 tokens (its VAE is 4x temporal, 16 px per token).
XDIT_HUNYUANVIDEO_TOKENS = 33 * 45 * 80


def gpu_projection(say, config: FluxConfig, name: str, latent_shape, text: int, image_tokens: int, cfg: float,
                   tflops: float, runs=lambda strategy: True) -> list[dict]:
    """Cost-model projection to 2/4/8 GPUs on NVLink and PCIe (compute from FLOPs at `tflops`), over the plans
    `runs` accepts (those the runtime runs for this model)."""
    lin, att = costmodel.block_flops(config, text, image_tokens)
    say(f"Projection for 2/4/8 GPUs, {name}, {image_tokens} + {text} tokens, bf16: per block "
        f"{(lin + att) / 1e9:.0f} GFLOP ({att / (lin + att):.0%} attention) at {tflops:.0f} TFLOP/s (assumed) = "
        f"{((lin + att) / (tflops * 1e12) + costmodel.GPU_BLOCK_OVERHEAD_S) * 1e3:.2f} ms; links: "
        + ", ".join(f"{k} {bw / 1e9:.0f} GB/s + {lat * 1e6:.0f} us" for k, (bw, lat) in costmodel.LINKS.items())
        + f"; work on r rows costs like r + {costmodel.GPU_FIXED_ROWS} rows (assumed); 20 steps, PipeFusion with "
        f"1 warm-up step; 80 GB per GPU; speed-ups against 1 GPU at the same cfg")
    cfg_hi = cfg if abs(cfg - 1.0) > 1e-9 else CFG_PARALLEL_SCALE
    headers = ["GPUs", "link", f"best at cfg {cfg:g}", "speed-up", "ulysses-N", "ring-N", "pipefusion-N"]
    if cfg_hi != cfg:
        headers += [f"best at cfg {cfg_hi:g}", "speed-up "]
    rows, out = [], []
    budget = 80 * 2**30
    for n in (2, 4, 8):
        for link in costmodel.LINKS:
            calib = costmodel.gpu_calibration(config, text, image_tokens, link, tflops=tflops)
            devs = [f"cuda:{i}" for i in range(n)]
            row = [str(n), link]
            for c in ((cfg, cfg_hi) if cfg_hi != cfg else (cfg,)):
                serial = costmodel.project(StrategySpec(), config, calib, cfg=c, steps=20, act_bytes=2)
                cands = [x for x in auto.rank_candidates(config, latent_shape, c, devs, calib, text_len=text, steps=20,
                                                         memory_budget_bytes=budget) if runs(x.strategy)]
                best = auto.pick(cands)
                row += [best.strategy.label() if best else "-",
                        f"{serial.job_s / best.projection.job_s:.2f}x" if best else "-"]
                if c == cfg:
                    for pred in (lambda s: s.ulysses_degree == n, lambda s: s.ring_degree == n,
                                 lambda s: s.pipefusion_degree == n):
                        m = [x for x in cands if pred(x.strategy) and x.fits]
                        row.append(f"{serial.job_s / min(x.projection.job_s for x in m):.2f}x" if m else "-")
            rows.append(row)
            out.append(dict(zip(headers, row)))
    say(fmt_table(headers, rows))
    return out


def video_projection(say, config, name: str, sizes, text: int, cfg: float, tflops: float) -> list[dict]:
    """`gpu_projection` at each released video size (name, latent frames, rows, columns); the rows say their size.
    A video's frames stack their token rows (topology.latent_plane), so the projection sees a frames*rows plane."""
    from ..models.registry import family_of

    out, p = [], family_of(config).adapter_class.patch
    for size, frames, rows, cols in sizes:
        plane = (1, config.latent_channels, frames * rows, cols)
        tokens = frames * (rows // p) * (cols // p)
        out += [dict(row, size=size) for row in
                gpu_projection(say, config, f"{name}, {size}", plane, text, tokens, cfg, tflops)]
    return out


def xdit_published(say) -> dict:
    """xDiT's published HunyuanVideo figures, for beside a video projection (measured there, projected here)."""
    base = XDIT_HUNYUANVIDEO_720P_H100[1]
    speedups = {n: base / s for n, s in XDIT_HUNYUANVIDEO_720P_H100.items()}
    say(f"xDiT's published HunyuanVideo figures beside it (docs/performance/hunyuanvideo.md: 1280x720, 129 frames, "
        f"50 steps, {XDIT_HUNYUANVIDEO_TOKENS:,} tokens, Ulysses on H100, measured end to end): "
        + ", ".join(f"{n} GPU{'s' if n > 1 else ''} {s:.0f} s ({speedups[n]:.2f}x)"
                    for n, s in XDIT_HUNYUANVIDEO_720P_H100.items())
        + "; a different 13B model, so a reference, not a target; xDiT publishes no Wan figures there")
    return {"source": "xdit-project/xDiT docs/performance/hunyuanvideo.md", "model": "HunyuanVideo",
            "size": "1280x720, 129 frames, 50 steps", "tokens": XDIT_HUNYUANVIDEO_TOKENS, "strategy": "Ulysses",
            "gpu": "H100", "latency_s": XDIT_HUNYUANVIDEO_720P_H100, "speedup": speedups}


def av_projection(say, family: str, cfg: float, tflops: float) -> list[dict]:
    """`gpu_projection` of an audio-video family's released model at its released sizes, audio tokens counted:
    MiniMax-H3's audio rows are rows of its one packed sequence, so they join the video's; LTX-2's audio stream is
    its own, which the cost model's audio-video block counts beside the video (LTX2Config.audio_rows)."""
    from ..models.registry import family_of
    from .models import RELEASE_AV_SIZES, RELEASE_AV_TEXT, RELEASE_SHAPES, runs_today

    config, name = RELEASE_SHAPES[family]
    adapter, text = family_of(config).adapter_class, RELEASE_AV_TEXT[family]
    two_streams, p = getattr(adapter, "two_streams", False), adapter.patch
    def runs(s):  # the plans the family's model call runs (LTX-2: PipeFusion alone or beside CFG)
        return runs_today(config, s)

    out = []
    for size, frames, rows, cols, audio in RELEASE_AV_SIZES[family]:
        video = frames * rows * cols
        tokens = video if two_streams else video + audio
        counted = costmodel.audio_rows(config, video) if two_streams else audio
        plane = (1, config.latent_channels, frames * rows * p, cols * p)
        label = (f"{name}, {size}: {video:,} video + {audio} audio tokens"
                 + (f" (the cost model counts {counted} audio rows, video / 48)" if two_streams else
                    " in one packed sequence"))
        out += [dict(row, size=size, video_tokens=video, audio_tokens=audio) for row in
                gpu_projection(say, config, label, plane, text, tokens, cfg, tflops, runs)]
    if two_streams:
        say("  LTX-2's model call runs CFG, Ulysses, Ring, tensor parallelism, sharded weights and PipeFusion (alone or "
            "beside CFG, not inside Ulysses, Ring or tensor parallelism yet): the plans above are those")
    return out
