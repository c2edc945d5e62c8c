"""Memory per rank: what each worker says it can use, and what a job would need there.

The budget comes from the workers themselves (their answer to the client's ping), never from the host
process: the host (ComfyUI) may hold models it is about to unload, reading GPU memory there would create a
CUDA context in it, and from the second prompt on the workers' own weights are in use but reusable.
"""
from __future__ import annotations

from ..errors import ConfigError

CUDA_USABLE = 0.9  # leave room for the CUDA context, NCCL buffers and allocator fragmentation
CPU_USABLE = 0.85  # leave room for the host process and the OS
CPU_WORKER_OVERHEAD = 600 * 2**20  # interpreter, torch and diffusers in a CPU worker that holds nothing yet


def worker_report(device, models: list[dict], stale_kv_bytes: int = 0) -> dict:
    """A worker's memory as it reports it (runs in the worker): free and total bytes of its device, and what it
    holds: the models (WorkerState.resident) and their bytes, which a new job of the same model reuses and a
    different one frees, or keeps beside it when there is room (keeps_other_models); and the stale K/V a stock
    sampler's PipeFusion or displaced patch call keeps for the next (WorkerState.stale_kv_bytes), which the next
    call reuses and any other job frees, so a job's need, which counts K/V buffers, must not find it spent too."""
    import psutil

    held = sum(int(m["bytes"]) for m in models) + int(stale_kv_bytes)
    report = {"held_bytes": held, "models": models, "stale_kv_bytes": int(stale_kv_bytes),
              "host_available": int(psutil.virtual_memory().available)}
    if device.type == "cuda":
        free, total = device_memory(device)
        report.update(device_free=free, device_total=total)
    return report


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, free counting what torch's caching allocator reserved but no tensor
    uses: it serves new tensors from those blocks first, and they stay reserved after a job's activations die or
    an out-of-memory error until empty_cache, while mem_get_info counts them as taken."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + int(cached), int(total)


def rank_budgets(devices: list[str], reports: list[dict]) -> list[int]:
    """Bytes each rank may use for a job: its free memory plus what it already holds."""
    cpu_workers = max(1, sum(d == "cpu" for d in devices))
    budgets = []
    for device, r in zip(devices, reports):
        if device.startswith("cuda") and "device_free" in r:
            budgets.append(int(r["device_free"] * CUDA_USABLE) + r["held_bytes"])
        else:  # CPU workers share the host's RAM
            budgets.append(int(r["host_available"] * CPU_USABLE / cpu_workers) + r["held_bytes"]
                           - (CPU_WORKER_OVERHEAD if not r["held_bytes"] else 0))
    return budgets


