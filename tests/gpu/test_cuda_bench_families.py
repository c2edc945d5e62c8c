"""Every family the bench runs, on one GPU against the same job on the CPU, in fp32 and in bf16.

test_cuda_families.py covers six tiny configs of the first families; this covers all of bench/models.py's
BENCH_FAMILIES (FLUX.2/.3, HiDream I1/O1, Kandinsky 5/6, LTX-2, MiniMax-H3, Wan, HunyuanVideo 1.5, Z-Image, Qwen-Image
2.1, ...) at the bench's width (256), through RuntimeClient as the nodes start it: a sampled job of 3 steps at CFG 2
for image and video families, one stock-sampler model call (both streams) for the audio-video ones. The sizes are
each family's smallest the bench smoke-runs (256x256 px; 5 frames for video)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_err
from parallel_runtime.bench.av_calls import AV_FAMILIES, AV_SIZES, av_shape, call_job
from parallel_runtime.bench.cli import bench_latent
from parallel_runtime.bench.models import BENCH_FAMILIES
from parallel_runtime.bench.runs import make_job
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.spec import StrategySpec

from .test_cuda_runtime import BF16_RTOL, FP32_RTOL

pytestmark = pytest.mark.timeout(900)

SIDE, FRAMES, TEXT, CFG, STEPS = 256, 5, 32, 2.0, 3


def bench_job(name: str, path: str):
    """The family's smallest bench job at SIDE px: PixArt raised to its smallest position table, as bench's --quick."""
    config = BENCH_FAMILIES[name]
    side = max(SIDE, -(-getattr(config, "min_mean_latent_side", 0) * 8 // 16) * 16)
    if config.family in AV_FAMILIES:
        shape = av_shape(config, side, side, FRAMES, AV_SIZES[config.family]["fps"])
        return dataclasses.replace(call_job(path, config, StrategySpec(), shape, TEXT, CFG), call_step=0,
                                   call_last=True)
    latent_shape, _ = bench_latent(config, side, side, FRAMES if config.video else None)
    return make_job(path, config, StrategySpec(), latent_shape, TEXT, CFG, STEPS)


def _in(job, weight_dtype: str):
    return dataclasses.replace(job, model=dataclasses.replace(job.model, weight_dtype=weight_dtype))


def _outputs(result) -> torch.Tensor:
    """The latent, and the audio latent beside it where the family has one, as one vector."""
    parts = [result.latent] + ([result.audio] if getattr(result, "audio", None) is not None else [])
    return torch.cat([p.float().flatten() for p in parts])


@pytest.fixture(scope="module")
def clients():
    cpu, gpu = RuntimeClient("cpu:1", threads_per_worker=8), RuntimeClient("0")
    try:
        yield cpu, gpu
    finally:
        cpu.shutdown()
        gpu.shutdown()


@pytest.mark.parametrize("name", sorted(BENCH_FAMILIES))
def test_each_bench_family_on_the_gpu_matches_the_cpu_in_fp32_and_bf16(gpu, clients, tmp_path, name):
    """Tolerances as test_cuda_families.py's (reasons there): fp32 within FP32_RTOL, or 64 units of kernel
    round-off where the family's conditioning amplifies it; bf16 within BF16_RTOL; and bf16 no further from fp32 on
    the GPU than on the CPU, give or take BF16_RTOL (a cast in the wrong place, or a bf16 accumulation, shows)."""
    path = write_checkpoint(str(tmp_path / f"{name}.safetensors"), BENCH_FAMILIES[name], seed=0)
    job = bench_job(name, path)
    cpu, gpu_client = clients
    out = {(where, d): _outputs(client.run(_in(job, d)))
           for where, client in (("cpu", cpu), ("gpu", gpu_client)) for d in ("fp32", "bf16")}
    assert all(torch.isfinite(v).all() for v in out.values())
    fp32, bf16 = rel_err(out["gpu", "fp32"], out["cpu", "fp32"]), rel_err(out["gpu", "bf16"], out["cpu", "bf16"])
    gap_gpu, gap_cpu = rel_err(out["gpu", "bf16"], out["gpu", "fp32"]), rel_err(out["cpu", "bf16"], out["cpu", "fp32"])
    print(f"\n{name}: GPU vs CPU fp32 {fp32:.2e}, bf16 {bf16:.2e}; bf16 vs fp32 GPU {gap_gpu:.2e}, CPU {gap_cpu:.2e}")
    assert fp32 <= max(FP32_RTOL, 64 * gap_cpu / 2**15) and bf16 <= BF16_RTOL
    assert gap_gpu <= gap_cpu + BF16_RTOL
