"""`bench --family ltx2 --memory-plans`: memory per rank of a family's released model, plan by plan, on 2 and 4 GPUs.

From the cost model's analytic figures (costmodel.rank_memory, what check_job_memory refuses a job with): the weights
a rank holds (all of them where CFG, Ulysses and Ring replicate the model; 1/N of the blocks plus the two in flight
where they are sharded; 1/N of every block's layers under tensor parallelism; its stage's blocks under PipeFusion,
with the stale K/V of its layers) and one block's live activations on its rows. Audio tokens count as rows beside the
video's, at the video's width (LTX-2's audio stream is half as wide: a little over). bf16 and fp8 files (fp8 holds a
byte per weight and computes in bf16), at cfg 1 (a distilled file, the templates' CFGGuider 1) and at cfg 4 (a dev
file with its uncond in the same forward, or on the CFG peer). A plan fits where its total is within
memory.CUDA_USABLE of the GPU (the CUDA context, NCCL buffers and fragmentation take the rest).
"""
from __future__ import annotations

from ..planning import costmodel
from ..planning.memory import CUDA_USABLE
from ..spec import StrategySpec
from .models import RELEASE_AV_SIZES, RELEASE_AV_TEXT, RELEASE_SHAPES, runs_today
from .report import fmt_table

FILES = {"bf16": 2.0, "fp8": 1.0}  # bytes per weight; activations are bf16 in both
ACT_BYTES = 2
CFGS = (1.0, 4.0)
GIB = 2**30


def _plans(world: int) -> list[StrategySpec]:
    """Each way of spreading the model over `world` GPUs: replicated (CFG, Ulysses, Ring), sharded, tensor
    parallel, PipeFusion, and their 4-GPU hybrids."""
    s = StrategySpec
    if world == 2:
        return [s(cfg_degree=2), s(ulysses_degree=2), s(ring_degree=2), s(ulysses_degree=2, shard_weights=True),
                s(tensor_degree=2), s(pipefusion_degree=2, num_pipeline_patch=2)]
    return [s(cfg_degree=2, ulysses_degree=2), s(ulysses_degree=4), s(ring_degree=4),
            s(ulysses_degree=4, shard_weights=True), s(cfg_degree=2, ulysses_degree=2, shard_weights=True),
            s(tensor_degree=4), s(tensor_degree=2, ulysses_degree=2), s(tensor_degree=2, ulysses_degree=2,
                                                                       shard_weights=True),
            s(cfg_degree=2, tensor_degree=2), s(pipefusion_degree=4, num_pipeline_patch=4),
            s(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2)]


def plan_memory(family: str, gpus: tuple[int, ...] = (2, 4)) -> dict:
    """{"model", "size", "tokens", "plans": [...]}: per plan and GPU count, bytes per rank (weights, K/V, activations,
    total) for each file and cfg. Pure arithmetic: no weights, no devices."""
    config, name = RELEASE_SHAPES[family]
    size, frames, rows, cols, audio = RELEASE_AV_SIZES[family][-1]  # the largest released size
    video, text = frames * rows * cols, RELEASE_AV_TEXT[family]
    layout = costmodel.param_layout(config)
    plans = []
    for world in gpus:
        for s in _plans(world):
            entry = {"gpus": world, "plan": s.label(), "runs": runs_today(config, s), "weights": {}, "memory": {}}
            for cfg in CFGS:
                if s.cfg_degree > 1 and cfg == 1.0:
                    continue  # CFG parallel splits cond from uncond: nothing to split at cfg 1
                for file, per_weight in FILES.items():
                    mem = costmodel.rank_memory(s, config, text_tokens=text, image_tokens=video + audio, batch=1,
                                                cfg=cfg, weight_bytes=per_weight, act_bytes=ACT_BYTES, layout=layout)
                    entry["memory"][f"{file}@cfg{cfg:g}"] = mem
                    entry["weights"][file] = mem["params"]
            plans.append(entry)
    return {"model": name, "parameters": layout.total, "size": size, "video_tokens": video, "audio_tokens": audio,
            "text_tokens": text, "plans": plans}


def memory_plans(say, family: str, gpu_gib: float = 24.0) -> dict:
    """Print which plans fit on `gpu_gib` GPUs (the table) and return plan_memory's figures with the verdicts."""
    if family not in RELEASE_AV_SIZES:
        raise SystemExit(f"--memory-plans covers the audio-video families ({', '.join(sorted(RELEASE_AV_SIZES))}); "
                         f"give --family ltx2 or --family minimax_h3")
    out = plan_memory(family)
    budget = int(gpu_gib * GIB * CUDA_USABLE)
    out.update(gpu_gib=gpu_gib, budget_bytes=budget)
    keys = [f"{file}@cfg{cfg:g}" for cfg in CFGS for file in FILES]
    say(f"Memory per rank, {out['model']} ({out['parameters'] / 1e9:.2f} B parameters in the DiT), {out['size']}: "
        f"{out['video_tokens']:,} video + {out['audio_tokens']} audio tokens, {out['text_tokens']} prompt rows; "
        f"GPUs of {gpu_gib:g} GiB, {budget / GIB:.1f} GiB usable ({CUDA_USABLE:.0%})")
    headers = ["GPUs", "plan", "weights bf16", "weights fp8"] + [k.replace("@", " ") for k in keys]
    table = []
    for p in out["plans"]:
        mem, weights = p["memory"], [f"{p['weights'][file] / GIB:.1f}" for file in FILES]
        cells = []
        for key in keys:
            if key not in mem:
                cells.append("-")
                continue
            fits = mem[key]["total"] <= budget
            p.setdefault("fits", {})[key] = fits
            cells.append(f"{mem[key]['total'] / GIB:.1f} {'fits' if fits else 'NO'}")
        table.append([str(p["gpus"]), p["plan"] + ("" if p["runs"] else " (not run yet)")] + weights + cells)
    say(fmt_table(headers, table))
    say("  GiB per rank: weights (the DiT's parameters the rank holds), then weights + stale K/V + one block's live "
        "activations per file and cfg; fits: within the usable memory; (not run yet): a plan the runtime does not run "
        "on this model's call yet (LTX-2: PipeFusion)"
        + ("; LTX-2's text connectors (1.16 B parameters of the file) run on the host, not on the ranks"
           if family == "ltx2" else ""))
    return out
