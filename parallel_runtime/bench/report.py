"""The bench's table: one row per measured configuration, and the JSON record of it."""
from __future__ import annotations

from .measure import rel_err


def mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def fmt_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def result_rows(results: list[dict], serial: dict, steps: int, kind: str) -> tuple[list[str], list[list[str]], list]:
    """The table's header and rows and the JSON rows, one per measured configuration; each result gains its
    speed-up and error against the serial run at its cfg."""
    json_rows: list = []
    headers = ["config", "ranks", "ms/step", "job s", "speed-up", "work", "cores", "proj ms", "MB/rank/step sent|recv",
               "analytic", "diff", "params MB/rank", "KV MB", "act MB (est)", "peak RSS MB", "rel err"]
    if kind == "cuda":
        headers.insert(-1, "peak GPU MB")
    table = []
    for res in results:
        s, cfg = res["strategy"], res["cfg"]
        ref = serial.get(round(cfg, 6))
        speed = ref["step_s"] / res["step_s"] if ref else float("nan")
        # serial's CPU seconds per step over the busiest rank's: the speed-up an idle machine would give, less waits
        work = (ref["cpu_step_s"] / res["cpu_step_s"] if ref and min(ref["cpu_step_s"], res["cpu_step_s"]) > 0
                else float("nan"))
        err = rel_err(res["latent"], ref["latent"]) if ref and s.world_size > 1 else 0.0
        sent = max(st["traffic"]["sent"] for st in res["stats"]) / steps
        recv = max(st["traffic"]["recv"] for st in res["stats"]) / steps
        a_sent = max(a.sent for a in res["analytic"]) / steps
        a_recv = max(a.recv for a in res["analytic"]) / steps
        params = max(st["param_bytes"] for st in res["stats"])
        kv = max(st["kv_cache_bytes"] for st in res["stats"])
        rss = max(res["peak_rss_psutil"])
        res.update(speedup=speed, work_speedup=work, rel_err=err)
        cap = res.get("capacity")
        table.append([res["label"], str(s.world_size), f"{res['step_s'] * 1e3:.0f}", f"{res['job_s']:.2f}",
                      f"{speed:.2f}x", f"{work:.2f}x", f"{cap:.2f}" if cap else "-",
                      f"{res['projected_step_s'] * 1e3:.0f}" if "projected_step_s" in res else "-",
                      f"{mb(sent)}|{mb(recv)}", f"{mb(a_sent)}|{mb(a_recv)}",
                      "-" if s.world_size == 1 else ("ok" if res["traffic_ok"] else f"{res['traffic_diff']:.0%}!"),
                      mb(params), mb(kv), mb(res["act_est"]), f"{rss / 2**20:.0f}",
                      f"{err:.1e}" if s.world_size > 1 else "-"])
        if kind == "cuda":
            table[-1].insert(-1, f"{max(st['peak_device_bytes'] for st in res['stats']) / 2**20:.0f}")
        json_rows.append({
            "label": res["label"], "strategy": s.to_json(), "cfg": cfg, "ranks": s.world_size,
            "step_s": res["step_s"], "runs": res["runs"], "capacity": res.get("capacity"), "job_s": res["job_s"],
            "client_s": res["client_s"], "load_s": res["load_s"], "speedup": speed,
            "cpu_step_s": res["cpu_step_s"], "work_speedup": work,
            "projected_step_s": res.get("projected_step_s"),
            "traffic_per_rank_per_step": [{"sent": st["traffic"]["sent"] / steps, "recv": st["traffic"]["recv"] / steps,
                                           "by_op": st["traffic"]["by_op"]} for st in res["stats"]],
            "analytic_per_rank_per_step": [{"sent": a.sent / steps, "recv": a.recv / steps, "by_op": a.by_op()}
                                           for a in res["analytic"]],
            "traffic_ok": res["traffic_ok"], "traffic_worst_diff": res["traffic_diff"],
            "param_bytes": [st["param_bytes"] for st in res["stats"]], "activation_bytes_estimate": res["act_est"],
            "kv_cache_bytes": [st["kv_cache_bytes"] for st in res["stats"]],
            "peak_rss_bytes_psutil": res["peak_rss_psutil"], "idle_rss_bytes": res["idle_rss"],
            "peak_rss_bytes_getrusage": [st["peak_rss_bytes"] for st in res["stats"]],
            "peak_device_bytes": [st["peak_device_bytes"] for st in res["stats"]],
            "step_times": [st["step_times"] for st in res["stats"]], "rel_err": err})
    return headers, table, json_rows
