"""`python -m parallel_runtime demo`: every strategy on an embedded tiny Flux model, against serial.

Writes a small Flux-shaped checkpoint with fixed random weights (nothing is downloaded), starts CPU
workers, denoises the same job with each strategy that fits the device count, and prints seconds,
speed-up and relative error against the serial run. The tiny model is for correctness; speed is the
benchmark's business (`python -m parallel_runtime bench`).
"""
from __future__ import annotations

import argparse
import os
import tempfile

from .bench import grid, make_job, rel_err
from .client import RuntimeClient
from .models.tiny import TINY, write_checkpoint
from .spec import StrategySpec

CFG = 2.0  # > 1, so CFG parallel has an uncond branch to run
TEXT_TOKENS = 12


def demo_job(path: str, strategy: StrategySpec, size: int, steps: int):
    return make_job(path, TINY, strategy, (1, 16, size, size), TEXT_TOKENS, CFG, steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime demo", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cpu:2", help="cpu:N (default cpu:2) or GPU indices like 0,1")
    ap.add_argument("--size", type=int, default=32, help="latent height/width (pixels / 8), default 32")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="paradit-demo-") as tmp:
        path = write_checkpoint(os.path.join(tmp, "tiny-flux.safetensors"), TINY, seed=0)
        serial_client = RuntimeClient("cpu:1" if args.devices.startswith("cpu") else args.devices.split(",")[0],
                                      threads_per_worker=1)
        client = RuntimeClient(args.devices, threads_per_worker=1)
        try:
            ref = serial_client.run(demo_job(path, StrategySpec(), args.size, args.steps))  # warm-up load
            ref = serial_client.run(demo_job(path, StrategySpec(), args.size, args.steps))
            serial_client.shutdown()
            print(f"tiny Flux ({TINY.hidden_size} hidden, {TINY.num_layers}+{TINY.num_single_layers} blocks), "
                  f"latent {args.size}x{args.size}, {args.steps} steps, cfg {CFG}, euler/simple, "
                  f"devices {args.devices}")
            print(f"{'strategy':<28}{'seconds':>10}{'speed-up':>10}{'rel. error':>13}")
            print(f"{'serial (1 worker)':<28}{ref.seconds:>10.3f}{1.0:>10.2f}{0.0:>13.2e}")
            rows = grid(client.world, cfg=CFG, heads=TINY.num_heads,
                        num_blocks=TINY.num_layers + TINY.num_single_layers, latent_hw=(args.size, args.size))
            for strategy in (s for s, _ in rows if s.world_size == client.world):
                client.run(demo_job(path, strategy, args.size, args.steps))  # loads this strategy's blocks
                res = client.run(demo_job(path, strategy, args.size, args.steps))
                print(f"{strategy.label():<28}{res.seconds:>10.3f}{ref.seconds / res.seconds:>10.2f}"
                      f"{rel_err(res.latent, ref.latent):>13.2e}")
        finally:
            serial_client.shutdown()
            client.shutdown()
    return 0
