"""The bench's ControlNet row: a stock sampler's model calls with a Flux ControlNet on the workers, against the
same calls without it, serial and on the grid's fastest exact multi-worker strategy, in the same run.

The ControlNet runs under the DiT's own token split (strategies/control.py), so its speed-up should be the
DiT's: the target is a speed-up with ControlNet >= 0.9 x the same strategy's without. Bytes: the hint crosses
the control channel once per sampling run (the first call); per call only its key travels, and the
ControlNet's own attention adds the collective traffic the runtime counts (reported per call and rank).
"""
from __future__ import annotations

import os
import statistics

import torch

from ..spec import ControlInput, StrategySpec
from .grid import subset_devices
from .runs import run_calls

TARGET_RATIO = 0.9
CONTROLNET_BLOCKS = 2  # double blocks, as XLabs' Flux ControlNets have


def _exact_pick(results: list[dict], cfg: float):
    """The fastest multi-worker row at this cfg among the exact strategies (no naive patch)."""
    rows = [r for r in results if r["strategy"].world_size > 1 and r["strategy"].exact
            and abs(r["cfg"] - cfg) < 1e-9]
    return min(rows, key=lambda r: r["step_s"])["strategy"] if rows else None


def _sent_per_call(stats: list) -> float:
    """Bytes the busiest rank sent per call (the runtime's own counters)."""
    return statistics.median(max(st["traffic"]["sent"] for st in call) for call in stats) if stats else 0.0


def controlnet_row(say, args, path: str, config, latent_shape, text: int, results: list[dict], devices: list[str],
                   target, clients=None) -> dict | None:
    """`clients(where)`: warm workers on those devices (--quick's pool), else None (fresh ones per run)."""
    from ..models.registry import family_of
    from ..models.tiny import write_controlnet

    family = family_of(config)
    strategy = _exact_pick(results, args.cfg)
    if family.load_controlnet is None or strategy is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    net = write_controlnet(os.path.join(folder, "paradit-bench-controlnet.safetensors"), config, "xlabs",
                           double=CONTROLNET_BLOCKS, seed=3)
    hint = torch.rand(1, 3, latent_shape[2] * 8, latent_shape[3] * 8, generator=torch.Generator().manual_seed(5))
    control = (ControlInput(net, "bench-hint", 1.0, hint),)
    where = subset_devices(devices, args.devices, strategy.world_size)
    out = {"strategy": strategy.label(), "controlnet_double_blocks": CONTROLNET_BLOCKS,
           "hint_bytes_once": hint.numel() * 4}
    for name, ctl in (("without", ()), ("with", control)):
        for label, s, dev in (("serial", StrategySpec(), "cpu:1" if devices[0] == "cpu" else devices[0]),
                              ("parallel", strategy, where)):
            stats: list = []
            calls = run_calls(path, config, latent_shape, text, args.cfg, args.steps, args.threads, s, dev,
                              control=ctl, stats=stats, client=clients and clients(dev))
            out[f"{label}_{name}_s"] = statistics.median(calls)
            if label == "parallel":
                out[f"sent_per_call_{name}"] = _sent_per_call(stats)
    try:
        os.remove(net)
    except OSError:
        pass
    out["speedup_without"] = out["serial_without_s"] / out["parallel_without_s"]
    out["speedup_with"] = out["serial_with_s"] / out["parallel_with_s"]
    out["ratio"] = out["speedup_with"] / out["speedup_without"]
    mb = 2 ** 20
    say(f"ControlNet ({CONTROLNET_BLOCKS} double blocks, XLabs layout) under a stock sampler, {strategy.label()}: "
        f"{out['parallel_with_s'] * 1e3:.0f} ms/call with vs {out['parallel_without_s'] * 1e3:.0f} without; "
        f"speed-up {out['speedup_with']:.2f}x with vs {out['speedup_without']:.2f}x without "
        f"(ratio {out['ratio']:.2f}); hint {out['hint_bytes_once'] / mb:.2f} MB once per run, collectives "
        f"{out['sent_per_call_with'] / mb:.2f} MB/call/rank with vs {out['sent_per_call_without'] / mb:.2f} without")
    target(f"ControlNet speed-up >= {TARGET_RATIO} x the same strategy's without", out["ratio"] >= TARGET_RATIO,
           f"{strategy.label()}: {out['speedup_with']:.2f}x with / {out['speedup_without']:.2f}x without = "
           f"{out['ratio']:.2f}")
    return out
