"""`bench --entrances`: the runtime's two entrances on the same warm workers, strategy by strategy, at equal work.

Parallel Sampler sends one job and the workers run the step loop (strategies/denoise.py: PipeFusion pipelines
across steps there). KSampler on Load Parallel DiT's MODEL keeps the loop on the host and calls the workers once
per model evaluation (nodes/remote_model.py, strategies/model_call.py); `sample_by_calls` is that host loop, sending
the jobs RemoteDiT.forward sends: x input-scaled, the model's timestep per row, cond and uncond chunks in one call
at cfg > 1, call_step / call_last from the schedule. Both run the same seed, steps, sampler, scheduler and cfg, so
their latents agree: exact strategies to float32 round-off, PipeFusion too once warmed up (its per-call stale K/V
is as old as the cross-step pipeline's: one evaluation), so any larger difference is a bug, not noise.

Times, host wall clock, the model load the workers report left out: `run` is the whole sampling run over its
steps (what a user waits, warm-up steps included); `steady` is the median step after warm-up (Parallel Sampler:
the slowest rank's own step times; per call: the host's time per call); `cpu` is the work done (_Clock). Each
entrance keeps its best of `--repeats`: contention on a shared machine only ever adds time, so the fastest run is
the closest to the cost itself, and the entrances alternate which goes first so that neither always runs after the
other.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..errors import ConfigError
from ..distributed.topology import latent_plane
from ..sampling import cfg_combine, final_latent, ksampler_sigmas, make_sampler, prepare_noise, start_latent
from ..spec import Job, SamplingSpec, StrategySpec
from .grid import grid, row_label, subset_devices
from .measure import cpu_capacity, rel_err, skip_steps, step_seconds
from .report import fmt_table
from .runs import WarmClients, make_job

TARGET_SAME_STRATEGY = 0.02  # Parallel Sampler at most 2% slower than the per-call loop on the same strategy
TARGET_PIPEFUSION = 1.08  # PipeFusion's cross-step pipeline at least 1.08x faster per step than its per-call one
# The two entrances redo the same float32 maths, the host loop in another order for the sampler (~1e-7); a wrong
# timestep unit, chunk order, input scaling or stale K/V age is off by 1e-3 or more.
AGREE_RTOL = 1e-4
# Serial, and each strategy at 2 workers that the MODEL path and Parallel Sampler both run (PipeFusion with the
# Strategy Selector's default M = N patches and one warm-up step).
DEFAULT_STRATEGIES = (StrategySpec(), StrategySpec(cfg_degree=2), StrategySpec(ulysses_degree=2),
                      StrategySpec(ring_degree=2), StrategySpec(pipefusion_degree=2, num_pipeline_patch=2))


def host_sampling(config):
    """The family's model_sampling and latent format, as the workers' adapter has them, read off a model on the
    meta device (no weights here)."""
    from ..models.registry import family_of
    from ..strategies.attention.processor import AttentionContext

    family = family_of(config)
    adapter = family.adapter(config, family.meta_model(config), family.pipeline_stages(config, 1)[0],
                             AttentionContext())
    return adapter.model_sampling, adapter.latent_format


def sample_by_calls(client, job: Job, model_sampling, latent_format) -> dict:
    """KSampler's loop on the host over `job`'s inputs: one runtime call per step. Returns the final latent as
    KSampler returns it, each call's seconds, and the model load the workers reported."""
    sp, ms = job.sampling, model_sampling
    sigmas = ksampler_sigmas(ms, sp.scheduler, sp.steps, sp.denoise)
    x = start_latent(job.latent.float(), prepare_noise(job.latent, sp.seed), sigmas[0], latent_format, ms)
    sampler = make_sampler(sp.sampler_name, sigmas, sp.seed, job.latent.shape, prediction=ms.prediction)
    chunks = 1 if job.negative is None else 2  # ComfyUI drops the uncond at cfg 1
    steps = len(sigmas) - 1
    times, load = [], 0.0
    for i in range(steps):
        sigma = sigmas[i]
        x_in = torch.cat([ms.calculate_input(sigma, x)] * chunks)
        call = dataclasses.replace(job, sampling=SamplingSpec(steps=1), latent=x_in,
                                   timestep=ms.timestep(sigma.expand(x_in.shape[0])).float(),
                                   call_step=i, call_slot=0, call_last=i == steps - 1)
        t0 = time.perf_counter()
        result = client.run(call)
        times.append(time.perf_counter() - t0)
        load += loaded_seconds(result.stats)
        den = [ms.calculate_denoised(sigma, out, x) for out in result.latent.chunk(chunks)]
        x = sampler.step(i, x, cfg_combine(den[0], den[1] if chunks == 2 else None, sp.cfg))
    return {"latent": final_latent(x, sigmas[-1], latent_format, ms), "call_s": times, "load_s": load}


