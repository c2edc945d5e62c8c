"""The host tests' server roots (tens of GB of model files each) do not outlive a killed test run: the next run
removes roots whose owning pytest process is gone, and keeps live or mid-setup ones."""
from __future__ import annotations

import os
import subprocess
import sys

import comfy_host


def test_roots_of_dead_runs_are_swept_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(comfy_host.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    roots = {}
    for name, owner in (("dead", dead.stdout.strip()), ("live", str(os.getppid())), ("mine", str(os.getpid())),
                        ("setup", None)):
        path = tmp_path / f"{comfy_host.ROOT_PREFIX}{name}"
        (path / "models").mkdir(parents=True)
        (path / "models" / "big.safetensors").write_bytes(b"x" * 1024)
        if owner is not None:
            (path / comfy_host.OWNER_FILE).write_text(owner)
        roots[name] = path
    (tmp_path / "someone-elses-dir").mkdir()
    comfy_host._sweep_dead_roots()
    assert {n for n, p in roots.items() if p.exists()} == {"live", "mine", "setup"}
    assert (tmp_path / "someone-elses-dir").exists()
