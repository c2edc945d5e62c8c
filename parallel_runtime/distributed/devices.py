"""Parsing the loader's `devices` string into torch device names."""
from __future__ import annotations

import re

from ..errors import ConfigError


PINNED_CPU = re.compile(r"cpu:\d+(\s*,\s*cpu:\d+)+")


def parse_devices(spec: str) -> list[str]:
    """'auto' = every visible GPU (one CPU worker if none); '0,1,2,3' = those GPUs; 'cpu:N' = N CPU workers;
    'cpu:0,cpu:0,cpu:1' = one CPU worker per entry, pinned to that core (see pinned_cores)."""
    spec = (spec or "auto").strip().lower()
    if PINNED_CPU.fullmatch(spec):
        return ["cpu"] * len(pinned_cores(spec))
    if spec == "auto":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    m = re.fullmatch(r"cpu(?::(\d+))?", spec)
    if m:
        n = int(m.group(1) or 1)
        if not 1 <= n <= 64:
            raise ConfigError(f"devices {spec!r} asks for {n} CPU workers; use cpu:1 to cpu:64.")
        return ["cpu"] * n
    if re.fullmatch(r"\d+(\s*,\s*\d+)*", spec):
        ids = [int(s) for s in spec.split(",")]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"devices {spec!r} lists a GPU twice; list each GPU index once, e.g. 0,1,2,3.")
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        missing = [i for i in ids if i >= n]
        if missing:
            raise ConfigError(f"devices {spec!r} names GPU {missing[0]}, but only {n} GPU(s) are visible; "
                              f"use indices below {n}, 'auto', or cpu:N.")
        return [f"cuda:{i}" for i in ids]
    raise ConfigError(f"devices {spec!r} is not understood; use 'auto', GPU indices like '0,1,2,3', 'cpu:N', or CPU "
                      f"cores like 'cpu:0,cpu:0,cpu:1'.")


def pinned_cores(spec: str) -> list[int | None]:
    """The core each worker is pinned to, per rank (None: not pinned). A list of two or more 'cpu:K' entries pins
    worker i to core K: two workers on one core each run at about half speed, which is how unequal devices (a fast
    card beside a slow one) are emulated on one machine for the load-balancing tests and the bench."""
    spec = (spec or "auto").strip().lower()
    if not PINNED_CPU.fullmatch(spec):
        return [None] * len(parse_devices(spec))
    cores = [int(part.split(":")[1]) for part in spec.split(",")]
    import os

    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    missing = [c for c in cores if c not in usable]
    if missing:
        raise ConfigError(f"devices {spec!r} pins a worker to core {missing[0]}, but this process may use cores "
                          f"{','.join(map(str, usable))}; name only those.")
    return cores


def worker_threads(devices: list[str], pinned: list[int | None]) -> int:
    """CPU threads per worker (torch's, OMP's and MKL's): the cores this process may use shared evenly among the
    workers, at least 1; 1 where each worker is pinned to a core. GPU workers take their share too: a load reads and
    copies on the host, and a launch-bound step is host work."""
    import os

    if any(core is not None for core in pinned):
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, usable // max(len(devices), 1))


def auto_notice(spec: str, devices: list[str]) -> str | None:
    """One sentence when 'auto' found no GPU and fell back to a single CPU worker, so the user is told before
    a model loads instead of waiting minutes on a slow fp32 CPU denoise (FLUX.1-dev needs ~48 GB of RAM)."""
    if (spec or "auto").strip().lower() == "auto" and devices == ["cpu"]:
        return ("no GPU is visible to this process, so devices=auto runs one CPU worker in fp32 (slow; a full Flux "
                "model needs about 48 GB of RAM) — make the GPUs visible, or set devices to cpu:N to mean it.")
    return None


# Why several GPUs cannot share a prompt where torch has no NCCL. Gloo could carry CUDA tensors staged through
# host memory; measured on loopback it moves 0.2-0.9 GB/s, seconds per step for Ulysses or Ring (see README).
NO_NCCL = ("this PyTorch has no NCCL (Windows builds ship none), which several GPUs need to work on one prompt; use "
           "one GPU (devices 0, one prompt at a time) or CPU workers (devices cpu:N), or run ComfyUI on Linux or WSL2 "
           "for multi-GPU")


def runtime_devices(spec: str) -> tuple[list[str], str | None]:
    """The devices one runtime's workers run on, and a notice for the nodes to show before anything loads. As
    parse_devices, except where torch has no NCCL: 'auto' then takes the first GPU alone and says why, and a list
    of several GPUs is refused in one sentence. CPU workers talk over gloo and need no NCCL."""
    import torch.distributed as dist

    devices = parse_devices(spec)
    if sum(d.startswith("cuda") for d in devices) < 2 or dist.is_nccl_available():
        return devices, auto_notice(spec, devices)
    if (spec or "auto").strip().lower() == "auto":
        return devices[:1], f"devices=auto runs on {devices[0]} alone: {NO_NCCL}."
    raise ConfigError(f"devices {spec!r} names {len(devices)} GPUs, but {NO_NCCL}.")


WEIGHT_DTYPES = ("default", "bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2")  # Load Parallel DiT's choices


def named_dtype(name: str):
    """The torch dtype of a weight_dtype name other than 'default' (fp32, bf16, fp16, fp8_e4m3fn, fp8_e5m2),
    else None. The fp8 names store linear weights in fp8 (UNETLoader's options of the same names)."""
    import torch

    from ..weights.storage import FP8_WEIGHT_DTYPES  # the storage rule's own table of the fp8 names

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, **FP8_WEIGHT_DTYPES}.get(name)


def default_dtype(device_type: str, capability: tuple[int, int] | None = None):
    """weight_dtype 'default', as ComfyUI picks it: half precision where the device computes it fast. bf16
    needs compute capability 8.0 (Ampere); older GPUs (Volta, Turing) get fp16. CPU: fp32."""
    import torch

    if device_type != "cuda":
        return torch.float32
    return torch.bfloat16 if capability is None or tuple(capability) >= (8, 0) else torch.float16


def resolve_dtype(name: str, device):
    """The dtype layers compute in for the loader's weight_dtype (fp8 weights compute in the default one)."""
    import torch

    if name not in WEIGHT_DTYPES or (name != "default" and named_dtype(name) is None):
        raise ConfigError(f"weight_dtype {name!r} is unknown; choose one of {', '.join(WEIGHT_DTYPES)}.")
    if name == "default" or name.startswith("fp8"):
        return default_dtype(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    return named_dtype(name)