def loaded_seconds(stats: list[dict]) -> float:
    """The model load this job waited for (0 when the workers had the model: they report their last load)."""
    return max((st["load_seconds"] for st in stats if st.get("loaded")), default=0.0)


class _Clock:
    """Wall seconds and CPU seconds (user + system of the workers and of this process, the host's loop) of one
    entrance's run. CPU time is the work done: other processes on a shared machine inflate it far less than the
    wall time, so it shows extra work per step (copies, re-embedding) where the wall clock is all noise. It does
    not show what waits cost (PipeFusion's bubble): that is the wall clock's."""

    def __init__(self, client):
        import psutil

        self.procs = [psutil.Process(p.pid) for p in client.procs]

    def _cpu(self) -> float:
        return time.process_time() + sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, self._cpu() - self.cpu


def _timed_job(client, job: Job) -> dict:
    """Parallel Sampler's entrance: the whole denoise as one job."""
    with _Clock(client) as clock:
        result = client.run(job)
    load, steps = loaded_seconds(result.stats), job.sampling.steps
    return {"latent": result.latent, "run_s": (clock.wall - load) / steps, "cpu_s": clock.cpu / steps,
            "steady_s": step_seconds(result.stats, skip_steps(job.strategy)), "load_s": load}


def _timed_calls(client, job: Job, sampling) -> dict:
    """The stock sampler's entrance, timed the same way (its host loop's own maths included)."""
    with _Clock(client) as clock:
        out = sample_by_calls(client, job, *sampling)
    calls, skip = out["call_s"], skip_steps(job.strategy)
    return {"latent": out["latent"], "run_s": (clock.wall - out["load_s"]) / len(calls),
            "cpu_s": clock.cpu / len(calls), "load_s": out["load_s"],
            "steady_s": statistics.median(calls[skip:] if len(calls) > skip else calls)}


def entrance_rows(args, config, latent_shape, max_world: int) -> list[tuple[StrategySpec, float]]:
    """(strategy, cfg) rows of the bench's grid: serial at --cfg and DEFAULT_STRATEGIES' 2-worker rows (CFG-2 at
    cfg > 1), or those --configs names ("serial" among them)."""
    from ..models.registry import token_patch

    rows = grid(max_world, cfg=args.cfg, heads=config.num_heads, num_blocks=config.num_blocks,
                latent_hw=latent_plane(latent_shape[2:]), patch=token_patch(config), tensor=False)
    rows = [r for r in rows if r[0].world_size > 1 or abs(r[1] - args.cfg) < 1e-9]  # one serial row, at --cfg
    if args.configs:
        wanted = set(args.configs.split(","))
        return [r for r in rows if r[0].label() in wanted or row_label(*r) in wanted]
    return [r for r in rows if r[0] in DEFAULT_STRATEGIES]


