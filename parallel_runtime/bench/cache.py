"""`bench --cache [THRESHOLD]`: the runtime's First-Block Cache on and off, serial and under each exact strategy.

Every row runs the same job (seed, steps, cfg, prompt) uncached and cached on the same warm workers (serial on one
worker, the strategies on all of them), round robin over `--repeats`, each keeping its fastest run: contention on a
shared machine only adds time. Times are the workers' own job seconds (the model load left out): a cached step is
much shorter than a computed one, so a per-step median would hide the gain.

For each strategy: its speed-up alone (serial uncached / it uncached), the cache's gain under it (it uncached / it
cached), both together (serial uncached / it cached), the steps the cache skipped (every rank's the same: the
decision is all-reduced, see strategies/step_cache.py) and the cached run's relative L2 error against the uncached
serial latent. The targets: the cache multiplies each parallel speed-up by >= 1.5 at <= 2e-2 error, and its gain
under Ulysses-2 is within 10% of its gain serial.
"""
from __future__ import annotations

import dataclasses

from ..spec import StrategySpec
from .measure import cpu_capacity, rel_err
from .report import fmt_table
from .grid import subset_devices
from .runs import WarmClients, make_job

DEFAULT_THRESHOLD = 0.12
DEFAULT_STEPS = 50  # FBCache skips more where steps are closer: on the demo model 24/50 at 0.12 vs 7/28
DEMO_CFG = 4.0  # at cfg 1 there is no uncond branch for CFG parallel: the demo's cfg then
TARGET_GAIN = 1.5  # cache + parallel >= 1.5 x the parallel speed-up alone
TARGET_ERROR = 2e-2  # ... at this relative error against the uncached serial latent, or less
TARGET_ULYSSES_GAIN = 0.10  # the cache's gain under Ulysses-2 within 10% of its gain serial
EXACT = (StrategySpec(cfg_degree=2), StrategySpec(ulysses_degree=2), StrategySpec(ring_degree=2),
         StrategySpec(tensor_degree=2))


def cache_strategies(world: int) -> list[StrategySpec]:
    """Serial and each exact strategy that fits `world` ranks (at 2: CFG, Ulysses, Ring and tensor parallel)."""
    return [StrategySpec()] + [s for s in EXACT if s.world_size == world]


def cache_bench(say, args, path: str, config, latent_shape, text_tokens: int, devices: list, target,
                workers: dict | None, conditioning) -> dict:
    threshold = args.cache
    cfg = args.cfg if abs(args.cfg - 1.0) > 1e-9 else DEMO_CFG
    cached = dict(cache="first_block", cache_threshold=threshold)
    strategies = cache_strategies(len(devices))
    say(f"First-Block Cache at threshold {threshold:g}: {args.steps} steps, cfg {cfg:g}, {args.devices} x "
        f"{args.threads} thread(s), best of {args.repeats}; parallel rows on {len(devices)} workers")
    runs: dict = {}
    with WarmClients(workers, args.threads) as warm:
        # Warm clients by world size: 1 for serial, all devices for the strategies.
        clients = {n: warm.get(subset_devices(devices, args.devices, n)) for n in sorted({1, len(devices)})}
        for rep in range(args.repeats):
            order = [(s, c) for s in strategies for c in (False, True)]
            for s, on in (order if rep % 2 == 0 else order[::-1]):  # alternate who runs first
                spec = dataclasses.replace(s, **cached) if on else s
                client = clients[s.world_size]
                result = client.run(make_job(path, config, spec, latent_shape, text_tokens, cfg, args.steps,
                                             conditioning))
                seconds = max(st["job_seconds"] for st in result.stats)
                say(f"  round {rep + 1}: {s.label()} {'on' if on else 'off'}: {seconds:.2f} s, "
                    f"{len(result.stats[0]['cache_skipped'])} steps skipped")
                key = (s.label(), on)
                if key not in runs or seconds < runs[key]["seconds"]:
                    runs[key] = {"seconds": seconds, "latent": result.latent,
                                 "skipped": [st["cache_skipped"] for st in result.stats]}
        cores = cpu_capacity(len(devices)) if devices[0] == "cpu" and len(devices) > 1 else None
    rows = _rows(strategies, runs, args.steps)
    _report(say, rows, threshold, cores)
    _targets(rows, target)
    return {"threshold": threshold, "steps": args.steps, "cfg": cfg, "cores": cores, "rows": rows}


