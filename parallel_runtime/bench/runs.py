"""Running one configuration: a job on fresh workers, a stock sampler's model calls, the in-process serial
reference without the runtime, and PipeFusion's bubble under a stock sampler."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ..planning import costmodel
from ..spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
from .grid import subset_devices
from .measure import RssSampler, skip_steps, step_seconds


def make_job(path: str, config, strategy: StrategySpec, latent_shape, text_tokens: int, cfg: float,
             steps: int, conditioning: tuple[Conditioning, Conditioning] | None = None) -> Job:
    """`conditioning`: (positive, negative) of a real prompt; random tokens of `text_tokens` otherwise."""
    g = torch.Generator().manual_seed(1234)
    pos, neg = conditioning or (random_prompt(config, text_tokens, g), random_prompt(config, text_tokens, g))
    inputs = getattr(config, "random_inputs", None)  # what a variant's node adds beside the prompt (Wan Animate)
    if inputs is not None:
        pos, neg = (dataclasses.replace(c, **inputs(latent_shape, g, negative)) for c, negative in ((pos, False),
                                                                                                   (neg, True)))
    return Job(ModelSpec(path), strategy, SamplingSpec(seed=7, steps=steps, cfg=cfg), torch.zeros(latent_shape),
               pos, neg if abs(cfg - 1.0) > 1e-9 else None)


def random_prompt(config, text_tokens: int, g: torch.Generator) -> Conditioning:
    """Random prompt rows of the model's width and its pooled vector (pooled_dim 0: T5-only families); a model whose
    blocks read Llama layers of the prompt (HiDream) gets those too, over as many tokens; a model whose prompt is
    token ids (HiDream O1) makes its own (`random_prompt`)."""
    own = getattr(config, "random_prompt", None)
    rows = own(text_tokens, g) if own else torch.randn(1, text_tokens, config.context_dim, generator=g)
    c = Conditioning(rows, torch.randn(1, config.pooled_dim, generator=g), 3.5)
    if getattr(config, "llama_dim", None):
        layers = max(config.llama_layers) + 1
        c = dataclasses.replace(c, llama=torch.randn(1, layers, text_tokens, config.llama_dim, generator=g))
    return c


class WarmClients:
    """Runtime clients by device string for a bench's rows: a caller's pool (`workers`, left running) or clients
    made here and shut down when the bench ends. `get` starts a row's workers outside its timed runs."""

    def __init__(self, workers: dict | None, threads: int):
        self.clients, self.own, self.threads = (workers if workers is not None else {}), workers is None, threads

    def get(self, where: str):
        from ..runtime.client import RuntimeClient

        if where not in self.clients:
            self.clients[where] = RuntimeClient(where, threads_per_worker=self.threads)
        self.clients[where].start()
        return self.clients[where]

    def __enter__(self) -> "WarmClients":
        return self

    def __exit__(self, *exc) -> None:
        if self.own:
            for client in self.clients.values():
                client.shutdown()


def run_config(devices: str, job: Job, threads: int, client=None) -> dict:
    """Run `job` once on fresh workers (so peak RSS is this configuration's alone), or on `client`'s (--quick: the
    RSS then includes what earlier rows left)."""
    from ..runtime.client import RuntimeClient

    own = client is None
    if own:
        client = RuntimeClient(devices, threads_per_worker=threads)
    try:
        client.start()
        with RssSampler(client) as sampler:
            idle = sampler.rss()
            result = client.run(job)
            peak = list(sampler.peak)
        peak = [max(p, r) for p, r in zip(peak, sampler.rss())]
    finally:
        if own:
            client.shutdown()
    stats = result.stats
    skip = skip_steps(job.strategy)
    return {"latent": result.latent, "stats": stats, "step_s": step_seconds(stats, skip),
            "cpu_step_s": step_seconds(stats, skip, "step_cpu"),
            "job_s": max(st["job_seconds"] for st in stats), "client_s": result.seconds,
            "load_s": max(st["load_seconds"] for st in stats), "idle_rss": idle, "peak_rss_psutil": peak}