def entrances_bench(say, args, path: str, config, latent_shape, text: int, devices: list[str], target,
                    workers: dict | None = None, conditioning=None) -> dict:
    """Both entrances per row, `args.repeats` times each, on one set of warm workers per device count (`workers`:
    a caller's pool, left running; else started here and shut down). Prints the table and the targets' lines."""
    sampling = host_sampling(config)
    rows = entrance_rows(args, config, latent_shape, len(devices))
    probe = devices[0] == "cpu" and not args.quick and len(devices) > 1
    record = {"steps": args.steps, "sampler": "euler", "scheduler": "simple", "repeats": args.repeats,
              "best_of": "fastest run per entrance", "rows": [], "not_applicable": [],
              "cores_before": cpu_capacity(len(devices)) if probe else None}
    serial: dict[float, torch.Tensor] = {}  # Parallel Sampler's serial latent by cfg: how far each row is from exact
    with WarmClients(workers, args.threads) as clients:
        for s, cfg in rows:
            where = subset_devices(devices, args.devices, s.world_size)
            client = clients.get(where)  # the workers' start-up is in neither entrance's time
            job = make_job(path, config, s, latent_shape, text, cfg, args.steps, conditioning)
            try:
                # One untimed model evaluation loads the model under this strategy and builds its process groups,
                # so the row's first timed run, whichever entrance it is, starts as warm as the others.
                sample_by_calls(client, dataclasses.replace(job, sampling=dataclasses.replace(
                    job.sampling, steps=1)), *sampling)
                row = _measure_row(say, client, job, sampling, args.repeats)
            except ConfigError as exc:  # a row the runtime refuses is reported, and the others go on
                say(f"  {row_label(s, cfg)}: not applicable ({exc})")
                record["not_applicable"].append({"label": row_label(s, cfg), "reason": str(exc)})
                continue
            latent = row.pop("latent")
            if s.world_size == 1:
                serial[round(cfg, 6)] = latent
            ref = serial.get(round(cfg, 6))
            record["rows"].append(dict(row, label=row_label(s, cfg), strategy=s.to_json(), cfg=cfg,
                                       ranks=s.world_size, exact=s.exact, devices=where,
                                       rel_err_vs_serial=rel_err(latent, ref) if ref is not None else None))
    record["cores_after"] = cpu_capacity(len(devices)) if probe else None
    _report(say, record, target)
    return record


def _measure_row(say, client, job: Job, sampling, repeats: int) -> dict:
    label = row_label(job.strategy, job.sampling.cfg)
    runs: dict[str, list[dict]] = {"parallel_sampler": [], "per_call": []}
    diffs = []
    for rep in range(repeats):
        order = ("parallel_sampler", "per_call") if rep % 2 == 0 else ("per_call", "parallel_sampler")
        got = {}
        for entrance in order:
            got[entrance] = _timed_job(client, job) if entrance == "parallel_sampler" else \
                _timed_calls(client, job, sampling)
        ps, calls = got["parallel_sampler"], got["per_call"]
        diffs.append(rel_err(calls["latent"].reshape(ps["latent"].shape), ps["latent"]))
        for entrance, res in got.items():
            runs[entrance].append({k: res[k] for k in ("run_s", "steady_s", "cpu_s", "load_s")})
        say(f"[{rep + 1}/{repeats}] {label}: Parallel Sampler {ps['run_s'] * 1e3:.0f} ms/step "
            f"(steady {ps['steady_s'] * 1e3:.0f}), per call {calls['run_s'] * 1e3:.0f} ms/step "
            f"(steady {calls['steady_s'] * 1e3:.0f}); CPU {ps['cpu_s']:.2f} vs {calls['cpu_s']:.2f} s/step; "
            f"latents differ by {diffs[-1]:.1e}")
    best = {entrance: {key: min(r[key] for r in rs) for key in ("run_s", "steady_s", "cpu_s")}
            for entrance, rs in runs.items()}
    ps, calls = best["parallel_sampler"], best["per_call"]
    return {"parallel_sampler": dict(ps, runs=runs["parallel_sampler"]), "per_call": dict(calls, runs=runs["per_call"]),
            "ratio_run": calls["run_s"] / ps["run_s"], "ratio_steady": calls["steady_s"] / ps["steady_s"],
            "ratio_cpu": calls["cpu_s"] / ps["cpu_s"],
            "rel_diff": max(diffs), "rel_diffs": diffs, "latent": got["parallel_sampler"]["latent"]}


