"""What differs between the platforms ComfyUI runs on (Linux, Windows, macOS), chosen by what the platform offers
rather than by its name wherever a capability can be tested: Windows 10+ has AF_UNIX in the OS but not in CPython,
and some Linux builds of torch lack NCCL too."""
from __future__ import annotations

import os
import socket
import struct
import sys

# What a socket send or receive raises when its SO_SNDTIMEO / SO_RCVTIMEO ran out: EAGAIN on POSIX, WSAETIMEDOUT
# (TimeoutError) on Windows.
TIMED_OUT = (BlockingIOError, TimeoutError)


def module_command(module: str, root: str) -> list[str]:
    """The command that runs `module` as __main__ in a fresh interpreter with `root` first on sys.path (arguments
    follow it). Not `python -m` with PYTHONPATH: the Windows portable build's embedded Python has a ._pth file,
    which makes it ignore PYTHONPATH and the current directory."""
    boot = (f"import runpy, sys; sys.path.insert(0, {root!r}); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", boot]


def socket_timeout(seconds: float):
    """SO_SNDTIMEO / SO_RCVTIMEO's value: a DWORD of milliseconds on Windows, a struct timeval on POSIX (no
    capability to test here: the option's layout is the OS's ABI)."""
    if os.name == "nt":
        return max(1, round(seconds * 1000))
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


def send_small_messages_now(sock: socket.socket) -> None:
    """TCP_NODELAY on a TCP control socket (a no-op on AF_UNIX): Nagle's algorithm holds each small message (a
    step's progress, a cancel) until the previous one is acknowledged, and the peer's delayed ACK makes that ~40 ms,
    so over loopback TCP (Windows, or any machine without AF_UNIX) progress arrived in bursts and Cancel landed
    several steps late."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def collective_backend(device_type: str) -> str:
    """The process-group backend for workers on `device_type`: NCCL for CUDA where torch has it, else gloo."""
    import torch.distributed as dist

    return "nccl" if device_type == "cuda" and dist.is_nccl_available() else "gloo"


def worker_environment(env: dict, root: str, threads: int, interface: str | None, *, pin_interface: bool) -> dict:
    """`env` completed with what every worker process needs, one this machine's client starts or an agent on another
    machine: the plugin first on its path, the process group's transfers bound to `interface` (`pin_interface`:
    replacing what the environment names, as a multi-machine runtime must; else only where it names none), NCCL's
    error handling, and its CPU threads."""
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    if interface:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[var] = interface if pin_interface else env.get(var, interface)
    # On a collective timeout or a communicator error, NCCL's watchdog ends the process instead of leaving it spinning
    # on the device; the client reports the exit. 3 (SkipCleanUp, torch 2.x's default, set so an older default cannot
    # apply) skips ncclCommAbort, which can itself hang on a stuck communicator; 1 (TearDown) calls it first.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def loopback_interface() -> str | None:
    """The name of the network interface that carries 127.0.0.1 ('lo' on Linux, 'lo0' on macOS, 'Loopback
    Pseudo-Interface 1' on Windows), so gloo and NCCL bind there only; None if none does (they pick their own)."""
    return interface_of("127.0.0.1")


def interface_of(address: str) -> str | None:
    """The name of the network interface that carries the IPv4 `address` (the one a multi-machine runtime's
    transfers must use, so gloo and NCCL bind there and nowhere else); None if none does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def pin_to_core(core: int) -> None:
    """Run this process on one CPU core only (call it before torch starts its threads, so they inherit it)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    else:  # Windows (psutil has no affinity on macOS, which has no API to pin a process)
        import psutil

        psutil.Process().cpu_affinity([core])


_rss_high_water = 0  # where the OS keeps no peak of its own (see peak_rss)


def peak_rss() -> int:
    """This process's peak resident memory in bytes: getrusage's ru_maxrss where the `resource` module exists (KiB
    on Linux, bytes on macOS), else psutil's peak working set (Windows), else the highest RSS seen by the calls
    so far (a worker calls this at each step)."""
    global _rss_high_water
    try:
        import resource
    except ImportError:
        import psutil

        info = psutil.Process().memory_info()
        _rss_high_water = max(_rss_high_water, info.rss, getattr(info, "peak_wset", 0))
        return _rss_high_water
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def loopback_store(port: int, world: int, *, listen_fd: int | None = None, timeout_s: float = 60.0):
    """A torch TCPStore on 127.0.0.1: the server when `listen_fd` (a listening socket bound there, which the store
    then owns) is given, else a client of the one on `port`. TCPStore uses libuv by default, which some builds lack
    (Windows' wheels: "use_libuv was requested but PyTorch was built without libuv support"); torch refuses that
    before it touches the socket, so the store is then made again on its own backend, which takes the same fd."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dict(is_master=True, wait_for_workers=False, master_listen_fd=listen_fd) if listen_fd is not None else {}
    try:
        return dist.TCPStore("127.0.0.1", port, world, timeout=timedelta(seconds=timeout_s), **server)
    except dist.DistStoreError as exc:
        if "libuv" not in str(exc):
            raise
    return dist.TCPStore("127.0.0.1", port, world, timeout=timedelta(seconds=timeout_s), use_libuv=False, **server)
