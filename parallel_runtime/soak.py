"""`python -m parallel_runtime soak`: many mixed jobs on one runtime; the workers' memory must stay flat.

A ComfyUI session sends thousands of prompts to the same workers, and the strategy may change between
any two of them (auto picks per resolution). This runs N jobs on one runtime with the tiny model,
cycling through every strategy that fits the devices (and the samplers), prints the RSS of the client
and of each worker every 10% of the way, then each worker's growth and PASS/FAIL against the target.
Growth is measured from after a warm-up (every strategy with every sampler twice: first loads, groups and
allocator high-water marks are not growth).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

TARGET_MIB_PER_1000_JOBS = 20.0  # per worker


def soak_strategies(world: int, size: int, cfg: float):
    """Every strategy of the bench grid that uses exactly `world` ranks at this latent size and holds the whole model
    per rank. Tensor parallel reads another slicing of the file, which replaces the whole one (never both resident):
    mixed with the others it reloads every job, a model switch rather than a strategy switch (measured: +23 MiB per
    worker over 240 such jobs, settling after ~150). Sharded weights (shard_weights) are another slicing too."""
    from .bench.grid import grid
    from .models.tiny import TINY

    rows = grid(world, cfg=cfg, heads=TINY.num_heads, num_blocks=TINY.num_blocks,
                latent_hw=(size, size))
    return [s for s, _ in rows if s.world_size == world and s.tensor_degree == 1 and not s.sharded]


def limit_mib(jobs: int) -> float:
    """20 MiB per worker for a run of up to 1,000 jobs, 20 MiB per 1,000 beyond: short runs get the same
    budget because allocator settling, not a per-job slope, dominates their growth."""
    return TARGET_MIB_PER_1000_JOBS * max(jobs, 1000) / 1000


def run_soak(devices: str = "cpu:2", jobs: int = 1000, size: int = 8, steps: int = 3, cfg: float = 2.0,
             say=print) -> dict:
    """Run the soak on a fresh runtime (shut down at the end); returns the record (RSS in bytes)."""
    import psutil

    from .bench.runs import make_job
    from .models.tiny import TINY, write_checkpoint
    from .runtime.client import RuntimeClient
    from .sampling import SAMPLERS

    with tempfile.TemporaryDirectory(prefix="paradit-soak-") as tmp:
        path = write_checkpoint(os.path.join(tmp, "tiny-flux.safetensors"), TINY, seed=0)
        client = RuntimeClient(devices, threads_per_worker=1)
        strategies = soak_strategies(client.world, size, cfg)

        def job(i: int):
            j = make_job(path, TINY, strategies[i % len(strategies)], (1, 16, size, size), 7, cfg, steps)
            # The sampler changes every round, so each strategy meets each sampler.
            sampler = SAMPLERS[(i // len(strategies)) % len(SAMPLERS)]
            return dataclasses.replace(j, sampling=dataclasses.replace(j.sampling, sampler_name=sampler, seed=i))

        def rss() -> tuple[int, list[int]]:
            return psutil.Process().memory_info().rss, [psutil.Process(p.pid).memory_info().rss for p in client.procs]

        samples = []

        def sample(done: int) -> None:
            mine, workers = rss()
            samples.append({"jobs": done, "client_rss": mine, "worker_rss": workers})
            say(f"{done:>7}  {_mib(mine):>10}  " + "  ".join(f"{_mib(r):>10}" for r in workers))

        try:
            warmup = 2 * len(strategies) * len(SAMPLERS)
            t0 = time.perf_counter()
            for i in range(warmup):
                client.run(job(i))
            say(f"soak: {jobs} jobs on {devices}, tiny model, latent {size}x{size}, {steps} steps, cfg {cfg}, "
                f"cycling {', '.join(s.label() for s in strategies)} x {', '.join(SAMPLERS)}; growth is "
                f"measured from after a warm-up of {warmup} jobs (every strategy with every sampler twice)")
            say(f"{'jobs':>7}  {'client MiB':>10}  " + "  ".join(f"{f'rank {r} MiB':>10}" for r in range(client.world)))
            sample(0)
            every = max(1, math.ceil(jobs / 10))
            t1 = time.perf_counter()
            for i in range(jobs):
                client.run(job(warmup + i))
                if (i + 1) % every == 0 or i + 1 == jobs:
                    sample(i + 1)
            seconds = time.perf_counter() - t1
        finally:
            client.shutdown()
    first, last = samples[0], samples[-1]
    growth = [b - a for a, b in zip(first["worker_rss"], last["worker_rss"])]
    limit = limit_mib(jobs)
    ok = max(growth) <= limit * 2**20
    say(f"growth per worker over {jobs} jobs: " + ", ".join(f"rank {r} {_mib(g, sign=True)} MiB"
                                                          for r, g in enumerate(growth))
        + f"; client {_mib(last['client_rss'] - first['client_rss'], sign=True)} MiB; {seconds:.1f} s "
        f"({1000 * seconds / max(jobs, 1):.0f} ms per job, warm-up {time.perf_counter() - t0 - seconds:.1f} s)")
    say(f"{'PASS' if ok else 'FAIL'}: worst worker {_mib(max(growth), sign=True)} MiB, target <= +{limit:.0f} MiB "
        f"per worker ({TARGET_MIB_PER_1000_JOBS:.0f} MiB per 1,000 jobs)")
    return {"devices": devices, "jobs": jobs, "size": size, "steps": steps, "cfg": cfg, "warmup_jobs": warmup,
            "strategies": [s.label() for s in strategies], "samplers": list(SAMPLERS), "samples": samples,
            "worker_growth_bytes": growth, "limit_bytes": int(limit * 2**20), "pass": ok, "seconds": seconds}


def _mib(n: int, sign: bool = False) -> str:
    return f"{n / 2**20:{'+' if sign else ''}.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu:2", help="cpu:N (default cpu:2) or GPU indices like 0,1")
    ap.add_argument("--jobs", type=int, default=1000, help="mixed jobs after the warm-up (default 1000)")
    ap.add_argument("--size", type=int, default=8, help="latent height/width (pixels / 8), default 8")
    ap.add_argument("--steps", type=int, default=3, help="sampling steps per job (default 3)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write the record (RSS in bytes) to PATH, or to stdout with no PATH (the table then "
                         "goes to stderr)")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.steps < 2:
        raise SystemExit("--jobs must be at least 1 and --steps at least 2 (PipeFusion needs a step after warm-up)")
    out = sys.stderr if args.json == "-" else sys.stdout
    record = run_soak(args.devices, args.jobs, args.size, args.steps, say=lambda t: print(t, file=out, flush=True))
    if args.json:
        text = json.dumps(record, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if record["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
