"""The bench's stated targets (PASS/FAIL) on what the grid measured."""
from __future__ import annotations

from .models import NAMED_MODELS

TARGET_OVERHEAD = 0.05
TARGET_SPEEDUP = 1.6
TARGET_PP_PARAMS = 1.15
TARGET_STALE_VS_NAIVE = 0.5  # stale-KV PipeFusion error <= half of naive patch's, same world
TARGET_TRAFFIC = 0.10
TARGET_AUTO = 0.10
TARGET_TP_PARAMS = 0.6  # tensor parallel at 2: params per rank <= 0.6 x the whole model's
TARGET_EXACT = 1e-4  # an exact strategy's latent against serial's (fp32)
TARGET_SHARD_PARAMS = 0.55  # shard_weights at 2: weight bytes per rank <= 0.55 x the whole model's
TARGET_SHARD_STEP = 1.25  # shard_weights at 2: Ulysses-2's step <= 1.25 x the unsharded one's

_ULYSSES2 = ("Ulysses-2", lambda s: s.ulysses_degree == 2 and s.world_size == 2)
_RING2 = ("Ring-2", lambda s: s.ring_degree == 2 and s.world_size == 2)
_PIPEFUSION2 = ("PipeFusion-2 (stale KV)", lambda s: s.pipefusion_degree == 2 and s.world_size == 2)
_CFG2 = ("CFG-2 (cfg > 1)", lambda s: s.cfg_degree == 2 and s.world_size == 2)
# ((name, which rows), minimum speed-up over serial at 2 workers) per family; None: every other family.
SPEEDUP_TARGETS = {
    None: ((_ULYSSES2, TARGET_SPEEDUP), (_PIPEFUSION2, TARGET_SPEEDUP), (_CFG2, TARGET_SPEEDUP)),
    # Wan's >= 8,000 video tokens make attention's compute hide the traffic, so the exact sequence splits must
    # reach 1.8x; CFG-2 at least the ~1.85x the Wan bench's issue cites for ComfyUI core's own CFG split (its
    # MultiGPU work units, Comfy-Org/ComfyUI#7063) on Wan 1.3B and 2 GPUs.
    "wan": ((_ULYSSES2, 1.8), (_RING2, 1.8), (_PIPEFUSION2, TARGET_SPEEDUP), (_CFG2, 1.85)),
}


def measured_targets(args, results: list[dict], serial: dict, inproc: float | None, total_params: int | None,
                      target, family: str | None = None) -> None:
    """The stated targets on what the grid measured: overhead, speed-ups (`family`'s, see SPEEDUP_TARGETS),
    PipeFusion memory and error, bytes."""
    base = serial.get(round(args.cfg, 6))
    if inproc is not None and base is not None:
        over = base["step_s"] / inproc - 1
        target("runtime overhead at 1 worker <= 5% per step", over <= TARGET_OVERHEAD,
               f"worker {base['step_s'] * 1e3:.0f} ms vs in-process {inproc * 1e3:.0f} ms: {over:+.1%}")
    else:
        target("runtime overhead at 1 worker <= 5% per step", None, "not measured")

    def best_row(pred):
        cands = [r for r in results if pred(r["strategy"])]
        return max(cands, key=lambda r: r["speedup"]) if cands else None

    for (name, pred), minimum in SPEEDUP_TARGETS.get(family, SPEEDUP_TARGETS[None]):
        r = best_row(pred)
        if r is None:
            target(f"{name} >= {minimum}x serial", None, "not run")
        else:
            target(f"{name} >= {minimum}x serial", r["speedup"] >= minimum,
                   f"{r['label']}: {r['speedup']:.2f}x ({r['step_s'] * 1e3:.0f} vs serial "
                   f"{serial[round(r['cfg'], 6)]['step_s'] * 1e3:.0f} ms/step)")
    pp_rows = [r for r in results if r["strategy"].pipefusion_degree > 1]
    if pp_rows and total_params:
        details, ok = [], True
        for r in pp_rows:
            n = r["strategy"].pipefusion_degree
            ratio = max(st["param_bytes"] for st in r["stats"]) / (total_params / n)
            ok &= ratio <= TARGET_PP_PARAMS
            details.append(f"{r['label']} {ratio:.2f}")
        target(f"PipeFusion-N params/rank <= {TARGET_PP_PARAMS} x total/N", ok, ", ".join(dict.fromkeys(details)))
    else:
        target(f"PipeFusion-N params/rank <= {TARGET_PP_PARAMS} x total/N", None, "no PipeFusion row")
    _stale_vs_naive_target(results, target, trained=args.model not in NAMED_MODELS)
    _displaced_target(results, target, trained=args.model not in NAMED_MODELS)
    _tensor_target(results, target, total_params)
    _shard_target(results, target, total_params)
    par = [r for r in results if r["strategy"].world_size > 1]
    if par:
        worst = max(par, key=lambda r: r["traffic_diff"])
        target("measured bytes within 10% of analytic", all(r["traffic_ok"] for r in par),
               f"worst {worst['traffic_diff']:.1%} ({worst['label']}) over {len(par)} configurations")