def _rows(strategies: list[StrategySpec], runs: dict, steps: int) -> list[dict]:
    serial = runs[("serial", False)]
    rows = []
    for s in strategies:
        off, on = runs[(s.label(), False)], runs[(s.label(), True)]
        skipped = on["skipped"]
        rows.append({
            "strategy": s.label(), "ranks": s.world_size, "uncached_s": off["seconds"], "cached_s": on["seconds"],
            "parallel_speedup": serial["seconds"] / off["seconds"], "cache_gain": off["seconds"] / on["seconds"],
            "speedup": serial["seconds"] / on["seconds"], "skipped": skipped[0], "steps": steps,
            "ranks_agree": all(k == skipped[0] for k in skipped),
            "uncached_error": rel_err(off["latent"], serial["latent"]),
            "cached_error": rel_err(on["latent"], serial["latent"]),
            "cached_vs_serial_cached": rel_err(on["latent"], runs[("serial", True)]["latent"])})
    return rows


def _report(say, rows: list[dict], threshold: float, cores: float | None) -> None:
    headers = ["config", "ranks", "off s", "on s", "parallel x", "cache gain x", "together x", "skipped",
               "err off", "err on", "on vs serial on"]
    table = [[r["strategy"], str(r["ranks"]), f"{r['uncached_s']:.2f}", f"{r['cached_s']:.2f}",
              f"{r['parallel_speedup']:.2f}", f"{r['cache_gain']:.2f}", f"{r['speedup']:.2f}",
              f"{len(r['skipped'])}/{r['steps']}" + ("" if r["ranks_agree"] else " (ranks differ!)"),
              f"{r['uncached_error']:.1e}", f"{r['cached_error']:.1e}", f"{r['cached_vs_serial_cached']:.1e}"]
             for r in rows]
    say("")
    say(fmt_table(headers, table))
    say(f"  off/on: the workers' job seconds without and with the cache (threshold {threshold:g}); parallel x: serial "
        f"off / row off; cache gain x: row off / row on; together x: serial off / row on; err: relative L2 against "
        f"the uncached serial latent; on vs serial on: against the cached serial latent (exact strategies: round-off)")
    if cores is not None:
        say(f"  cores: the workers' concurrent FP-bound probes got {cores:.2f} cores just after the runs")


def _targets(rows: list[dict], target) -> None:
    serial = rows[0]
    for r in rows[1:]:
        ok = r["cache_gain"] >= TARGET_GAIN and r["cached_error"] <= TARGET_ERROR
        target(f"cache x {r['strategy']} >= {TARGET_GAIN}x its parallel speed-up at <= {TARGET_ERROR:g} error", ok,
               f"{r['speedup']:.2f}x together vs {r['parallel_speedup']:.2f}x alone = {r['cache_gain']:.2f}x, "
               f"error {r['cached_error']:.1e}, {len(r['skipped'])}/{r['steps']} steps skipped")
    ulysses = next((r for r in rows if r["strategy"] == "ulysses2"), None)
    if ulysses is not None:
        ratio = ulysses["cache_gain"] / serial["cache_gain"]
        target(f"cache gain under ulysses2 within {TARGET_ULYSSES_GAIN:.0%} of serial's",
               abs(ratio - 1) <= TARGET_ULYSSES_GAIN,
               f"{ulysses['cache_gain']:.2f}x vs {serial['cache_gain']:.2f}x serial ({ratio - 1:+.0%})")
    agree = all(r["ranks_agree"] and r["skipped"] == serial["skipped"] for r in rows)
    target("cache decisions the same on every rank and as serial", agree,
           "skipped steps " + ("agree" if agree else "differ: " + "; ".join(f"{r['strategy']} {r['skipped']}"
                                                                           for r in rows)))
