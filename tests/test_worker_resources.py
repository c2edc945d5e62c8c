"""How a worker uses its device's allocator, its CPU threads and its host-to-device copies: the habits that cost
nothing on CPU workers and time on every GPU call, checked here without a GPU.

- The caching allocator's blocks are returned to the device once a run is over, after a failure and on a model
  release, never between the calls of a stock sampler's run (each empty_cache is a device-wide sync, and the next
  call's cudaMallocs start over).
- GPU workers get their share of the cores, as CPU workers do (a load's host work ran on one thread).
- Weights travel to the device in the file's dtype and are cast there (a cast before the copy runs on the host).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import make_job
from parallel_runtime.runtime.worker import WorkerState
from parallel_runtime.spec import StrategySpec as S


# -- the allocator's cache -------------------------------------------------------------------------------------


def ksampler_calls(steps: int, strategy: S) -> list:
    """The jobs of a stock KSampler's run of `steps` model calls (one job per call; the last one says so)."""
    call = dataclasses.replace(make_job("unused.safetensors", strategy), timestep=torch.tensor([0.5]))
    return [dataclasses.replace(call, call_step=i, call_last=i == steps - 1) for i in range(steps)]


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(pipefusion_degree=2)], ids=lambda s: s.label())
def test_a_stock_sampler_run_empties_the_cache_once_not_per_call(monkeypatch, strategy):
    """A CUDA worker's state (no model: end_job's bookkeeping only) ends the jobs of KSampler runs of 4 and 12 calls:
    one empty_cache per run, at its last call, whatever its length; a failed job empties it too (an out-of-memory
    error leaves cached blocks no tensor uses)."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    state = WorkerState(0, 2, torch.device("cuda", 0))
    counts = []
    for steps in (4, 12):
        emptied.clear()
        for job in ksampler_calls(steps, strategy):
            state.end_job(job)
        counts.append(len(emptied))
    assert counts == [1, 1]
    emptied.clear()
    state.end_job(make_job("unused.safetensors", strategy))  # a Parallel Sampler job: the whole run in one job
    state.end_job(None)  # a failure
    assert len(emptied) == 2


# -- CPU threads -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, cores, threads", [
    ("0,1", 16, 8),  # GPU workers share the cores as CPU workers do
    ("0,1,2,3", 2, 1),  # at least one each
    ("cpu:2", 16, 8),
    ("cpu:0,cpu:1", 16, 1),  # each pinned to one core: one thread on it
])
def test_gpu_workers_get_their_share_of_the_cores(monkeypatch, spec, cores, threads):
    """The client's thread count per worker (passed as --threads, and as OMP/MKL_NUM_THREADS in the workers'
    environment), on a machine faking `cores` cores and four GPUs (no worker is started)."""
    import os

    from parallel_runtime.runtime.client import RuntimeClient

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    client = RuntimeClient(spec)
    env = client._worker_env()
    assert (client.threads, env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == (threads, str(threads), str(threads))


# -- casting weights on the device ---------------------------------------------------------------------------------


class CastsOnTheHost(TorchDispatchMode):
    """Every op that takes a host tensor and gives a tensor of another dtype (a reinterpreting view aside): on a GPU
    worker, a cast done on the host (with its one share of the cores) before the copy to the device."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        result = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
        if (source is not None and result is not None and source.device.type == "cpu"
                and result.dtype != source.dtype and func is not torch.ops.aten.view.dtype):
            self.casts.append(f"{func}: {source.dtype} -> {result.dtype} on {result.device}")
        return out


def test_weights_move_to_the_device_in_the_files_dtype_then_cast(tmp_path):
    """Reads onto a device (meta: no data, every op's device and dtype still checked) in another dtype than the
    file's: a safetensors tensor (whole and a row range: a tensor-parallel rank's part, a scale read in float32, a
    ControlNet's layers), a GGUF file's plain tensor and quantized one (dequantized where it lands). Each is copied
    in the file's dtype, then cast (and dequantized) on the device; on the CPU the same calls give the same values
    as a cast before the move (the same IEEE conversion)."""
    import gguf
    from safetensors.torch import save_file

    from parallel_runtime.weights.checkpoint import open_checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {"w32": torch.randn(64, 32, generator=g), "w16": torch.randn(64, 32, generator=g).half(),
               "w8": torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch="flux")
    writer.add_tensor("f16", tensors["w16"].numpy())
    writer.add_tensor("q8", gguf.quants.quantize(tensors["w32"].numpy(), gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reads = [("m.safetensors", "w32", None, torch.bfloat16), ("m.safetensors", "w32", slice(8, 24), torch.float16),
             ("m.safetensors", "w16", None, torch.float32), ("m.safetensors", "w8", None, torch.float32),
             ("m.gguf", "f16", None, torch.float32), ("m.gguf", "q8", slice(0, 32), torch.bfloat16)]
    for file, key, rows, dtype in reads:
        with open_checkpoint(str(tmp_path / file)) as reader:
            with CastsOnTheHost() as seen:
                moved = reader.read(key, rows=rows, dtype=dtype, device="meta")
            assert (moved.device.type, moved.dtype) == ("meta", dtype)
            assert seen.casts == [], (file, key, seen.casts)
            on_cpu = reader.read(key, rows=rows, dtype=dtype)
            as_stored = reader.read(key, rows=rows)
        assert torch.equal(on_cpu, as_stored.to(dtype)), (file, key)