def weight_bytes(weight_dtype: str, device: str) -> int:
    """Bytes per parameter on a device for the loader's weight_dtype ('default' = ComfyUI's choice)."""
    if weight_dtype == "default":
        return 2 if device.startswith("cuda") else 4
    return {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3fn": 1, "fp8_e5m2": 1}.get(weight_dtype, 4)


def job_rank_memory(job, device: str, strategy=None, bytes_per_parameter: float | None = None) -> dict:
    """Estimated peak bytes on the fullest rank of `job` (parameters, KV buffers, activations); `strategy` and
    `bytes_per_parameter` ask what another plan or another file of the same model would need."""
    from ..distributed.topology import latent_plane
    from ..models.registry import token_patch
    from ..validate import model_config, stored_bytes_per_parameter
    from .costmodel import rank_memory

    config = model_config(job.model.path)
    b, _, *spatial = job.latent.shape
    h, w = latent_plane(spatial)  # a video's frames stack their token rows
    dtype = job.model.weight_dtype
    act = weight_bytes("default" if dtype.startswith("fp8") else dtype, device)  # fp8 computes in the default
    per_param = bytes_per_parameter or stored_bytes_per_parameter(job.model.path, dtype, act)
    patch = token_patch(config)
    return rank_memory(strategy or job.strategy, config, text_tokens=job.positive.cond.shape[1],
                       image_tokens=(h // patch) * (w // patch), batch=b, cfg=job.sampling.cfg, weight_bytes=per_param,
                       act_bytes=act)


def settle_weight_sharding(job, devices: list[str], reports: list[dict]):
    """The job with shard_weights "auto" settled: on where its plan does not fit the fullest rank unsharded but
    has ranks that hold the same blocks to shard them over; else off. Sharding costs a gather per block per pass,
    so it is never on where the weights fit."""
    import dataclasses

    s = job.strategy
    if s.shard_weights != "auto":
        return job
    fits = not reports or job_rank_memory(job, devices[0])["total"] <= min(rank_budgets(devices, reports))
    return dataclasses.replace(job, strategy=dataclasses.replace(s, shard_weights=not fits and s.shard_group > 1))


def _smaller_plans(job, devices: list[str]) -> list[str]:
    """What the plans that hold less per rank would need: PipeFusion over every device (each holds its stage's
    blocks), and the same plan from an fp8 (1 byte per weight) or GGUF Q4_K (~0.56) file of the model."""
    import dataclasses

    s, world, device = job.strategy, len(devices), devices[0]
    now = job_rank_memory(job, device)["total"]
    options = []
    if not s.sharded and s.shard_group > 1:
        sharded = dataclasses.replace(s, shard_weights=True)
        options.append(("shard_weights on", job_rank_memory(job, device, sharded)["total"]))
    if s.pipefusion_degree < world:
        pp = dataclasses.replace(s, pipefusion_degree=world, ulysses_degree=1, ring_degree=1, cfg_degree=1,
                                 naive_patch_degree=1, num_pipeline_patch=0)
        options.append((f"PipeFusion over {world} devices", job_rank_memory(job, device, pp)["total"]))
    if s.tensor_degree < world and _splits_tensor(job, world):
        tp = dataclasses.replace(s, tensor_degree=world, pipefusion_degree=1, ulysses_degree=1, ring_degree=1,
                                 cfg_degree=1, naive_patch_degree=1, patch_degree=1, num_pipeline_patch=0)
        options.append((f"tensor parallel over {world} devices", job_rank_memory(job, device, tp)["total"]))
    for name, per_param in (("an fp8 file", 1.0), ("a GGUF Q4_K file", 0.5625)):
        options.append((name, job_rank_memory(job, device, bytes_per_parameter=per_param)["total"]))
    # Only what saves memory: a long video's PipeFusion K/V buffers can outweigh the weights it spreads.
    return [f"{name} about {gb(need)}" for name, need in options if need < 0.9 * now]


def _splits_tensor(job, world: int) -> bool:
    """Whether the job's model splits its layers over `world` tensor-parallel ranks (heads and MLP divide)."""
    from ..models.registry import family_of
    from ..validate import model_config

    config = model_config(job.model.path)
    mlp = getattr(config, "mlp_hidden", world)
    return config.num_heads % world == 0 and mlp % world == 0 and bool(family_of(config).tensor_plan_for(config))


def _same_model(held: dict, model) -> bool:
    return (held["path"], held["weight_dtype"], held["quantized_matmul"]) == (
        model.path, model.weight_dtype, model.quantized_matmul)


def keeps_other_models(job, devices: list[str], reports: list[dict]) -> bool:
    """Whether every rank can run `job` with the other models it holds still resident (a Wan 2.2 graph's two experts
    take turns every prompt: reloading one costs seconds to minutes). When not, the workers release them before
    loading this job's model, and check_job_memory counts their bytes as free."""
    if not reports:
        return True
    need = job_rank_memory(job, devices[0])["total"]
    for budget, report in zip(rank_budgets(devices, reports), reports):
        others = sum(m["bytes"] for m in report.get("models", ()) if not _same_model(m, job.model))
        if need > budget - others:
            return False
    return True


def gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def check_job_memory(job, devices: list[str], reports: list[dict]) -> None:
    """Refuse, before any allocation, a job whose estimated memory per rank exceeds what a rank has."""
    if not reports:
        return
    need = job_rank_memory(job, devices[0])
    budgets = rank_budgets(devices, reports)
    rank = min(range(len(budgets)), key=budgets.__getitem__)
    if need["total"] <= budgets[rank]:
        return
    plans = _smaller_plans(job, devices)
    fixes = (f"per worker, {', '.join(plans)} would need; or " if plans else "") + \
        "lower the resolution, frames or batch, or pick weight_dtype bf16"
    if devices[rank] == "cpu" and len(set(devices)) == 1:
        fixes += ", or run on GPUs"
    raise ConfigError(
        f"this job needs about {gb(need['total'])} per worker (weights {gb(need['params'])}, activations "
        f"{gb(need['activations'])}, stale K/V {gb(need['kv'])}) but worker {rank} ({devices[rank]}) has "
        f"{gb(budgets[rank])} available; {fixes}.")
