"""A worker process: owns one device, joins the process group, caches the model, runs jobs.

Started by the client as `python -m parallel_runtime.worker` from a clean interpreter (never by
re-importing the host's __main__). The auth key arrives on stdin, not argv or the environment, so other
users cannot read it from /proc. A reader thread serves the control channel while the main thread
computes: it flags cancels, and ends the process the moment the client goes away, so a
dead host never leaves orphans.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch

from .errors import Cancelled, ConfigError, ParaDiTError
from .protocol import Channel


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _device_bytes(device: torch.device) -> int | None:
    """Accelerator memory in use; None for CPU workers, which have none apart from their RSS."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class WorkerState:
    """The model this worker holds and the process groups it has built, reused across jobs."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.loaded_key = None
        self.adapter = None
        self.context = None
        self.comms: dict = {}
        self.cancel = threading.Event()
        self.last_load_seconds = 0.0

    # -- model ---------------------------------------------------------------------------------------

    def ensure_model(self, model_spec: dict, topology) -> bool:
        """Load the blocks this rank's pipeline stage owns; returns True if it had to (re)load."""
        from .attention.processor import AttentionContext
        from .loading import CheckpointReader
        from .models.flux import build_transformer, detect_layout, infer_config
        from .models.flux_adapter import FluxAdapter, pipeline_stages, stage_ownership

        path = model_spec["path"]
        stat = os.stat(path)
        stage, stages = topology.coords(self.rank)["pipefusion"], topology.pipefusion
        key = (path, stat.st_mtime_ns, stat.st_size, model_spec["weight_dtype"], stage, stages)
        if key == self.loaded_key:
            return False
        self.adapter = self.loaded_key = None  # free the old weights before reading new ones
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            layout, prefix = detect_layout(reader.keys(), os.path.basename(path))
            config = infer_config(reader, layout, prefix)
            chunks = pipeline_stages(config, stages)[stage]
            owned = stage_ownership(config, chunks, first=stage == 0, last=stage == stages - 1)
            dtype = resolve_dtype(model_spec["weight_dtype"], self.device)
            model = build_transformer(config, reader, layout, prefix, owned=owned, dtype=dtype, device=self.device)
        self.context = AttentionContext()
        self.adapter = FluxAdapter(config, model, chunks, self.context)
        self.loaded_key = key
        self.last_load_seconds = time.perf_counter() - t0
        return True

    def comm_for(self, topology):
        from .comm import Comm

        if topology not in self.comms:
            # Keep one topology's groups: auto may pick a new one per resolution, and each set of NCCL
            # communicators holds device memory. new_group and teardown are collective, and every rank
            # sees the same job sequence, so all ranks do both at the same point.
            for old in self.comms.values():
                old.close()
            self.comms = {topology: Comm(topology, self.rank, self.device)}
        return self.comms[topology]

    def release(self) -> None:
        self.adapter = self.loaded_key = self.context = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name == "default":
        # As ComfyUI: half precision where the device computes it fast, full precision on CPU.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ConfigError(f"weight_dtype {name!r} is unknown; choose default, bf16, fp16 or fp32.")
    return table[name]


def run_job(state: WorkerState, chan: Channel, meta: dict, tensors: dict) -> None:
    from .denoise import Denoiser
    from .loading import parameter_bytes
    from .spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
    from .topology import Topology

    strategy = StrategySpec(**meta["strategy"])
    topology = Topology.from_strategy(strategy)
    job = Job(ModelSpec(**meta["model"]), strategy, SamplingSpec(**meta["sampling"]), tensors["latent"],
              Conditioning(tensors["positive.cond"], tensors["positive.pooled"], meta.get("positive_guidance")),
              (Conditioning(tensors["negative.cond"], tensors["negative.pooled"], meta.get("negative_guidance"))
               if "negative.cond" in tensors else None), extra=meta.get("extra", {}))
    loaded = state.ensure_model(meta["model"], topology)
    comm = state.comm_for(topology)
    comm.reset_traffic()
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)
    denoiser = Denoiser(state.adapter, topology, comm, state.context)

    def progress(step: int, total: int) -> None:
        # Every rank reports each step with its memory (live status); the result rank's drives the bar.
        times = denoiser.step_times
        chan.send("progress", {"rank": state.rank, "step": step, "total": total, "report": denoiser.reports_progress,
                               "sec_per_step": times[-1] if times else None,
                               "device_bytes": _device_bytes(state.device)})

    t0 = time.perf_counter()
    latent = denoiser.run(job, progress=progress, cancel_requested=state.cancel.is_set)
    stats = {
        "rank": state.rank, "loaded": loaded, "load_seconds": state.last_load_seconds,
        "job_seconds": time.perf_counter() - t0, "step_times": denoiser.step_times,
        "traffic": comm.traffic.snapshot(), "param_bytes": parameter_bytes(state.adapter.model),
        "kv_cache_bytes": denoiser.cache.nbytes() if hasattr(denoiser, "cache") else 0,
        "peak_rss_bytes": _peak_rss(),
        "peak_device_bytes": torch.cuda.max_memory_allocated(state.device) if state.device.type == "cuda" else 0,
    }
    chan.send("done", stats, {"latent": latent} if latent is not None else None)


