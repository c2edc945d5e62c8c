"""`bench --family ltx2` / `minimax_h3` / `kandinsky6`: the audio-video families' model call, serial against the exact
strategies, at a video shape with its audio.

Parallel Sampler does not step these families' audio stream yet (LTX2Config.not_sampled_yet,
MiniMaxH3Config.jobs_refused), so they run as ComfyUI's stock sampler drives them: one runtime job per step, each
carrying the video x (Job.latent), the audio x (Job.audio) and the step's timesteps (Job.timestep; LTX-2's audio
its own, Job.audio_timestep), cond and uncond in one call at cfg > 1 (nodes/av_call.py sends the same jobs). This
times that call for serial and CFG-2, Ulysses-2, Ring-2 and tensor-parallel-2 on the same warm workers: seconds per
call on the host (what a sampler waits), the slowest worker's own seconds, the bytes each rank sent, and where a
2-worker row loses time against serial / 2.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..errors import ConfigError
from ..spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
from .grid import CFG_PARALLEL_SCALE, row_label, subset_devices
from .measure import cpu_capacity, rel_err
from .report import fmt_table
from .runs import WarmClients

AV_FAMILIES = ("ltx2", "minimax_h3", "kandinsky6")
# The bench's sizes: >= 8,000 video + audio tokens, each family's frame grid and frame rate, its prompt length.
# LTX-2: 97 frames (ComfyUI's default length) of 1024x640 at 25 fps -> 13 x 20 x 32 = 8,320 video tokens + 97 audio
# tokens (25 audio latents a second); Gemma's prompt padded to 1,024 rows as ComfyUI's LTXAV tokenizer pads it.
# MiniMax-H3: 124 frames (its ~5 s default, 17k + 5) of 512x448 at 24 fps -> 37 latent frames x 14 x 16 patches =
# 8,288 video rows + 414 audio rows (207 latent frames at 40 a second, 2 stereo rows each); a 512-row prompt in
# front (the packed sequence is 9,214 rows). Kandinsky 6: Wan's bench video, 81 frames of 320x320 at 24 fps -> 21 x 20
# x 20 = 8,400 video tokens (2x2 patches of the HunyuanVideo latent) + 145 audio tokens; a 256-row Qwen2.5-VL prompt.
AV_SIZES = {"ltx2": dict(resolution="1024x640", frames=97, text_tokens=1024, fps=25),
            "minimax_h3": dict(resolution="512x448", frames=124, text_tokens=512, fps=24),
            "kandinsky6": dict(resolution="320x320", frames=81, text_tokens=256, fps=24)}
LTX_AUDIO_RATE = 25  # LTX-2 audio latents a second (16 kHz, hop 160, 4x downsampled)
H3_AUDIO_RATE = 40  # MiniMax-H3 audio latents a second (ComfyUI's AUDIO_LATENT_FPS)
K6_AUDIO_RATE = 217 * 24 / 121  # Kandinsky 6 audio latents a second: its 121 frames at 24 fps carry 217
SIGMA = 0.7  # one mid-schedule step; the work per call does not depend on it
# The rows: serial and each exact strategy on two workers at cfg 1 (a distilled file: no uncond), and CFG-2 against
# serial at cfg CFG_PARALLEL_SCALE (cond and uncond in one call).
EXACT_ROWS = ((StrategySpec(), 1.0), (StrategySpec(ulysses_degree=2), 1.0), (StrategySpec(ring_degree=2), 1.0),
              (StrategySpec(tensor_degree=2), 1.0), (StrategySpec(), CFG_PARALLEL_SCALE),
              (StrategySpec(cfg_degree=2), CFG_PARALLEL_SCALE))
TARGET_SPEEDUP = 1.8  # the target for exact strategies on 2 CPU workers at this shape
EXACT_RTOL = 1e-4  # exact strategies differ from serial by float32 summation order only (~1e-7 measured)


@dataclasses.dataclass(frozen=True)
class AVShape:
    video: tuple  # [1, C, T, H, W]
    audio: tuple  # LTX-2 [1, channels, frames, 16]; MiniMax-H3 [1, 32, 2, frames]
    video_tokens: int
    audio_tokens: int
    fps: int

    @property
    def tokens(self) -> int:
        return self.video_tokens + self.audio_tokens


def h3_frame_count(frames: int) -> int:
    """ComfyUI's align_frame_count: MiniMax-H3 runs 17k + 5 frames."""
    frames = max(5, frames)
    return frames + (5 - frames) % 17


