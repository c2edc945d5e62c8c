"""The ComfyUI host of the multi-machine tests, run inside a test network namespace (tests/netns.py): it opens the
front door on its namespace's address, then serves one JSON command per stdin line and answers one JSON line per
command on stdout (a running job also prints {"event": "progress"} lines, so a test can strike mid-job).

Commands: {"op": "wait_agents", "names": [...], "timeout": s} · {"op": "run", "devices": str, "strategy": {...},
"steps": n, "images": n, "model": path | null, "reference": "cpu:N" | null} (the result's relative error from the same job on this host's CPU workers,
or the error sentence, and the seconds) · {"op": "plan", "devices": str, "cfg": x, "mode": "auto"|"manual", "strategy": {...}} · {"op": "status"} · {"op": "shutdown"} (every runtime's workers end) · {"op": "exit"}.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from conftest import make_job, rel_err  # noqa: E402
from parallel_runtime.errors import ParaDiTError  # noqa: E402
from parallel_runtime.runtime import cluster  # noqa: E402
from parallel_runtime.runtime.auth import read_key_file  # noqa: E402
from parallel_runtime.runtime.client import RuntimeClient  # noqa: E402
from parallel_runtime.runtime.watchdog import WatchdogConfig  # noqa: E402
from parallel_runtime.spec import StrategySpec  # noqa: E402


def say(**message) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Driver:
    def __init__(self, listen: str, key_file: str, model: str):
        self.door = cluster.open_front_door(listen, read_key_file(key_file))
        self.model = model
        self.clients: dict[str, RuntimeClient] = {}

    def client(self, devices: str) -> RuntimeClient:
        if devices not in self.clients:
            self.clients[devices] = RuntimeClient(devices, threads_per_worker=1, watchdog=WatchdogConfig.from_env())
        return self.clients[devices]

    def wait_agents(self, names: list[str], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not set(names) <= {a.name for a in self.door.live_agents()}:
            if time.monotonic() > deadline:
                return {"ok": False, "status": self.door.status()}
            time.sleep(0.1)
        return {"ok": True, "status": self.door.status()}

    def job(self, strategy: dict, steps: int, images: int, model: str | None = None):
        latent = torch.randn(images, 16, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.1
        return make_job(model or self.model, StrategySpec(**strategy), steps=steps, latent=latent)

    def run(self, devices: str, strategy: dict, steps: int = 4, reference: str | None = None, images: int = 1,
            model: str | None = None) -> dict:
        t0 = time.monotonic()
        try:
            result = self.client(devices).run(self.job(strategy, steps, images, model),
                                              progress=lambda step, total, meta: say(event="progress", step=step))
        except ParaDiTError as exc:
            return {"ok": False, "error": str(exc), "type": type(exc).__name__, "seconds": time.monotonic() - t0}
        out = {"ok": True, "seconds": time.monotonic() - t0, "job_seconds": result.seconds}
        if reference:
            ref = self.client(reference).run(self.job(strategy, steps, images))
            out.update(err=rel_err(result.latent, ref.latent), reference_seconds=ref.seconds)
        return out

    def plan(self, devices: str, cfg: float, mode: str = "auto", strategy: dict | None = None) -> dict:
        """The Strategy Selector's way in (runtime/entrance.plan): auto's pick on these hosts, or a manual plan's."""
        from types import SimpleNamespace

        from parallel_runtime.runtime.entrance import plan
        from parallel_runtime.spec import ModelSpec

        request = SimpleNamespace(mode=mode, spec=StrategySpec(**(strategy or {})), measured=False)
        chosen = plan(self.client(devices), request, ModelSpec(self.model), (1, 16, 16, 16), cfg, devices)
        return {"ok": True, "strategy": chosen.strategy.to_json(), "label": chosen.strategy.label(),
                "reason": chosen.reason}

    def serve(self) -> None:
        say(event="listening", listen=self.door.listen)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            if op == "exit":
                break
            if op == "shutdown":  # every runtime's workers end (the front door stays open)
                for client in self.clients.values():
                    client.shutdown()
                say(ok=True)
                continue
            if op == "status":
                say(ok=True, status=self.door.status(),
                    clients={k: c.status() for k, c in self.clients.items()})
                continue
            say(**getattr(self, op)(**command))
        for client in self.clients.values():
            client.shutdown()
        cluster.close_front_door()
        say(event="bye")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    Driver(sys.argv[1], sys.argv[2], sys.argv[3]).serve()
