"""`python -m parallel_runtime demo`: one prompt through every strategy on the trained demo model.

The demo model (parallel_runtime/toy, trained by this project on drawn scenes) denoises the same prompt,
seed and cfg on 1 worker and then with each strategy that fits the devices. It prints seconds, seconds per
step, speed-up and relative error against serial, and writes one PNG: every strategy's decoded image side
by side with its difference from serial (x10) under it. The exact strategies give serial's picture;
PipeFusion's stale K/V differ a little; naive patch parallel (patches that never see each other) draws two
half-pictures that do not fit together.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch

from .bench.grid import grid
from .bench.measure import cpu_capacity, rel_err, skip_steps, step_seconds
from .distributed.devices import parse_devices
from .runtime.client import RuntimeClient
from .spec import Job, ModelSpec, SamplingSpec, StrategySpec
from .toy import DEFAULT_PROMPT, MODEL_PATH, TOY_FLUX, load_companions

# 512x512 = 1024 image tokens: enough work per step on a width-256 model that 2 workers beat 1 by 1.6x or
# more; at 256x256 (256 tokens) per-op and per-message costs, which do not split, eat most of the gain.
DEFAULT_SIZE = 512
DEFAULT_STEPS = 12
CFG = 4.0  # > 1: CFG parallel has an uncond branch (the empty prompt) to put on the other worker


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu:2", help="cpu:N (default cpu:2) or GPU indices like 0,1")
    ap.add_argument("--size", type=int, default=DEFAULT_SIZE,
                    help=f"image width and height in pixels, a multiple of 16 (default {DEFAULT_SIZE})")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT,
                    help="words the demo model knows: sizes, colours, shapes, positions, backgrounds; an unknown "
                         "word is named with the vocabulary")
    ap.add_argument("--negative", default="", help="negative prompt (default: the empty prompt)")
    ap.add_argument("--cfg", type=float, default=CFG)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "paradit-demo.png"), help="the PNG to write")
    ap.add_argument("--cache", nargs="?", type=float, const=0.12, default=None, metavar="THRESHOLD",
                    help="also run serial and each exact strategy with the runtime's First-Block Cache (threshold "
                         "default 0.12; it skips more the more steps there are, e.g. --steps 50)")
    args = ap.parse_args(argv)
    if args.cache is not None and not args.cache >= 0:
        raise SystemExit(f"--cache {args.cache}: give a threshold of 0 or more")
    if args.size % 16 or args.size <= 0:
        raise SystemExit(f"--size {args.size}: use a positive multiple of 16 pixels")
    return args


def strategies(world: int, cfg: float, size: int) -> list[StrategySpec]:
    """bench's grid at exactly `world` ranks, PipeFusion with its default patch count (one per stage)."""
    rows = grid(world, cfg=cfg, heads=TOY_FLUX.num_heads, num_blocks=TOY_FLUX.num_blocks,
                latent_hw=(size // 8, size // 8))
    return [s for s, _ in rows if s.world_size == world
            and (s.pipefusion_degree == 1 or s.num_pipeline_patch == s.pipefusion_degree)]


def with_cache(rows: list[StrategySpec], threshold: float | None) -> list[StrategySpec]:
    """`rows`, each followed by its First-Block-Cache twin where a threshold is given and the strategy takes the
    cache (not PipeFusion)."""
    if threshold is None:
        return rows
    cached = dict(cache="first_block", cache_threshold=threshold)
    return [t for s in rows for t in ([s, dataclasses.replace(s, **cached)] if s.pipefusion_degree == 1 else [s])]


def timed(client: RuntimeClient, job: Job) -> dict:
    res = client.run(job)
    return {"latent": res.latent, "seconds": max(st["job_seconds"] for st in res.stats),
            "step_s": step_seconds(res.stats, skip_steps(job.strategy))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    codec, text = load_companions()
    positive, negative = text.encode(args.prompt, args.size, args.size), text.encode(args.negative, args.size, args.size)
    latent = torch.zeros(1, 16, args.size // 8, args.size // 8)

    def job(strategy: StrategySpec) -> Job:
        return Job(ModelSpec(MODEL_PATH), strategy, SamplingSpec(seed=args.seed, steps=args.steps, cfg=args.cfg),
                   latent, positive, negative)

    devices = parse_devices(args.devices)
    cpu = devices[0] == "cpu"
    cores = f"; {len(devices)} concurrent CPU-bound processes got {cpu_capacity(len(devices)):.2f} cores just now" \
        if cpu and len(devices) > 1 else ""
    print(f"demo model {os.path.relpath(MODEL_PATH)} (Flux-shaped: width {TOY_FLUX.hidden_size}, "
          f"{TOY_FLUX.num_layers} double + {TOY_FLUX.num_single_layers} single blocks)")
    print(f'prompt "{args.prompt}", negative "{args.negative}", cfg {args.cfg:g}, seed {args.seed}, '
          f"{args.size}x{args.size} px ({(args.size // 16) ** 2} image tokens), {args.steps} steps euler/simple")
    print(f"serial: 1 worker; parallel: {args.devices}, 1 torch thread per worker{cores}")

    rows = []
    serial_client = RuntimeClient("cpu:1" if cpu else args.devices.split(",")[0], threads_per_worker=1)
    try:
        for strategy in with_cache([StrategySpec()], args.cache):
            rows.append((strategy, timed(serial_client, job(strategy))))
    finally:
        serial_client.shutdown()
    client = RuntimeClient(args.devices, threads_per_worker=1)
    try:
        for strategy in with_cache(strategies(client.world, args.cfg, args.size), args.cache):
            rows.append((strategy, timed(client, job(strategy))))
    finally:
        client.shutdown()

    ref = rows[0][1]
    print(f"\n{'strategy':<28}{'seconds':>9}{'s/step':>9}{'speed-up':>10}{'rel. error':>12}")
    for strategy, r in rows:
        r["speedup"], r["error"] = ref["seconds"] / r["seconds"], rel_err(r["latent"], ref["latent"])
        print(f"{strategy.label():<28}{r['seconds']:>9.2f}{r['step_s']:>9.3f}{r['speedup']:>9.2f}x{r['error']:>12.1e}")

    images = [codec.decode_comfy_latent(r["latent"])[0] for _, r in rows]
    sheet = _sheet(images, rows, args)
    sheet.save(args.out)
    print(f"\npicture: {args.out}")
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s (worker start-up and model loads included)")
    return 0


def _sheet(images, rows, args):
    from .toy.sheet import contact_sheet

    titles = [s.label() for s, _ in rows]
    notes = [f"{r['seconds']:.1f} s, {r['speedup']:.2f}x, err {r['error']:.0e}" for _, r in rows]
    caption = f'"{args.prompt}"  cfg {args.cfg:g}  seed {args.seed}  {args.steps} steps  {args.devices}'
    return contact_sheet(images, titles, notes, images[0], caption)
