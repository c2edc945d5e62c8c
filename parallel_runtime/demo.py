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

import torch

from .client import RuntimeClient
from .errors import ConfigError
from .models.tiny import TINY, write_checkpoint
from .spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
from .topology import validate_strategy


def demo_strategies(world: int) -> list[StrategySpec]:
    """Each strategy family at `world` ranks (serial is run separately), including hybrids."""
    candidates = [
        StrategySpec(cfg_degree=2), StrategySpec(ulysses_degree=world), StrategySpec(ring_degree=world),
        StrategySpec(ulysses_degree=2, ring_degree=world // 2), StrategySpec(cfg_degree=2, ulysses_degree=world // 2),
        StrategySpec(pipefusion_degree=world, warmup_steps=1),
        StrategySpec(pipefusion_degree=world, num_pipeline_patch=2 * world, warmup_steps=1),
        StrategySpec(pipefusion_degree=2, ulysses_degree=world // 2, warmup_steps=1),
        StrategySpec(naive_patch_degree=world),
    ]
    out, seen = [], set()
    for s in candidates:
        try:
            validate_strategy(s, world_size=world)
        except ConfigError:
            continue
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def demo_job(path: str, strategy: StrategySpec, size: int = 32, steps: int = 8, cfg: float = 2.0) -> Job:
    g = torch.Generator().manual_seed(0)
    text = lambda: Conditioning(torch.randn(1, 12, TINY.context_dim, generator=g),  # noqa: E731
                                torch.randn(1, TINY.pooled_dim, generator=g), guidance=3.5)
    pos, neg = text(), text()
    return Job(ModelSpec(path), strategy, SamplingSpec(seed=42, steps=steps, cfg=cfg, sampler_name="euler",
                                                       scheduler="simple"),
               torch.zeros(1, 16, size, size), pos, neg)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


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
                  f"latent {args.size}x{args.size}, {args.steps} steps, cfg 2.0, euler/simple, "
                  f"devices {args.devices}")
            print(f"{'strategy':<28}{'seconds':>10}{'speed-up':>10}{'rel. error':>13}")
            print(f"{'serial (1 worker)':<28}{ref.seconds:>10.3f}{1.0:>10.2f}{0.0:>13.2e}")
            for strategy in demo_strategies(client.world):
                client.run(demo_job(path, strategy, args.size, args.steps))  # loads this strategy's blocks
                res = client.run(demo_job(path, strategy, args.size, args.steps))
                print(f"{strategy.label():<28}{res.seconds:>10.3f}{ref.seconds / res.seconds:>10.2f}"
                      f"{rel_error(res.latent, ref.latent):>13.2e}")
        finally:
            serial_client.shutdown()
            client.shutdown()
    return 0
