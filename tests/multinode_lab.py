"""The multi-machine lab: host 0 of a TestNetwork (tests/netns.py) runs the ComfyUI side (tests/multinode_driver.py),
the other hosts run `python -m parallel_runtime agent`. Shared by tests/test_multinode_cluster.py and
scripts/bench_multinode.py."""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

from netns import TestNetwork
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.runtime.auth import new_key_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Host0:
    """The driver inside host 0: one JSON command per line, one JSON answer per command."""

    def __init__(self, net: TestNetwork, key: str, model: str, log_path: str):
        self.log = open(log_path, "w")
        self.proc = net.popen(0, [sys.executable, os.path.join(ROOT, "tests", "multinode_driver.py"),
                                  f"{net.address(0)}:0", key, model],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.listen = self.answer(120)["listen"]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"host 0 gave no answer within {timeout:.0f} s") from None
            assert message is not None, "host 0's driver ended; see its log"
            if message.get("event") in ("progress", "listening"):
                self.events.append(message)
                if message["event"] == "listening":
                    return message
                continue
            return message

    def send(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps(dict(kw, op=op)) + "\n")
        self.proc.stdin.flush()

    def ask(self, op: str, wait_s: float = 240, **kw) -> dict:
        self.send(op, **kw)
        return self.answer(wait_s)

    def first_progress(self, timeout: float) -> None:
        """Wait for a running job's first progress line."""
        deadline = time.monotonic() + timeout
        while not any(e.get("event") == "progress" for e in self.events):
            assert time.monotonic() < deadline, "the job reported no progress"
            try:
                message = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            assert message is not None and message.get("event") == "progress", message
            self.events.append(message)

    def exit(self) -> None:
        try:
            self.send("exit")
            self.proc.wait(60)
        finally:
            self.log.close()


class Cluster:
    def __init__(self, net: TestNetwork, folder: str):
        self.net, self.folder = net, folder
        self.key = os.path.join(folder, "key")
        new_key_file(self.key)
        os.makedirs(os.path.join(folder, "host0"))
        model = write_checkpoint(os.path.join(folder, "host0", "tiny-flux.safetensors"), TINY, seed=0)
        for name in ("box-b", "box-c"):  # each machine has its own copy in its own model folder
            os.makedirs(os.path.join(folder, name, "models"))
            shutil.copy(model, os.path.join(folder, name, "models"))
        self.host0 = Host0(net, self.key, model, os.path.join(folder, "host0.log"))
        self.agents: dict[str, subprocess.Popen] = {}

    def start_agent(self, i: int, name: str, cpus: int = 2, key: str | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.folder, f"{name}-{len(self.agents)}.log"), "w")
        proc = self.net.popen(i, [sys.executable, "-m", "parallel_runtime", "agent", "--join", self.host0.listen,
                                  "--key-file", key or self.key, "--name", name, "--devices", f"cpu:{cpus}",
                                  "--models", os.path.join(self.folder, name, "models"), "--threads", "1"],
                              cwd=ROOT, stderr=log, env=dict(os.environ, PYTHONPATH=ROOT))
        log.close()
        self.agents[name] = proc
        return proc

    def wait_joined(self, *names: str, timeout: float = 60) -> dict:
        answer = self.host0.ask("wait_agents", wait_s=timeout + 10, names=list(names), timeout=timeout)
        assert answer["ok"], answer
        return answer["status"]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