def run_calls(path: str, config, latent_shape, text_tokens: int, cfg: float, steps: int, threads: int,
              strategy: StrategySpec = StrategySpec(), devices: str = "cpu:1", control: tuple = (),
              stats: list | None = None, client=None) -> list[float]:
    """A stock sampler's way in: `steps` model calls (one per step, cond and uncond batched as ComfyUI batches
    them at cfg > 1), each a runtime job from this process. Seconds per call, leaving out the first (which loads
    the model) and PipeFusion's warm-up calls. `control`: ControlInputs every branch carries; `stats`: gets each
    timed call's per-rank stats; `client`: warm workers on `devices` to run on (left running), else fresh ones."""
    from ..runtime.client import RuntimeClient

    template = make_job(path, config, strategy, latent_shape, text_tokens, cfg, steps)
    if control:
        template = dataclasses.replace(
            template, positive=dataclasses.replace(template.positive, control=control),
            negative=template.negative and dataclasses.replace(template.negative, control=control))
    chunks = 2 if template.negative is not None else 1
    x = torch.randn((chunks * latent_shape[0], *latent_shape[1:]), generator=torch.Generator().manual_seed(3))
    call = dataclasses.replace(template, sampling=SamplingSpec(steps=1), latent=x,
                               timestep=torch.full((x.shape[0],), 0.5))
    skip = max(1, strategy.warmup_steps if strategy.stale_steps else 1)
    owned = client is None
    client = RuntimeClient(devices, threads_per_worker=threads) if owned else client
    try:
        times = []
        for i in range(steps + skip):
            t0 = time.perf_counter()
            result = client.run(dataclasses.replace(call, call_step=i, call_last=i == steps + skip - 1))
            times.append(time.perf_counter() - t0)
            if stats is not None and i >= skip:
                stats.append(result.stats)
    finally:
        if owned:
            client.shutdown()
    return times[skip:]


def pipefusion_per_call(say, args, path, config, latent_shape, text: int, results: list[dict], calib,
                        devices: list[str], clients=None) -> dict | None:
    """The bubble of PipeFusion under a stock sampler: the best PipeFusion row of Parallel Sampler's grid, run
    again as one model call per step (its pipeline fills and drains every call). `clients(where)`: warm workers
    on those devices (--quick's pool), else None (fresh ones)."""
    rows = [r for r in results if r["strategy"].pipefusion_degree > 1 and abs(r["cfg"] - args.cfg) < 1e-9]
    if not rows:
        return None
    row = min(rows, key=lambda r: r["step_s"])
    s, world = row["strategy"], row["strategy"].world_size
    where = subset_devices(devices, args.devices, world)
    calls = run_calls(path, config, latent_shape, text, args.cfg, args.steps, args.threads, s, where,
                      client=clients and clients(where))
    call_s = statistics.median(calls)
    out = {"label": row["label"], "parallel_sampler_step_s": row["step_s"], "per_call_s": call_s,
           "bubble": call_s / row["step_s"] - 1}
    if calib is not None:
        out["projected_per_call_s"] = costmodel.project(s, config, calib, cfg=args.cfg, steps=args.steps,
                                                        batch=latent_shape[0], per_call=True).step_s
    projected = (f"; cost model {out['projected_per_call_s'] * 1e3:.0f} ms" if "projected_per_call_s" in out else "")
    say(f"PipeFusion under a stock sampler ({row['label']}): {call_s * 1e3:.0f} ms per call vs Parallel Sampler's "
        f"{row['step_s'] * 1e3:.0f} ms per step: the per-call pipeline's bubble costs {out['bubble']:+.0%}{projected}")
    return out


def run_in_process(path: str, latent_shape, text_tokens: int, cfg: float, steps: int, threads: int) -> float:
    """The serial reference without the runtime: the same Denoiser called in-process (no workers, no IPC,
    no process group), in a fresh interpreter with the workers' thread settings so that only the runtime
    differs. Returns the median seconds per step after the first."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    spec = json.dumps({"path": path, "latent_shape": list(latent_shape), "text_tokens": text_tokens, "cfg": cfg,
                       "steps": steps, "threads": threads})
    proc = subprocess.run([sys.executable, "-m", "parallel_runtime.bench", "--in-process-reference", spec],
                          capture_output=True, text=True, env=env, cwd=root, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"in-process reference failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def in_process_reference(spec: dict) -> None:
    from ..models.registry import read_model
    from ..distributed.comm import Comm
    from ..distributed.topology import Topology
    from ..strategies.attention.processor import AttentionContext
    from ..strategies.denoise import Denoiser
    from ..weights.checkpoint import open_checkpoint

    torch.set_num_threads(spec["threads"])
    with open_checkpoint(spec["path"]) as reader:
        family, match, config = read_model(reader)
        model = family.build(config, reader, match, owned=lambda name: True, dtype=torch.float32, device="cpu")
    ctx = AttentionContext()
    adapter = family.adapter(config, model, family.pipeline_stages(config, 1)[0], ctx)
    job = make_job(spec["path"], config, StrategySpec(), tuple(spec["latent_shape"]), spec["text_tokens"],
                   spec["cfg"], spec["steps"])
    d = Denoiser(adapter, Topology(), Comm(Topology()), ctx)
    d.run(job)
    times = d.step_times
    print(statistics.median(times[1:] if len(times) > 1 else times), flush=True)
