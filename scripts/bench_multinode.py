"""The multi-machine bench on one Linux box (root): three test hosts made of network namespaces (tests/netns.py) —
host 0 runs the ComfyUI side, hosts 1 and 2 an agent each — and each plan timed across them against the same plan on
host 0's own CPU workers, warm (the second of two runs), with its error; then Ulysses-4 across a link slowed with
tc's token bucket against auto's pick there. Prints a table, writes JSON.

    python scripts/bench_multinode.py --steps 20 --out bench-multinode.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

PLANS = [  # (devices across hosts, the plan, images)
    ("cpu:2,box-b:cpu:2", dict(cfg_degree=2, ulysses_degree=2), 1),
    ("cpu:2,box-b:cpu:2", dict(batch_degree=2, ulysses_degree=2), 2),
    ("cpu:2,box-b:cpu:2", dict(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2), 1),
    ("cpu:2,box-b:cpu:1,box-c:cpu:1", dict(cfg_degree=2, pipefusion_degree=2, num_pipeline_patch=2), 1),
]


def warm(cluster, **run) -> dict:
    """The second of two runs (the first starts workers and reads weights)."""
    first = cluster.host0.ask("run", **run)
    if not first["ok"]:
        return first
    return cluster.host0.ask("run", **run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="sampling steps per job")
    ap.add_argument("--slow", default="20mbit", help="the rate box-b's link is slowed to for the last rows")
    ap.add_argument("--out", default="bench-multinode.json", help="where the JSON goes")
    args = ap.parse_args(argv)

    from multinode_lab import Cluster
    from netns import TestNetwork, netns_unavailable

    if netns_unavailable():
        print(f"cannot make test hosts here: {netns_unavailable()}")
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as folder, TestNetwork(hosts=3) as net:
        cluster = Cluster(net, folder)
        try:
            cluster.start_agent(1, "box-b")
            cluster.start_agent(2, "box-c")
            cluster.wait_joined("box-b", "box-c")
            for devices, plan, images in PLANS:
                across = warm(cluster, devices=devices, strategy=plan, steps=args.steps, images=images)
                world = sum(int(p.rpartition(":")[2]) for p in devices.split(","))
                one = warm(cluster, devices=f"cpu:{world}", strategy=plan, steps=args.steps, images=images,
                           reference=devices)
                rows.append({"devices": devices, "plan": plan, "images": images, "link": "unshaped",
                             "across_s": across.get("job_seconds"), "one_host_s": one.get("job_seconds"),
                             "err": one.get("err"), "error": across.get("error") or one.get("error")})
            net.slow(1, args.slow)
            pick = cluster.host0.ask("plan", devices="cpu:2,box-b:cpu:2", cfg=2.0)
            for label, plan in (("ulysses4 (all-to-all across)", dict(ulysses_degree=4)),
                                (f"auto: {pick['label']}", pick["strategy"])):
                timed = warm(cluster, devices="cpu:2,box-b:cpu:2", strategy=plan, steps=args.steps, images=1)
                rows.append({"devices": "cpu:2,box-b:cpu:2", "plan": plan, "images": 1, "link": args.slow,
                             "across_s": timed.get("job_seconds"), "one_host_s": None, "err": None,
                             "label": label, "error": timed.get("error")})
            net.unslow(1)
        finally:
            cluster.host0.exit()
            for agent in cluster.agents.values():
                agent.terminate()
                agent.wait(30)
    print(f"{'devices':34} {'plan':44} {'link':9} {'across s':>9} {'one host s':>10} {'err':>8}")
    for r in rows:
        plan = r.get("label") or " ".join(f"{k}={v}" for k, v in r["plan"].items() if v not in (1, 0, (), None))
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['devices']:34} {plan[:44]:44} {r['link']:9} {fmt(r['across_s'], '9.3f')} "
              f"{fmt(r['one_host_s'], '10.3f')} {fmt(r['err'], '8.1e')}" + (f"  {r['error']}" if r["error"] else ""))
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