def _stale_vs_naive_target(results, target, trained: bool) -> None:
    """PipeFusion (stale K/V of the other patches) against naive patch parallel (patches that never see each
    other) at the same world size: the error against serial that each approximation costs. The target is
    stated on trained weights: random weights (the named bench models) draw no picture for the patches to
    agree on, so there the figures are shown and not judged."""
    for w in sorted({r["strategy"].world_size for r in results if r["strategy"].naive_patch_degree > 1}):
        naive = [r for r in results if r["strategy"].naive_patch_degree == w]
        pp = [r for r in results if r["strategy"].pipefusion_degree == w and r["strategy"].world_size == w]
        name = f"PipeFusion-{w} error <= {TARGET_STALE_VS_NAIVE:g} x naive patch-{w}'s"
        if not (naive and pp):
            target(name, None, "no PipeFusion row at that world size")
            continue
        worst = max(pp, key=lambda r: r["rel_err"])
        ratio = worst["rel_err"] / max(naive[0]["rel_err"], 1e-30)
        detail = f"{worst['label']} {worst['rel_err']:.2e} vs {naive[0]['label']} {naive[0]['rel_err']:.2e} ({ratio:.2f}x)"
        if trained:
            target(name, ratio <= TARGET_STALE_VS_NAIVE, detail)
        else:
            target(name, None, f"{detail}; random weights, so not judged: run --model toy (trained) for the target")


def _displaced_target(results, target, trained: bool) -> None:
    """Displaced patch parallelism at each world size: its speed-up, and its error next to naive patch's (patches
    that never see each other). The error is judged on trained weights only, as PipeFusion's is: random weights
    draw no picture for the patches to agree on."""
    for w in sorted({r["strategy"].world_size for r in results if r["strategy"].patch_degree > 1}):
        rows = [r for r in results if r["strategy"].patch_degree == w and r["strategy"].world_size == w]
        naive = [r for r in results if r["strategy"].naive_patch_degree == w]
        row = rows[0]
        name = f"displaced patch-{w} >= {TARGET_SPEEDUP}x serial, error below naive patch-{w}'s"
        if not naive:
            target(name, None, "no naive patch row at that world size")
            continue
        detail = (f"{row['label']} {row['speedup']:.2f}x, error {row['rel_err']:.2e} vs {naive[0]['label']} "
                  f"{naive[0]['rel_err']:.2e}")
        if trained:
            target(name, row["speedup"] >= TARGET_SPEEDUP and row["rel_err"] < naive[0]["rel_err"], detail)
        else:
            target(f"displaced patch-{w} >= {TARGET_SPEEDUP}x serial", row["speedup"] >= TARGET_SPEEDUP,
                   f"{detail}; the error is judged on trained weights (--model toy)")


