"""The runtime on one GPU: parity with the CPU run through RuntimeClient (as the nodes call it), the step
loop's host-device syncs, a worker's out-of-memory error, and device strings with no GPU visible."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import warnings

import psutil
import pytest
import torch

from conftest import make_job, rel_err
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.distributed.comm import Comm
from parallel_runtime.strategies.denoise import Denoiser
from parallel_runtime.distributed.devices import default_dtype, parse_devices, resolve_dtype
from parallel_runtime.errors import ConfigError, OutOfMemory
from parallel_runtime.models.families.flux_adapter import load_flux
from parallel_runtime.models.families.flux_adapter import FluxAdapter
from parallel_runtime.sampling import SAMPLERS
from parallel_runtime.distributed.topology import Topology

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# fp32 GPU vs fp32 CPU: tests/test_parallel.py's EXACT_RTOL. cuBLAS and the memory-efficient attention kernel
# differ from the CPU's only in summation order (~1e-7 relative per op; fp32 matmuls do not use TF32 unless
# a program enables it), so 1e-4 is wide, while a dtype or device mix-up shows at 1e-2 or more.
FP32_RTOL = 1e-4
# bf16 GPU vs bf16 CPU: here every op runs a different kernel (cuBLAS vs oneDNN, CUDA flash vs CPU flash),
# each rounding an output element to the neighbouring bf16 value (2^-8 = 3.9e-3 apart) now and then: the
# situation of tests/test_comfyui_integration.py's KSAMPLER_BF16_RTOL (two implementations, measured 2.6e-3
# at cfg 1 and 8.5e-3 at cfg 2), so the same 2e-2. bf16 itself moves this job 0.16 from fp32.
BF16_RTOL = 2e-2


def _job(path, weight_dtype, **kw):
    job = make_job(path, **kw)
    return dataclasses.replace(job, model=dataclasses.replace(job.model, weight_dtype=weight_dtype))


@pytest.fixture(scope="module")
def cpu_latents(tiny_path):
    client = RuntimeClient("cpu:1")
    try:
        yield {d: client.run(_job(tiny_path, d)).latent for d in ("fp32", "bf16")}
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def gpu_client():
    client = RuntimeClient("0")
    yield client
    client.shutdown()


@pytest.mark.parametrize("weight_dtype,rtol", [("fp32", FP32_RTOL), ("bf16", BF16_RTOL)])
def test_one_gpu_matches_the_cpu(gpu_client, cpu_latents, tiny_path, weight_dtype, rtol):
    result = gpu_client.run(_job(tiny_path, weight_dtype))
    err = rel_err(result.latent, cpu_latents[weight_dtype])
    print(f"\n{weight_dtype}: GPU vs CPU rel. L2 error {err:.2e}")
    assert result.stats[0]["peak_device_bytes"] > 0  # it ran on the GPU
    assert err <= rtol


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_step_loop_syncs_at_most_once_per_step(gpu, tiny_path, sampler):
    """torch.cuda.set_sync_debug_mode('warn') warns on every host-device sync (.item(), a tensor in an `if`,
    a blocking copy either way). The one a step may have is _step_done's synchronize, which times the step;
    the first step also uploads the sampler's sigmas and is not counted."""
    config, model = load_flux(tiny_path, dtype=torch.bfloat16, device=gpu)
    context = AttentionContext()
    adapter = FluxAdapter(config, model, [range(config.num_layers + config.num_single_layers)], context)
    denoiser = Denoiser(adapter, Topology(), Comm(Topology(), 0, gpu), context)
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            denoiser.run(make_job(tiny_path, steps=6, sampler=sampler), progress=lambda i, n: marks.append(len(caught)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    per_step = [b - a for a, b in zip(marks, marks[1:])]
    syncs = [str(w.message)[:120] for w in caught[marks[0]:]]
    print(f"\n{sampler}: syncs per step after the first {per_step}")
    assert len(per_step) == 5 and max(per_step) <= 1, (per_step, syncs[:6])


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("preflight", [True, False], ids=["refused-before-work", "worker-oom"])
def test_out_of_memory_names_rank_and_device_and_leaves_no_orphan(gpu, tiny_path, monkeypatch, preflight):
    """A 16384x16384 image (1M tokens) on a GPU with 2 GiB left. The client's memory check refuses it before
    any work; with that check off, the worker itself runs out of memory. Either way the message names the
    rank and its device, and no worker process outlives the client."""
    import parallel_runtime.runtime.client as client_module
    import parallel_runtime.planning.memory as memory_module

    if not preflight:
        for module in (client_module, memory_module):
            monkeypatch.setattr(module, "check_job_memory", lambda *args, **kwargs: None, raising=False)
    free, _ = torch.cuda.mem_get_info(gpu)
    hog = torch.empty(max(free - 2 * 2**30, 0), dtype=torch.uint8, device=gpu)  # leave 2 GiB to the worker
    client = RuntimeClient("0")
    pids: list[int] = []
    try:
        client.start()
        pids = [p.pid for p in client.procs]
        absurd = _job(tiny_path, "fp32", steps=1, cfg=1.0, size=2048)
        expected = (ConfigError, r"worker 0 \(cuda:0\)") if preflight else (OutOfMemory, r"rank 0 \(cuda:0\) ran out")
        with pytest.raises(expected[0], match=expected[1]):
            client.run(absurd)
        hog = None
        out = client.run(_job(tiny_path, "fp32", steps=1))  # the next job runs (on fresh workers after an OOM)
        assert torch.isfinite(out.latent).all()
        pids += [p.pid for p in client.procs]
    finally:
        hog = None  # noqa: F841 - give the memory back even when the test fails
        torch.cuda.empty_cache()
        client.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert pids and not [p for p in pids if _running(p)]


def test_device_strings(gpu):
    n = torch.cuda.device_count()
    assert parse_devices("auto") == [f"cuda:{i}" for i in range(n)]
    assert parse_devices("0") == ["cuda:0"]
    with pytest.raises(ConfigError, match=f"only {n} GPU"):
        parse_devices(str(n))
    capability = torch.cuda.get_device_capability(gpu)
    assert resolve_dtype("default", torch.device(gpu)) == default_dtype("cuda", capability)
    # With no GPU visible, 'auto' is one CPU worker and a GPU index is refused with the fix.
    code = ("from parallel_runtime.distributed.devices import parse_devices\n"
            "print(parse_devices('auto'))\n"
            "try:\n    parse_devices('0')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "['cpu']"
    assert lines[1].startswith("ConfigError") and "only 0 GPU(s) are visible" in lines[1]