HEADERS = ["strategy", "parallel sampler s/step", "per-call s/step", "ratio", "steady PS", "steady per call",
           "steady ratio", "CPU PS", "CPU per call", "CPU ratio", "max rel diff", "PS vs serial"]
NOTE = ("  ratio: per call / Parallel Sampler (> 1: Parallel Sampler faster). s/step: the whole warm run over its "
        "steps (warm-up steps included, model load left out); steady: median step after warm-up (Parallel Sampler: the "
        "slowest rank's step; per call: the host's time per call); CPU: user + system seconds per step of the workers "
        "and this process (the work done, which contention inflates far less than wall time); max rel diff: the two "
        "entrances' latents, rel. L2, worst repeat; PS vs serial: Parallel Sampler's latent against serial's")


def _table_row(r: dict) -> list[str]:
    ps, calls = r["parallel_sampler"], r["per_call"]
    vs_serial = r["rel_err_vs_serial"]
    return [r["label"], f"{ps['run_s']:.3f}", f"{calls['run_s']:.3f}", f"{r['ratio_run']:.3f}",
            f"{ps['steady_s']:.3f}", f"{calls['steady_s']:.3f}", f"{r['ratio_steady']:.3f}",
            f"{ps['cpu_s']:.2f}", f"{calls['cpu_s']:.2f}", f"{r['ratio_cpu']:.3f}", f"{r['rel_diff']:.1e}",
            "-" if r["ranks"] == 1 or vs_serial is None else f"{vs_serial:.1e}"]


def _report(say, record: dict, target) -> None:
    """The table, then per row: the latents agree, Parallel Sampler is not slower; PipeFusion's cross-step gain."""
    rows = record["rows"]
    say("")
    say(f"Parallel Sampler (one job) vs KSampler's way in (one job per model call), {record['steps']} steps "
        f"euler/simple, each entrance's fastest of {record['repeats']}")
    say(fmt_table(HEADERS, [_table_row(r) for r in rows]))
    say(NOTE)
    if record["cores_before"] is not None:
        say(f"  cores available to the workers (concurrent FP-bound probes): {record['cores_before']:.2f} before, "
            f"{record['cores_after']:.2f} after")
    for r in rows:
        stale = "" if r["exact"] else " (after warm-up: the same one-evaluation-old K/V in both)"
        target(f"{r['label']}: both entrances' latents agree (rel L2 <= {AGREE_RTOL:g}){stale}",
               r["rel_diff"] <= AGREE_RTOL, f"max over {len(r['rel_diffs'])} runs {r['rel_diff']:.1e}")
        over = 1 / r["ratio_run"] - 1
        target(f"{r['label']}: Parallel Sampler at most {TARGET_SAME_STRATEGY:.0%} slower than per call (whole run)",
               over <= TARGET_SAME_STRATEGY,
               f"{r['parallel_sampler']['run_s'] * 1e3:.0f} vs {r['per_call']['run_s'] * 1e3:.0f} ms/step: {over:+.1%} "
               f"(CPU {r['parallel_sampler']['cpu_s']:.2f} vs {r['per_call']['cpu_s']:.2f} s/step: "
               f"{1 / r['ratio_cpu'] - 1:+.1%})")
    for r in rows:
        if StrategySpec(**r["strategy"]).pipefusion_degree > 1:
            target(f"{r['label']}: cross-step pipeline >= {TARGET_PIPEFUSION}x per call (steady step)",
                   r["ratio_steady"] >= TARGET_PIPEFUSION,
                   f"{r['per_call']['steady_s'] * 1e3:.0f} / {r['parallel_sampler']['steady_s'] * 1e3:.0f} ms = "
                   f"{r['ratio_steady']:.2f}x (whole run {r['ratio_run']:.2f}x)")
    record["latents_agree"] = all(r["rel_diff"] <= AGREE_RTOL for r in rows)