def av_shape(config, width: int, height: int, frames: int, fps: int) -> AVShape:
    """The video and audio latents of `frames` frames of width x height, as ComfyUI's empty-latent nodes make them
    (EmptyLTXVLatentVideo + LTXVEmptyLatentAudio; EmptyMiniMaxH3LatentAV), and their token counts."""
    rows, cols = height // config.latent_downscale, width // config.latent_downscale
    if config.family == "kandinsky6":  # Kandinsky6EmptyLatent: 4 frames to a latent frame, 2x2 patches
        if rows % 2 or cols % 2:
            raise SystemExit(f"--resolution {width}x{height}: Kandinsky 6 needs multiples of 16 pixels")
        t, audio_frames = (frames - 1) // 4 + 1, round(frames / fps * K6_AUDIO_RATE)
        return AVShape((1, config.latent_dim, t, rows, cols), (1, audio_frames, config.audio_dim),
                       t * (rows // 2) * (cols // 2), audio_frames, fps)
    if config.family == "ltx2":
        t, audio_frames = (frames - 1) // 8 + 1, round(frames / fps * LTX_AUDIO_RATE)
        return AVShape((1, config.in_channels, t, rows, cols), (1, config.audio_in_channels // 16, audio_frames, 16),
                       t * rows * cols, audio_frames, fps)
    if rows % 2 or cols % 2:
        raise SystemExit(f"--resolution {width}x{height}: MiniMax-H3 needs multiples of 32 pixels (2 x 2 patches of "
                         f"its 16x latent)")
    count = h3_frame_count(frames)
    t = 2 if count <= 5 else (count - 5) // 17 * 5 + 2
    audio_frames = round(count / fps * H3_AUDIO_RATE)
    return AVShape((1, config.latent_channels, t, rows, cols), (1, 32, 2, audio_frames), t * (rows // 2) * (cols // 2),
                   2 * audio_frames, fps)


def call_job(path: str, config, strategy: StrategySpec, shape: AVShape, text_tokens: int, cfg: float) -> Job:
    """One stock-sampler call: both streams' x and timesteps for cond (and uncond at cfg > 1), random prompts."""
    g = torch.Generator().manual_seed(1234)
    chunks = 2 if abs(cfg - 1.0) > 1e-9 else 1
    pos, neg = (Conditioning(torch.randn(1, text_tokens, config.context_dim, generator=g),
                             torch.randn(1, config.pooled_dim, generator=g) if config.pooled_dim else torch.zeros(1, 0))
                for _ in "pn")  # Kandinsky 6 reads a pooled CLIP-L vector too
    video = torch.randn((chunks, *shape.video[1:]), generator=g)
    audio = torch.randn((chunks, *shape.audio[1:]), generator=g)
    if config.family == "ltx2":  # ComfyUI hands LTXAVModel sigmas; the audio its own (here the same step)
        timing = dict(timestep=torch.full((chunks,), SIGMA), audio_timestep=torch.full((chunks,), SIGMA),
                      extra={"frame_rate": float(shape.fps)})
    else:  # MiniMax-H3's and Kandinsky 6's model_base pass sigma x 1000
        timing = dict(timestep=torch.full((chunks,), SIGMA * 1000))
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1, cfg=cfg), video, pos, neg if chunks == 2 else None,
               audio=audio, **timing)


def _worker_cpu(procs) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in procs]


def time_calls(client, job: Job, calls: int) -> dict:
    """`calls` + 1 calls of `job` (the first loads the model and is left out): the host's median seconds per call,
    the slowest worker's median job seconds, the busiest worker's CPU seconds (user + system: the work it did, which
    other processes on a shared machine inflate far less than the wall clock; waits on a peer are not in it) and
    the bytes each rank sent per call."""
    import psutil

    procs = [psutil.Process(p.pid) for p in client.procs]
    host, worker, cpu, sent = [], [], [], []
    for i in range(calls + 1):
        t0, cpu0 = time.perf_counter(), _worker_cpu(procs)
        result = client.run(dataclasses.replace(job, call_step=i, call_last=i == calls))
        if i == 0:
            continue
        host.append(time.perf_counter() - t0)
        cpu.append(max(b - a for a, b in zip(cpu0, _worker_cpu(procs))))
        worker.append(max(st["job_seconds"] for st in result.stats))
        sent.append(max(st["traffic"]["sent"] for st in result.stats))
    return {"call_s": statistics.median(host), "worker_s": statistics.median(worker), "cpu_s": statistics.median(cpu),
            "sent_bytes": statistics.median(sent), "calls": host, "output": (result.latent, result.audio)}


def av_call_bench(say, args, path: str, config, shape: AVShape, devices: list[str], target, workers=None,
                  calib=None) -> dict:
    """Every row of EXACT_ROWS `args.repeats` times round robin (contention hits one run of a row, not all), each
    row keeping its fastest; the table, the 1.8x target and where the 2-worker rows lose time, beside the cost
    model's projection of the same call under `calib` (this machine's measured block and link)."""
    say(f"Model call of {config.title} (one runtime job per step, as ComfyUI's sampler calls it): "
        f"{shape.video_tokens} video + {shape.audio_tokens} audio tokens + {args.text_tokens} prompt rows, "
        f"{args.steps} timed calls per run after one that loads the model")
    rows = [(s, cfg) for s, cfg in EXACT_ROWS if s.world_size <= len(devices)]
    best: dict[int, dict] = {}
    with WarmClients(workers, args.threads) as clients:
        for rep in range(args.repeats):
            for idx, (s, cfg) in enumerate(rows):
                where = subset_devices(devices, args.devices, s.world_size)
                probe = s.world_size > 1 and devices[0] == "cpu" and not args.quick  # its probes take seconds
                cap = cpu_capacity(s.world_size) if probe else None
                job = call_job(path, config, s, shape, args.text_tokens, cfg)
                try:
                    res = time_calls(clients.get(where), job, args.steps)
                except ConfigError as exc:
                    say(f"[{rep + 1}/{args.repeats}] {row_label(s, cfg)}: not applicable ({exc})")
                    continue
                res["capacity"] = cap
                say(f"[{rep + 1}/{args.repeats}] {row_label(s, cfg)} on {where}: {res['call_s'] * 1e3:.0f} ms/call "
                    f"(slowest worker {res['worker_s'] * 1e3:.0f} ms)"
                    + (f", cores available to 2 workers: {cap:.2f}" if cap else ""))
                if idx not in best or res["call_s"] < best[idx]["call_s"]:
                    best[idx] = dict(res, label=row_label(s, cfg), strategy=s, cfg=cfg, cpu_s=res["cpu_s"])
                best[idx]["cpu_s"] = min(best[idx]["cpu_s"], res["cpu_s"])  # the least work any run needed
    if calib is not None:
        from ..planning import costmodel

        for r in best.values():
            proj = costmodel.project(r["strategy"], config, calib, cfg=r["cfg"], steps=1, per_call=True)
            r.update(projected_s=proj.step_s, projected_comm_s=proj.comm_s)
    return _report(say, best, target)


def _report(say, best: dict, target) -> dict:
    serial = {round(r["cfg"], 6): r for r in best.values() if r["strategy"].world_size == 1}
    headers = ["config", "s/call", "speed-up", "worker s", "host extra", "lost vs serial/2", "CPU s", "work speed-up",
               "MB sent/rank", "proj s", "proj comm", "cores", "rel err"]
    table, out = [], []
    for idx in sorted(best):
        r, base = best[idx], serial.get(round(best[idx]["cfg"], 6))
        world = r["strategy"].world_size
        speedup = base["call_s"] / r["call_s"] if base else None
        work = base["cpu_s"] / r["cpu_s"] if base else None
        # the same call's video and audio outputs against serial's: exact strategies equal it to round-off
        error = max(rel_err(got, want) for got, want in zip(r["output"], base["output"])) if base else None
        lost = r["call_s"] - base["call_s"] / world if base and world > 1 else None
        table.append([r["label"], f"{r['call_s']:.2f}", f"{speedup:.2f}x" if speedup else "-", f"{r['worker_s']:.2f}",
                      f"{(r['call_s'] - r['worker_s']) * 1e3:.0f} ms",
                      f"{lost:.2f} s ({lost / r['call_s']:.0%})" if lost is not None else "-",
                      f"{r['cpu_s']:.2f}", f"{work:.2f}x" if work else "-",
                      f"{r['sent_bytes'] / 1e6:.1f}",
                      f"{r['projected_s']:.2f}" if "projected_s" in r else "-",
                      f"{r['projected_comm_s'] * 1e3:.0f} ms" if "projected_s" in r else "-",
                      f"{r['capacity']:.2f}" if r["capacity"] else "-",
                      f"{error:.1e}" if error is not None and world > 1 else "-"])
        out.append({"label": r["label"], "strategy": r["strategy"].label(), "cfg": r["cfg"], "call_s": r["call_s"],
                    "worker_s": r["worker_s"], "speedup": speedup, "cpu_s": r["cpu_s"], "work_speedup": work,
                    "sent_bytes": r["sent_bytes"],
                    "lost_vs_ideal_s": lost, "capacity": r["capacity"], "calls": r["calls"],
                    "projected_s": r.get("projected_s"), "projected_comm_s": r.get("projected_comm_s"),
                    "ranks": world, "rel_err": error})
    say("")
    say(fmt_table(headers, table))
    say("  s/call: host seconds per model call (median of the timed calls, best run); worker s: the slowest worker's "
        "own seconds for it; host extra: sending x and the prompt, receiving the output; lost vs serial/2: seconds "
        "over a perfect split (communication, work every rank repeats, contention); CPU s: the busiest worker's CPU "
        "seconds per call (least of the runs), work speed-up: serial's over it (the speed-up an idle machine gives, "
        "less the waits on a peer); proj s / proj comm: the cost model "
        "on this machine's measured block and link (the part of it that is communication); cores: concurrent "
        "FP-bound probes' count just before that run (a shared VM gives less than 2); rel err: the call's video and "
        "audio outputs against serial's")
    exact = [o for o in out if o["ranks"] > 1 and o["speedup"]]
    wrong = [o["label"] for o in out if o["ranks"] > 1 and not o["rel_err"] < EXACT_RTOL]
    target(f"exact strategies equal serial (rel. error < {EXACT_RTOL:g})", not wrong,
           "all agree" if not wrong else "differ: " + ", ".join(wrong))
    if exact:
        worst = min(exact, key=lambda o: o["speedup"])
        target(f"exact strategies >= {TARGET_SPEEDUP}x on 2 workers at this shape (model call)",
               worst["speedup"] >= TARGET_SPEEDUP,
               ", ".join(f"{o['label']} {o['speedup']:.2f}x" for o in exact) + " (work: "
               + ", ".join(f"{o['label']} {o['work_speedup']:.2f}x" for o in exact) + ")")
    return {"rows": out, "differ_from_serial": wrong}