def _error_meta(exc: BaseException, state: WorkerState) -> dict:
    if isinstance(exc, torch.OutOfMemoryError):
        kind, message = "OutOfMemory", (
            f"rank {state.rank} ({state.device}) ran out of memory; lower the resolution or batch, pick "
            f"weight_dtype bf16, or raise pipefusion_degree so each device holds fewer blocks.")
    elif isinstance(exc, ParaDiTError):
        kind, message = type(exc).__name__, str(exc)
    else:
        kind, message = "WorkerError", f"rank {state.rank} ({state.device}) failed: {type(exc).__name__}: {exc}"
    return {"type": kind, "message": message, "traceback": traceback.format_exc(limit=20)}


def serve(state: WorkerState, chan: Channel) -> None:
    jobs: queue.Queue = queue.Queue()

    def reader() -> None:
        while True:
            try:
                kind, meta, tensors = chan.recv()
            except (EOFError, OSError):
                os._exit(0)  # the client is gone: nobody will read our results
            if kind == "cancel":
                state.cancel.set()
            else:
                if kind == "job":
                    # Cleared here, in message order, so a cancel right behind its job is never lost.
                    state.cancel.clear()
                jobs.put((kind, meta, tensors))

    threading.Thread(target=reader, daemon=True, name="paradit-control").start()
    while True:
        kind, meta, tensors = jobs.get()
        if kind == "shutdown":
            return
        if kind == "release":
            state.release()
            chan.send("released", {"rank": state.rank})
            continue
        if kind == "job":
            try:
                run_job(state, chan, meta, tensors)
            except Cancelled:
                chan.send("cancelled", {"rank": state.rank})
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the client
                chan.send("error", _error_meta(exc, state))


def main(argv: list[str] | None = None) -> None:
    from multiprocessing.connection import Client

    ap = argparse.ArgumentParser(description="ParaDiT worker (started by the runtime client)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    authkey = bytes.fromhex(sys.stdin.readline().strip())
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chan = Channel(Client(args.socket, family="AF_UNIX", authkey=authkey))

    import torch.distributed as dist

    store = None
    if args.world > 1 and args.rank == 0:
        # Rendezvous on loopback only: TCPStore given a host still listens on every interface, so hand it a
        # socket already bound to 127.0.0.1. The port reaches the other ranks over the control channel.
        import socket

        listen = socket.socket()
        listen.bind(("127.0.0.1", 0))
        listen.listen()
        store = dist.TCPStore("127.0.0.1", listen.getsockname()[1], args.world, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60), master_listen_fd=listen.fileno())
    chan.send("hello", {"rank": args.rank, "pid": os.getpid(), "store_port": store.port if store else None})
    kind, meta, _ = chan.recv()
    if kind != "init":
        return
    if args.world > 1:
        if store is None:
            store = dist.TCPStore("127.0.0.1", meta["store_port"], args.world, is_master=False,
                                  timeout=timedelta(seconds=60))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(meta["session"], store), rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=600),
                                **({"device_id": device} if device.type == "cuda" else {}))
    chan.send("ready", {"rank": args.rank})
    serve(WorkerState(args.rank, args.world, device), chan)
    chan.close()
    os._exit(0)  # skip interpreter teardown: process-group destructors can block on dead peers


if __name__ == "__main__":
    main()
