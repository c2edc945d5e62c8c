"""`bench --batch N`: a batch of N images per strategy on the same warm workers: batch parallel against the sequence
splits and CFG parallel at equal devices, against one device.

Batch parallel sends nothing between its groups until the result, so on devices that each hold the model it should
run N images in about 1/groups of the serial time; Ulysses and Ring split every image and pay their collectives
each step, CFG parallel splits the branches and gathers once a step. Each row runs Parallel Sampler's job (the
workers' own step loop), keeps its fastest of --repeats (contention only adds time), and checks every image against
serial's (batch parallel is exact: fp32 round-off).
"""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..spec import StrategySpec
from .entrances import _timed_job
from .grid import subset_devices
from .measure import cpu_capacity, rel_err
from .report import fmt_table
from .runs import WarmClients, make_job

TARGET_BATCH_SPEEDUP = 1.9  # batch 2 over serial at >= 2 images (the target; 2.0 is the ideal)
EXACT_RTOL = 1e-4  # every image as serial gives it, to fp32 round-off (a swapped row or wrong noise is ~1)


def batch_rows(world: int, cfg: float) -> list[StrategySpec]:
    """Serial, then batch-`world`, Ulysses-`world`, Ring-`world` and (cfg > 1) CFG-2 x the rest."""
    rows = [StrategySpec(), StrategySpec(batch_degree=world), StrategySpec(ulysses_degree=world),
            StrategySpec(ring_degree=world)]
    if abs(cfg - 1.0) > 1e-9 and world % 2 == 0:
        rows.append(StrategySpec(cfg_degree=2, ulysses_degree=world // 2))
    return rows


def batch_bench(say, args, path: str, config, latent_shape, text: int, devices: list[str], target,
                workers: dict | None = None, conditioning=None) -> dict:
    """Each row `args.repeats` times on warm workers (`workers`: a caller's pool, left running). Prints the table
    and the targets' lines; returns the JSON record."""
    images = args.batch
    shape = (images, *latent_shape[1:])
    probe = devices[0] == "cpu" and not args.quick and len(devices) > 1
    record = {"images": images, "steps": args.steps, "cfg": args.cfg, "repeats": args.repeats,
              "best_of": "fastest run", "rows": [], "not_applicable": [],
              "cores_before": cpu_capacity(len(devices)) if probe else None}
    serial = None
    with WarmClients(workers, args.threads) as clients:
        for s in batch_rows(len(devices), args.cfg):
            where = subset_devices(devices, args.devices, s.world_size)
            client = clients.get(where)
            job = make_job(path, config, s, shape, text, args.cfg, args.steps, conditioning)
            try:
                client.run(dataclasses.replace(job, sampling=dataclasses.replace(job.sampling, steps=1)))
                runs = [_timed_job(client, job) for _ in range(args.repeats)]
            except ConfigError as exc:
                say(f"  {s.label()}: not applicable ({exc})")
                record["not_applicable"].append({"label": s.label(), "reason": str(exc)})
                continue
            best = min(runs, key=lambda r: r["run_s"])
            latent = best["latent"]
            if s.world_size == 1:
                serial = latent
            worst = max(rel_err(latent[k], serial[k]) for k in range(images)) if serial is not None else None
            record["rows"].append({"label": s.label(), "strategy": s.to_json(), "ranks": s.world_size,
                                   "devices": where, "s_per_step": best["run_s"], "runs_s": [r["run_s"] for r in runs],
                                   "images_per_min": 60.0 * images / (best["run_s"] * args.steps),
                                   "max_image_rel_err_vs_serial": worst})
            say(f"  {s.label()}: {best['run_s'] * 1e3:.0f} ms/step for {images} images")
    record["cores_after"] = cpu_capacity(len(devices)) if probe else None
    _report(say, record, target)
    return record


def _report(say, record: dict, target) -> None:
    rows = record["rows"]
    base = next((r for r in rows if r["ranks"] == 1), None)
    say("")
    say(f"A batch of {record['images']} images, {record['steps']} steps at cfg {record['cfg']:g}, each row's fastest "
        f"of {record['repeats']} (Parallel Sampler's job)")
    table = [[r["label"], str(r["ranks"]), f"{r['s_per_step']:.3f}", f"{r['images_per_min']:.1f}",
              "-" if base is None else f"{base['s_per_step'] / r['s_per_step']:.2f}x",
              "-" if r["max_image_rel_err_vs_serial"] is None or r["ranks"] == 1
              else f"{r['max_image_rel_err_vs_serial']:.1e}"] for r in rows]
    say(fmt_table(["strategy", "devices", "s/step", "images/min", "vs serial", "worst image vs serial"], table))
    if record["cores_before"] is not None:  # CPU workers: what the machine gives them at once bounds any split
        say(f"  cores available to the workers at once (concurrent FP-bound probes): {record['cores_before']:.2f} "
            f"before, {record['cores_after']:.2f} after: no split of CPU workers here can beat that")
    if base is None:
        return
    for r in rows:
        r["speedup_vs_serial"] = base["s_per_step"] / r["s_per_step"]
    batch = [r for r in rows if StrategySpec(**r["strategy"]).batch_degree > 1]
    others = [r for r in rows if r["ranks"] > 1 and r not in batch]
    for r in batch:
        cores = [c for c in (record["cores_before"], record["cores_after"]) if c is not None]
        ceiling = f" (the machine gave the workers {min(cores):.2f}-{max(cores):.2f} cores at once)" if cores else ""
        target(f"{r['label']}: >= {TARGET_BATCH_SPEEDUP}x serial on a batch of {record['images']}",
               r["speedup_vs_serial"] >= TARGET_BATCH_SPEEDUP, f"{r['speedup_vs_serial']:.2f}x{ceiling}")
        target(f"{r['label']}: every image equals serial's (rel L2 <= {EXACT_RTOL:g})",
               r["max_image_rel_err_vs_serial"] <= EXACT_RTOL, f"worst image {r['max_image_rel_err_vs_serial']:.1e}")
        if others:
            fastest = max(others, key=lambda o: o["speedup_vs_serial"])
            target(f"{r['label']}: faster than every other split of the same devices on this batch",
                   r["speedup_vs_serial"] >= fastest["speedup_vs_serial"],
                   f"{r['speedup_vs_serial']:.2f}x vs {fastest['label']} {fastest['speedup_vs_serial']:.2f}x")
