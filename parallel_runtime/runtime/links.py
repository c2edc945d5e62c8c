"""Startup checks of the links between the workers, so a board whose GPUs cannot talk fails at startup in one
sentence naming the fix, instead of hanging at a job's first transfer.

- `check_links` (in every worker, before it reports ready): one small all-to-all over the default group, i.e. a
  message between every pair of ranks over the transport a job uses (NCCL's peer-to-peer or shared memory, gloo's
  TCP), bounded by a short timeout and checked for content. Boards that advertise GPU peer-to-peer but corrupt or
  drop it (many consumer boards, some virtualised ones) are what it catches; NCCL_P2P_DISABLE=1 is the fix.
- `shared_memory_problem` (in the client, before any worker starts): NCCL moves data between GPUs without
  peer-to-peer access through /dev/shm, and Docker's default /dev/shm of 64 MB is too small for it.
"""
from __future__ import annotations

import os
import time

import torch

from ..errors import ConfigError

PROBE_BYTES = 64 * 1024  # sent to each peer: past NCCL's smallest-message protocol, still instant
CHECK_TIMEOUT_S = float(os.environ.get("PARADIT_LINK_CHECK_S", "30"))  # a healthy link answers in milliseconds
# /dev/shm below this is refused where NCCL goes through it. NCCL's shared-memory transport keeps a few MiB of
# buffers per channel and peer; its documentation asks containers for --shm-size=1g or --ipc=host.
SHM_NEEDED_BYTES = 512 * 2**20
SHM_FIX = "start the container with --shm-size=1g or --ipc=host"
P2P_SETTINGS = ("auto", "off")  # the Strategy Selector's p2p


def p2p_setting(p2p: str) -> str:
    """'off' where asked for, or where this process's environment says so (PARADIT_NCCL_P2P=off, or NCCL_P2P_DISABLE
    set, which the workers inherit anyway); else 'auto'."""
    if p2p not in P2P_SETTINGS:
        raise ConfigError(f"p2p must be one of {', '.join(P2P_SETTINGS)}, got {p2p!r}.")
    off = p2p == "off" or os.environ.get("PARADIT_NCCL_P2P", "").strip().lower() == "off" or p2p_disabled()
    return "off" if off else "auto"


def p2p_disabled() -> bool:
    """Whether this process's NCCL runs with peer-to-peer transfers off (a worker's: the client passes it on)."""
    return os.environ.get("NCCL_P2P_DISABLE", "0").strip() not in ("", "0")


def check_links(rank: int, world: int, device: torch.device, backend: str, timeout_s: float = CHECK_TIMEOUT_S,
                label: str | None = None):
    """Exchange PROBE_BYTES with every other rank (one all_to_all_single on the default group) and check what
    arrived; returns None, or the sentence that says why the workers cannot run a job and what to do."""
    import torch.distributed as dist

    n = PROBE_BYTES // 4
    # The chunk rank r sends to rank j holds r * world + j: each receiver knows what each sender must have sent.
    send = (torch.arange(world, device=device, dtype=torch.float32) + rank * world).repeat_interleave(n)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return _broken_link(rank, label or device, backend, f"got no answer within {timeout_s:g} s")
        time.sleep(0.005)
    work.wait()
    expected = (torch.arange(world, device=device, dtype=torch.float32) * world + rank).repeat_interleave(n)
    if not torch.equal(recv, expected):
        return _broken_link(rank, label or device, backend, "received corrupted data")
    return None


def _broken_link(rank: int, device, backend: str, what: str) -> str:
    start = f"at startup, rank {rank} ({device}) {what} in a {PROBE_BYTES // 1024} KiB test exchange with its peers"
    if os.environ.get("PARADIT_MULTIHOST"):  # ranks on several machines (set by the client and the agents)
        return (f"{start} across the machines' network: check that their firewalls let the workers connect to each "
                f"other on the runtime's interfaces (docs/multinode.md, 'What listens, where'), then retry.")
    if backend != "nccl":
        return (f"{start} over loopback TCP (127.0.0.1): check that no firewall, VPN or security tool blocks local "
                f"connections between Python processes, then retry.")
    if p2p_disabled():
        return (f"{start} even with NCCL_P2P_DISABLE=1, which sends GPU-to-GPU traffic through /dev/shm: if this "
                f"runs in a container, {SHM_FIX}; else run one GPU (devices 0) and report the board.")
    return (f"{start}: peer-to-peer transfers between these GPUs are likely broken (common on consumer boards) — "
            f"turn them off with NCCL_P2P_DISABLE=1 (the Strategy Selector's p2p: off, or PARADIT_NCCL_P2P=off in "
            f"ComfyUI's environment) and retry.")


def shared_memory_problem(devices: list[str], p2p_off: bool, shm_path: str = "/dev/shm") -> str | None:
    """One sentence if NCCL will move data through `shm_path` and it has too little room; else None. NCCL goes
    through it for every pair of GPUs without peer-to-peer access: all of them with p2p off, else the pairs that
    report no access (consumer cards, mixed cards)."""
    gpus = [torch.device(d) for d in devices if d.startswith("cuda")]
    if len(gpus) < 2 or not hasattr(os, "statvfs") or not os.path.isdir(shm_path):
        return None  # one GPU, CPU workers, or no /dev/shm (Windows: no NCCL there; see devices.runtime_devices)
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    through_shm = p2p_off or not all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)
    stat = os.statvfs(shm_path)
    free = stat.f_bavail * stat.f_frsize
    if not through_shm or free >= SHM_NEEDED_BYTES:
        return None
    why = "peer-to-peer is off" if p2p_off else "these GPUs have no peer-to-peer access"
    return (f"{shm_path} has {free / 2**20:.0f} MB free, but NCCL moves data between the GPUs through it ({why}) and "
            f"needs at least {SHM_NEEDED_BYTES // 2**20} MB: {SHM_FIX}.")