def _tensor_target(results, target, total_params: int | None) -> None:
    """Tensor parallel at 2 workers: exact (its error against serial) while each rank holds about half the model."""
    rows = [r for r in results if r["strategy"].tensor_degree == 2 and r["strategy"].world_size == 2]
    name = f"tensor parallel-2 exact (<= {TARGET_EXACT:g}) with params/rank <= {TARGET_TP_PARAMS} x total"
    if not rows or not total_params:
        target(name, None, "no tp2 row")
        return
    row = rows[0]
    ratio = max(st["param_bytes"] for st in row["stats"]) / total_params
    target(name, row["rel_err"] <= TARGET_EXACT and ratio <= TARGET_TP_PARAMS,
           f"{row['label']} error {row['rel_err']:.1e}, params/rank {ratio:.2f} x total, {row['speedup']:.2f}x serial")


def _shard_target(results, target, total_params: int | None) -> None:
    """shard_weights beside Ulysses-2: each rank holds about half the weights, its step within 1.25x of the unsharded
    step (the block gathers prefetched while the block before computes), and the result unchanged."""
    def ulysses2(sharded):
        return [r for r in results if r["strategy"].ulysses_degree == 2 and r["strategy"].world_size == 2
                and r["strategy"].sharded == sharded]
    name = (f"shard_weights Ulysses-2: params/rank <= {TARGET_SHARD_PARAMS} x total, step <= {TARGET_SHARD_STEP} x "
            f"unsharded, exact")
    sharded, plain = ulysses2(True), ulysses2(False)
    if not sharded or not plain or not total_params:
        target(name, None, "no ulysses2+shard row")
        return
    row, base = sharded[0], plain[0]
    ratio = max(st["param_bytes"] for st in row["stats"]) / total_params
    slower = row["step_s"] / base["step_s"]
    gathered = max(st["traffic"]["by_op"].get("weights", [0, 0])[1] for st in row["stats"])
    target(name, ratio <= TARGET_SHARD_PARAMS and slower <= TARGET_SHARD_STEP and row["rel_err"] <= TARGET_EXACT,
           f"params/rank {ratio:.2f} x total, step {row['step_s'] * 1e3:.0f} ms vs {base['step_s'] * 1e3:.0f} ms "
           f"({slower:.2f}x), error {row['rel_err']:.1e}, gathered {gathered / 2**20:.0f} MiB per rank per job")


def auto_target(args, results: list[dict], auto_pick, auto_reason, max_world: int, target) -> dict | None:
    """Auto's pick against the best measured configuration at the same cfg and world; the JSON record of it."""
    auto_record = None
    if auto_pick is not None:
        auto_record = {"pick": auto_pick.to_json(), "label": auto_pick.label(), "reason": auto_reason}
        same_cfg = [r for r in results if abs(r["cfg"] - args.cfg) < 1e-9 and r["strategy"].world_size > 1
                    and r["strategy"].naive_patch_degree == 1 and r["strategy"].world_size == max_world]
        pick_rows = [r for r in same_cfg if r["strategy"] == auto_pick]
        if pick_rows:
            auto_record["pick_step_s"] = pick_rows[0]["step_s"]
            auto_record["pick_speedup"] = pick_rows[0].get("speedup")
        if args.auto:
            target("auto within 10% of the best measured", None, "--auto ran only auto's pick; run the full grid")
        elif same_cfg and pick_rows:
            best = min(same_cfg, key=lambda r: r["step_s"])
            mine = pick_rows[0]
            gap = mine["step_s"] / best["step_s"] - 1
            target("auto within 10% of the best measured", gap <= TARGET_AUTO,
                   f"auto {mine['label']} {mine['step_s'] * 1e3:.0f} ms vs best {best['label']} "
                   f"{best['step_s'] * 1e3:.0f} ms: {gap:+.1%}")
            auto_record.update(best_label=best["label"], best_step_s=best["step_s"], gap=gap)
        else:
            target("auto within 10% of the best measured", None, "auto's pick was not measured")
    return auto_record
