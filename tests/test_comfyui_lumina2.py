"""Lumina Image 2.0 against the host's own NextDiT (skipped without COMFYUI_DIR): ComfyUI's
comfy/ldm/lumina/model.py, built on the tiny file's shapes and loaded with its tensors in the host's Python, runs
the same model calls as the workers.

This compares the model, not the nodes: ComfyUI's Lumina2 extra_conds hands the model `num_tokens` (from the
Gemma encode's attention mask), a model input the parallel MODEL does not accept yet (nodes/remote_model.py's
known inputs), so a Load Parallel DiT vs UNETLoader graph cannot run; and ComfyUI's detection fixes Lumina 2's
width (2304, 24 heads), so a file it detects is ~1.7 GB in fp32.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from comfy_host import COMFYUI_DIR, COMFYUI_PYTHON, CPU_SHIM

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

from conftest import rel_err  # noqa: E402
from parallel_runtime.spec import StrategySpec as S  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from test_lumina2 import TINY, call_job  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# NextDiT sizes its MLP itself: 4 x width rounded up to a multiple of 256 (384 -> 512 at this width).
HOST = dataclasses.replace(TINY, ffn_dim=512)
# fp32 on CPU: the same maths in another op order (~1e-7 per op); exact strategies add their own reordering.
ONE_WORKER_RTOL, EXACT_RTOL = 1e-5, 1e-4

HOST_SCRIPT = """
import sys
import comfy.options
comfy.options.enable_args_parsing()
sys.argv = [sys.argv[0], "--cpu"]
import torch
import comfy.ops
from comfy.ldm.lumina.model import NextDiT
from safetensors.torch import load_file

path, inputs, out = {path!r}, {inputs!r}, {out!r}
c = torch.load(inputs)
m = NextDiT(patch_size=2, in_channels=16, dim=c["dim"], n_layers=c["layers"], n_refiner_layers=c["refiners"],
            n_heads=c["heads"], n_kv_heads=c["kv_heads"], qk_norm=True, cap_feat_dim=c["cap_dim"],
            axes_dims=c["axes"], axes_lens=[300, 512, 512], operations=comfy.ops.disable_weight_init)
sd = {{k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()}}
m.load_state_dict(sd, strict=True)
with torch.no_grad():
    rows = [m(x, t, context=cond, num_tokens=cond.shape[1]) for x, t, cond in c["calls"]]
torch.save(torch.cat(rows), out)
"""


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """(path, job) -> ComfyUI's NextDiT output for the job's rows, one call per branch (ComfyUI's batch of one)."""
    folder = tmp_path_factory.mktemp("lumina2_host")

    def run(path: str, job) -> torch.Tensor:
        branches = [b for b in (job.positive, job.negative) if b is not None]
        calls = [(job.latent[i:i + 1], job.timestep[i:i + 1], b.cond) for i, b in enumerate(branches)]
        inputs, out = str(folder / "inputs.pt"), str(folder / "out.pt")
        torch.save({"dim": HOST.hidden_size, "layers": HOST.num_layers, "refiners": HOST.num_refiner_layers,
                    "heads": HOST.num_heads, "kv_heads": HOST.num_kv_heads, "cap_dim": HOST.cap_feat_dim,
                    "axes": list(HOST.rope_axes), "calls": calls}, inputs)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (CPU_SHIM, COMFYUI_DIR) if p))
        proc = subprocess.run([COMFYUI_PYTHON, "-c", HOST_SCRIPT.format(path=path, inputs=inputs, out=out)],
                              cwd=COMFYUI_DIR, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(out)

    return run


@pytest.fixture(scope="module")
def lumina_file(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("lumina2") / "lumina2_tiny.safetensors"), HOST, seed=7,
                            prefix="model.diffusion_model.", dtype=torch.float32)


def test_lumina2_one_worker_equals_comfyui_nextdit(lumina_file, host_run, client1):
    job = call_job(lumina_file, S())
    err = rel_err(client1.run(job).latent, host_run(lumina_file, job))
    print(f"\nLumina 2, 1 worker vs ComfyUI's NextDiT: rel. L2 {err:.2e}")
    assert err < ONE_WORKER_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_lumina2_exact_strategies_equal_comfyui_nextdit(lumina_file, host_run, client2, strategy):
    job = call_job(lumina_file, strategy)
    err = rel_err(client2.run(job).latent, host_run(lumina_file, job))
    print(f"\nLumina 2, {strategy} vs ComfyUI's NextDiT: rel. L2 {err:.2e}")
    assert err < EXACT_RTOL
