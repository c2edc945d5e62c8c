"""The cost model's projection to 2/4/8 GPUs on NVLink and PCIe, for machines the bench does not have."""
from __future__ import annotations

from ..models.families.flux import FluxConfig
from ..planning import auto, costmodel
from ..spec import StrategySpec
from .grid import CFG_PARALLEL_SCALE
from .report import fmt_table


def gpu_projection(say, config: FluxConfig, name: str, latent_shape, text: int, image_tokens: int, cfg: float,
                   tflops: float) -> list[dict]:
    """Cost-model projection to 2/4/8 GPUs on NVLink and PCIe (compute from FLOPs at `tflops`)."""
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
                cands = auto.rank_candidates(config, latent_shape, c, devs, calib, text_len=text, steps=20,
                                             memory_budget_bytes=budget)
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
