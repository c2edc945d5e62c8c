"""A worker process: owns one device, joins the process group, caches the model, runs jobs.

Started by the client as `python -m parallel_runtime.runtime.worker` from a clean interpreter (never by
re-importing the host's __main__). The auth key arrives on stdin, not argv or the environment, so other
users cannot read it from /proc. A reader thread serves the control channel while the main thread
computes: it flags cancels, and ends the process the moment the client goes away, so a
dead host never leaves orphans.
"""
from __future__ import annotations

import argparse
import collections
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..distributed.devices import resolve_dtype
from ..distributed.portability import (collective_backend, loopback_store, peak_rss, pin_to_core,
                                       send_small_messages_now)
from ..errors import Cancelled, ConfigError, ParaDiTError
from .links import check_links
from .protocol import Channel


def _device_bytes(device: torch.device) -> int | None:
    """Accelerator memory in use; None for CPU workers, which have none apart from their RSS."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


# Models a worker keeps resident at once, memory allowing: the two experts of a Wan 2.2 14B graph (high noise, then
# low noise, every prompt) must not reload each other; a third model is rare and the estimate too rough to stack more.
MODELS_KEPT = 2


@dataclass
class ResidentModel:
    """A model a worker holds with what was built for it; parked (kept, idle) while another model's jobs run."""

    # (path, mtime, size, weight_dtype, matmul, stage, stages, tensor rank, tensor degree, stage speeds, weight shard)
    key: tuple
    adapter: object
    family: object
    context: object
    patcher: object
    controlnets: dict
    control_configs: dict

    @property
    def name(self) -> str:
        return os.path.basename(self.key[0])


class WorkerState:
    """The models this worker holds and the process groups it has built, reused across jobs."""

    def __init__(self, rank: int, world: int, device: torch.device, collective_timeout: timedelta | None = None,
                 label: str | None = None):
        """`collective_timeout`: every process group's (the default group's too); None for one rank, which has none.
        `label`: what messages call the device ("box-b cuda:0" on another machine; the device itself here)."""
        self.rank, self.world, self.device = rank, world, device
        self.label = label or str(device)
        self.collective_timeout = collective_timeout
        self.parked: collections.OrderedDict = collections.OrderedDict()  # key -> ResidentModel, least recent first
        self.released: list[str] = []  # models this job's load released to make room (its stats report them)
        self.models_lock = threading.Lock()  # the model slots, read by the control thread's ping answers
        self.loaded_key = None
        self.adapter = None
        self.family = None  # the loaded model's family (models.registry): the seam for per-job settings
        self.context = None
        self.comms: dict = {}
        self.groups = None  # comm.GroupPool: process groups kept across jobs and topologies
        self.cancel = threading.Event()
        self.last_load_seconds = 0.0
        self.patcher = None  # weights.patches.RankWeightPatcher of the loaded model
        self.weight_patches = None  # the job's WeightPatches (kept for a reload)
        self.kept_patches = collections.OrderedDict()  # id -> WeightPatches, in lockstep with the client's
        # ControlNet hints and attention masks by key (host memory), kept in lockstep with the client's.
        self.hints = collections.OrderedDict()
        self.controlnets: dict = {}  # (path, mtime, size) -> loaded ControlNet adapter, for the loaded model
        self.control_configs: dict = {}  # (path, mtime, size) -> config, on ranks that only add residuals

    # -- model ---------------------------------------------------------------------------------------

    def ensure_model(self, model_spec: dict, topology, keep_others: bool = True,
                     stage_speeds: tuple[float, ...] = ()) -> bool:
        """Make the job's model current: the one held, a parked one, or the blocks this rank's pipeline stage owns
        read from the file; returns True if it had to read. The model it replaces stays parked when
        `keep_others` (the client found memory for both), at most MODELS_KEPT in all; else it is released first."""
        path = model_spec["path"]
        stat = os.stat(path)
        coords = topology.coords(self.rank)
        stage, stages = coords["pipefusion"], topology.pipefusion
        matmul = model_spec.get("quantized_matmul", "auto")
        key = (path, stat.st_mtime_ns, stat.st_size, model_spec["weight_dtype"], matmul, stage, stages,
               coords["tensor"], topology.tensor, tuple(stage_speeds), weight_shard(topology, self.rank))
        with self.models_lock:
            if key != self.loaded_key:
                self._park_current()
            others = [k for k in self.parked if k != key]
            # Another slicing or dtype of the same file is never kept beside it (the weights twice over); past
            # MODELS_KEPT the least recently used go.
            drop = others if not keep_others else [k for k in others if k[0] == path]
            kept = [k for k in others if k not in drop]
            drop += kept[:max(0, len(kept) - (MODELS_KEPT - 1))]
            self.released = [self.parked.pop(k).name for k in drop]
            if key in self.parked:
                self._make_current(self.parked.pop(key))
        if self.released and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if key == self.loaded_key:
            return False
        self._load(model_spec, key, stage, stages)
        return True

    def _current(self) -> ResidentModel | None:
        """The current model's slots as one ResidentModel (None while none is loaded)."""
        if self.adapter is None:
            return None
        return ResidentModel(self.loaded_key, self.adapter, self.family, self.context, self.patcher, self.controlnets,
                             self.control_configs)

    def _park_current(self) -> None:
        """Keep the current model idle (its stale K/V dropped: it belongs to the last run) and clear the slots."""
        current = self._current()
        if current is not None:
            current.context.stale_kv.clear()
            self.parked[current.key] = current
        self.adapter = self.loaded_key = self.patcher = self.family = self.context = None
        self.controlnets, self.control_configs = {}, {}  # built for that model's dtype and attention context

    def _make_current(self, model: ResidentModel) -> None:
        self.loaded_key, self.adapter, self.family, self.context = model.key, model.adapter, model.family, model.context
        self.patcher, self.controlnets, self.control_configs = model.patcher, model.controlnets, model.control_configs

    def resident(self) -> list[dict]:
        """The models this worker holds (the current one last), for the client's memory plan and status. Called
        from the control thread too (a ping during a job), hence the lock around the slots it reads."""
        with self.models_lock:
            models = [*self.parked.values(), *filter(None, [self._current()])]
        return [{"path": m.key[0], "weight_dtype": m.key[3], "quantized_matmul": m.key[4], "name": m.name,
                 "bytes": _model_bytes(m.adapter, m.controlnets)} for m in models]

    def _load(self, model_spec: dict, key: tuple, stage: int, stages: int) -> None:
        from ..models.registry import read_model
        from ..weights.checkpoint import open_checkpoint
        from ..weights.patches import FileParameters, RankWeightPatcher
        from ..strategies.attention.processor import AttentionContext
        from ..strategies.sharded_weights import parallelize_sharded
        from ..strategies.tensor import TensorSplit, parallelize_tensor

        path, matmul = model_spec["path"], key[4]
        tensor_rank, tensor_degree = key[7], key[8]
        split = TensorSplit(tensor_rank, tensor_degree) if tensor_degree > 1 else None
        t0 = time.perf_counter()
        with open_checkpoint(path) as reader:
            family, match, config = read_model(reader, os.path.basename(path))
            chunks = family.pipeline_stages(config, stages, key[9])[stage]  # key[9]: stage speeds
            owned = family.stage_ownership(config, chunks, first=stage == 0, last=stage == stages - 1)
            storage = resolve_storage(model_spec["weight_dtype"], self.device, matmul).for_file(reader)
            smap = family.source_map(config, match.layout, match.prefix)  # the build's and the LoRA re-reader's
            model = family.build(config, reader, match, owned=owned, dtype=storage, device=self.device, smap=smap,
                                 tensor=split, shard=key[10])
        if key[10] is not None:  # its blocks gather from the replica group as they run
            parallelize_sharded(model)
        if split is not None:  # its row-wise layers all-reduce; a LoRA re-reads the parts this rank holds
            parallelize_tensor(model, split)
            smap = split.sources
        context = AttentionContext(input_amax=storage.input_amax)
        adapter = family.adapter(config, model, chunks, context)
        # where and how a family reads more of its file on demand (HiDream O1's vision tower)
        adapter.source_file, adapter.source_storage = path, storage
        patcher = RankWeightPatcher(model, family.weight_patch_targets(config), FileParameters(path, smap, storage,
                                                                                              self.device))
        with self.models_lock:
            self._make_current(ResidentModel(key, adapter, family, context, patcher, {}, {}))
        self.last_load_seconds = time.perf_counter() - t0

    def comm_for(self, topology):
        from ..distributed.comm import Comm, GroupPool

        if topology not in self.comms:
            if self.groups is None and self.world > 1:
                # Groups come from a pool shared by every topology (see GroupPool): switching strategy
                # between jobs reuses them instead of destroying and re-creating them each time. Idle
                # groups kept: a few on CUDA, where each NCCL communicator holds device memory (2 keeps
                # PipeFusion's two links of a 2-GPU runtime across a switch to another strategy and back).
                self.groups = GroupPool(spare=2 if self.device.type == "cuda" else 16, timeout=self.collective_timeout)
            self.comms = {topology: Comm(topology, self.rank, self.device, pool=self.groups)}
        return self.comms[topology]

    def end_job(self, job=None) -> None:
        """Free what one job built (PipeFusion's stale K/V alone is ~1.6 GB per rank at 1024^2): the
        attention strategy holds it, so point the processors back at plain attention. `job`: the job that
        finished (None: one that failed or was cancelled, which keeps nothing).

        Between the calls of a stock sampler's run the next call follows at once, with the same shapes: its
        PipeFusion or displaced patch stale K/V is kept for it, and the allocator's cached blocks are left to it
        (emptying the cache per call costs a device-wide sync and fresh cudaMallocs every step). The cache goes
        back to the device once the run is over (the host decodes next, perhaps on this GPU), after a failure (an
        out-of-memory error) and when models are released (ensure_model, release)."""
        from ..strategies.attention import LocalAttention

        run_goes_on = job is not None and job.timestep is not None and not job.call_last
        stale = job is not None and (job.strategy.pipefusion_degree > 1 or job.strategy.patch_degree > 1)
        if self.patcher is not None:
            self.patcher.drop_transients()
        if self.context is not None:
            self.context.attention = self.context.image_attention = LocalAttention()
            self.context.input_amax.reduce = None
            if not (run_goes_on and stale):
                self.context.stale_kv.clear()
        if self.device.type == "cuda" and not run_goes_on:
            torch.cuda.empty_cache()

    def take_weight_patches(self, meta: dict | None, tensors: dict) -> None:
        """Take the job's weight patches: sent in full when they are new to this worker, else named by the id of a
        stack it keeps."""
        from ..spec import WeightPatches

        from .protocol import PATCH_SETS_KEPT, keep_recent

        if meta is None:
            self.weight_patches = None
            return
        patches = WeightPatches.from_message(meta, tensors) if meta.get("sent") else self.kept_patches.get(meta["id"])
        if patches is None:
            raise ConfigError("the job names LoRA patches this worker was never sent (a ParaDiT bug); run the "
                              "prompt again.")
        keep_recent(self.kept_patches, meta["id"], patches, PATCH_SETS_KEPT)
        self.weight_patches = patches

    def take_hints(self, job, named: list[str], tensors: dict):
        """The job with its kept inputs (ControlNet hints, attention masks) in place: sent with it when new to
        this worker, else kept."""
        import dataclasses

        from .protocol import keep_hints

        new = {k: tensors[f"hint/{k}"] for k in named if f"hint/{k}" in tensors}
        if any(k not in new and k not in self.hints for k in named):
            raise ConfigError("the job names a ControlNet hint or attention mask this worker was never sent (a "
                              "ParaDiT bug); run the prompt again.")
        keep_hints(self.hints, named, new)

        def resolved(branch):
            if branch is None or not (branch.control or branch.attention_mask_key or branch.camera_key
                                      or branch.llama_key or branch.face_key):
                return branch
            mask = self.hints[branch.attention_mask_key] if branch.attention_mask_key else None
            camera = self.hints[branch.camera_key] if branch.camera_key else branch.camera
            llama = self.hints[branch.llama_key] if branch.llama_key else branch.llama
            face = self.hints[branch.face_key] if branch.face_key else branch.face
            return dataclasses.replace(branch, attention_mask=mask, camera=camera, llama=llama, face=face,
                                       control=tuple(dataclasses.replace(c, hint=self.hints[c.hint_key])
                                                     for c in branch.control))

        return dataclasses.replace(job, positive=resolved(job.positive), negative=resolved(job.negative))

    def ensure_controlnets(self, job, topology):
        """The job's ControlNets: every rank reads their configs (PipeFusion's later stages add residuals by
        them); the ranks that run them (all, or PipeFusion's first stage) hold their weights, loaded once
        and kept, at most CONTROLNETS_KEPT, for the next calls."""
        from ..strategies.control import ControlNets
        from ..strategies.tensor import TensorSplit, parallelize_tensor
        from ..weights.checkpoint import open_checkpoint

        paths = list(dict.fromkeys(c.path for b in (job.positive, job.negative) if b is not None for c in b.control))
        runs = topology.coords(self.rank)["pipefusion"] == 0
        found = ControlNets()
        for path in paths:
            stat = os.stat(path)
            key = (path, stat.st_mtime_ns, stat.st_size)
            if runs:
                net = self.controlnets.pop(key, None)
                if net is None:
                    split = getattr(self.adapter.model, "tensor_split", None)  # a tensor rank splits it as the DiT
                    tensor = TensorSplit(split.index, split.degree) if split is not None else None
                    with open_checkpoint(path) as reader:
                        net = self.family.load_controlnet(reader, self.adapter.dtype, self.device, self.context,
                                                          tensor=tensor, dit=self.adapter)
                    if tensor is not None:
                        parallelize_tensor(net.model, tensor)
                self.controlnets[key] = found.nets[path] = net  # most recently used last
                found.configs[path] = net.control
            else:
                if key not in self.control_configs:
                    with open_checkpoint(path) as reader:
                        self.control_configs[key] = self.family.controlnet_config(reader)
                found.configs[path] = self.control_configs[key]
        while len(self.controlnets) > CONTROLNETS_KEPT:
            self.controlnets.pop(next(iter(self.controlnets)))
        return found

    def held_bytes(self) -> int:
        """Bytes of the weights this worker holds: its models' and their ControlNets'."""
        return sum(m["bytes"] for m in self.resident())

    def stale_kv_bytes(self) -> int:
        """Bytes of the stale K/V the current model keeps between a stock sampler's calls (a parked model's went
        with its last run). Read by the ping thread while a job may add to it, hence the copies."""
        context = self.context
        if context is None:
            return 0
        return sum(cache.nbytes() for _, caches in list(context.stale_kv.values()) for cache in caches)

    def current_bytes(self) -> int:
        """Bytes of the current model's weights and its ControlNets' (a job's own figure, parked models aside)."""
        return 0 if self.adapter is None else _model_bytes(self.adapter, self.controlnets)

    def release(self) -> None:
        with self.models_lock:
            self.parked.clear()
            self.controlnets, self.control_configs = {}, {}
            self.adapter = self.loaded_key = self.context = self.patcher = self.family = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def weight_shard(topology, rank: int) -> tuple[int, int] | None:
    """(index, degree) of this rank's slice of every block under shard_weights: its place in its replica group."""
    if not topology.shard_weights:
        return None
    group = next(g for g in topology.replica_groups() if rank in g)
    return (group.index(rank), len(group)) if len(group) > 1 else None


def resolve_storage(name: str, device: torch.device, quantized_matmul: str = "auto"):
    """How the rank stores the weights (`Storage.for_weight_dtype`, the rule the memory estimate shares) on this
    device: whether it computes in fp8, and which ComfyUI-quantized formats multiply in their layout."""
    from ..weights.comfy_quant import kernel_formats
    from ..weights.storage import Storage

    # As ComfyUI's supports_fp8_compute: NVIDIA (not ROCm) with compute capability 8.9 or newer.
    fp8_compute = (device.type == "cuda" and torch.version.hip is None
                   and torch.cuda.get_device_capability(device) >= (8, 9))
    return Storage.for_weight_dtype(name, resolve_dtype(name, device), fp8_compute=fp8_compute,
                                    kernel_formats=kernel_formats(device, quantized_matmul))


CONTROLNETS_KEPT = 2  # ControlNets a worker keeps loaded beside its model (a chain of two, or two in turn)


def _model_bytes(adapter, controlnets: dict) -> int:
    from ..weights.checkpoint import parameter_bytes

    # list(): one step under the GIL, so a ping's count never iterates the dict while a job adds a ControlNet. A
    # module a family loaded on demand beside its model (HiDream O1's vision tower) counts once it is there.
    tower = getattr(adapter, "vision_tower", None)
    return (parameter_bytes(adapter.model) + sum(parameter_bytes(n.net) for n in list(controlnets.values()))
            + (parameter_bytes(tower) if tower is not None else 0))


class Aborted(Exception):
    """The client called a job off after loading (another rank failed to load, or Cancel)."""


def _job_from_message(meta: dict, tensors: dict):
    from ..spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec, VideoGuides

    def branch(name):
        return Conditioning.from_message(name, meta, tensors)

    return Job(ModelSpec(**meta["model"]), StrategySpec(**meta["strategy"]), SamplingSpec(**meta["sampling"]),
               tensors["latent"], branch("positive"), branch("negative") if "negative.cond" in tensors else None,
               extra=meta.get("extra", {}), timestep=tensors.get("timestep"), call_step=meta.get("call_step"),
               call_slot=meta.get("call_slot", 0), call_last=meta.get("call_last", False),
               skip_blocks=tuple((str(kind), int(index)) for kind, index in meta.get("skip_blocks", ())),
               audio=tensors.get("audio"), audio_timestep=tensors.get("audio_timestep"),
               video_guides=VideoGuides.from_tensors(tensors), audio_reference=tensors.get("audio_reference"))


PROFILE_ENV = "PARADIT_PROFILE_DIR"  # a folder: each rank writes its ops' CPU times per job there (a developer's tool)


class _profiled:
    """torch.profiler around one job's denoise where PARADIT_PROFILE_DIR names a folder: rank r's table of ops by
    self CPU time goes to rank{r}-{pid}-{n}.txt there (n counts the process's jobs, so a restarted worker never
    writes over an earlier table), so a strategy's time can be broken down on the workers themselves; nothing
    otherwise. A table that cannot be written is logged and never replaces the job's own outcome."""

    counts: dict[int, int] = {}

    def __init__(self, rank: int):
        self.rank, self.folder, self.prof = rank, os.environ.get(PROFILE_ENV), None

    def __enter__(self):
        if self.folder:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is None:
            return False
        self.prof.__exit__(*exc)
        n = self.counts[self.rank] = self.counts.get(self.rank, 0) + 1
        try:
            os.makedirs(self.folder, exist_ok=True)
            table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(os.path.join(self.folder, f"rank{self.rank}-{os.getpid()}-{n}.txt"), "w") as f:
                f.write(table)
        except Exception as e:  # a developer's tool: its failure must not end the job
            print(f"ParaDiT: rank {self.rank} could not write its profile to {self.folder}: {e}", file=sys.stderr)
        return False


def run_job(state: WorkerState, chan: Channel, meta: dict, tensors: dict, pulse, gate: queue.Queue) -> None:
    """Load (phase "load"), report, wait for the client's go, then denoise (phase "run").

    Nothing before the go touches a process group, so a rank that fails to load leaves its peers idle and
    the group intact; the client aborts the others and keeps every worker."""
    from ..distributed.topology import Topology, stage_speeds

    job = _job_from_message(meta, tensors)
    topology = Topology.from_strategy(job.strategy)
    state.take_weight_patches(meta.get("weight_patches"), tensors)  # first: the client counts on them being kept
    job = state.take_hints(job, meta.get("hints", []), tensors)
    FAULTS.maybe("oom_load", state.rank)
    loaded = state.ensure_model(meta["model"], topology, keep_others=meta.get("keep_resident", True),
                                stage_speeds=stage_speeds(job.strategy))
    controlnets = state.ensure_controlnets(job, topology)
    patched = state.patcher.apply(state.weight_patches)
    state.adapter.weights_id = state.patcher.applied  # what the adapter's per-run caches were made with
    chan.send("loaded", {"rank": state.rank, "param_bytes": state.current_bytes(), "patched_tensors": patched,
                         "released": state.released})
    if gate.get() != "go":
        raise Aborted()
    pulse.phase = "sampling"
    with _profiled(state.rank):
        stats, latent = _denoise(state, chan, job, topology, pulse, controlnets)
    # On a failure serve() ends the job, after telling the client (and drops any stale K/V).
    state.end_job(job)
    stats.update(loaded=loaded, load_seconds=state.last_load_seconds, patched_tensors=patched, released=state.released,
                 resident=[m["name"] for m in state.resident()])
    pulse.end_job()  # no beat may follow the result
    if isinstance(latent, tuple):  # an audio-video job: (video, audio)
        latent = {"latent": latent[0], "audio": latent[1]}
    chan.send("done", stats, {"latent": latent} if isinstance(latent, torch.Tensor) else latent)


def _denoise(state: WorkerState, chan: Channel, job, topology, pulse, controlnets) -> tuple[dict, torch.Tensor | None]:
    from ..strategies.denoise import Denoiser
    from ..strategies.av_sampling import AudioVideoDenoiser
    from ..strategies.model_call import ModelCallForward
    from ..strategies.sharded_weights import bind_weight_gatherer
    from ..strategies.tensor import bind_tensor_group

    comm = state.comm_for(topology)
    for model in [state.adapter.model, *(net.model for net in controlnets.nets.values())]:
        bind_tensor_group(model, comm)
    gatherer = bind_weight_gatherer(state.adapter.model, comm)
    comm.reset_traffic()
    pulse.traffic = comm.traffic
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)
    # One stock-sampler call, a whole denoise of both latents of an audio-video family, or a whole denoise.
    runner = (ModelCallForward if job.timestep is not None else AudioVideoDenoiser if job.audio is not None
              else Denoiser)
    # Set for every job, so a skip of one job never leaks into the next.
    state.adapter.skip = state.family.replaced_blocks(state.adapter.config, job.skip_blocks)
    denoiser = runner(state.adapter, topology, comm, state.context, controlnets)

    cpu_marks = [time.process_time()]  # this process's CPU seconds at the start and after each step (the bench's work)

    def progress(step: int, total: int) -> None:
        # Every rank reports each step with its memory (live status); the result rank's drives the bar.
        cpu_marks.append(time.process_time())
        pulse.step = step
        times = denoiser.step_times
        chan.send("progress", {"rank": state.rank, "step": step, "total": total, "report": denoiser.reports_progress,
                               "sec_per_step": times[-1] if times else None,
                               "device_bytes": _device_bytes(state.device)})
        peak_rss()  # samples the high-water mark where the OS keeps none
        FAULTS.maybe("stall", state.rank, step)

    t0 = time.perf_counter()
    try:
        latent = denoiser.run(job, progress=progress, cancel_requested=state.cancel.is_set)
    except Cancelled:  # every rank stops at the same step (a vote), so the group's last gathers still pair up
        if gatherer is not None:
            gatherer.finish()
        raise
    except BaseException:
        if gatherer is not None:
            gatherer.abandon()
        raise
    if gatherer is not None:
        gatherer.finish()
    stats = {
        "rank": state.rank, "job_seconds": time.perf_counter() - t0, "step_times": denoiser.step_times,
        # CPU seconds of each step (compute and the transfers' copies; waits on a peer and time the machine gave
        # other processes are not in it): the bench's measure of what a split saved in work
        "step_cpu": [b - a for a, b in zip(cpu_marks, cpu_marks[1:])],
        "traffic": comm.traffic.snapshot(), "param_bytes": state.current_bytes(), "resident_bytes": state.held_bytes(),
        "kv_cache_bytes": denoiser.cache.nbytes() if hasattr(denoiser, "cache") else 0,
        "peak_rss_bytes": peak_rss(),
        # The steps the runtime's step cache skipped on this rank (the same on every rank: one decision per step).
        "cache_skipped": list(denoiser.step_cache.skipped) if denoiser.step_cache else [],
        "cache_changes": list(denoiser.step_cache.changes) if denoiser.step_cache else [],
        "peak_device_bytes": torch.cuda.max_memory_allocated(state.device) if state.device.type == "cuda" else 0,
    }
    return stats, latent


class Faults:
    """Fault injection for the watchdog's tests, off unless PARADIT_FAULT is set, e.g.
    "stall:rank=1:step=2" (rank 1's main thread hangs after step 2 while its heartbeat goes on, so its
    peers wait in a collective), "oom_load:rank=1" (rank 1 runs out of memory while loading),
    "die_starting:rank=1" (rank 1 exits before its hello), "ping_fails:rank=1" (answering a ping raises) or
    "link_silent:rank=1" (rank 1 never takes part in the startup link check, as behind a broken link)."""

    def __init__(self, spec: str):
        self.kind, self.args = None, {}
        if spec:
            self.kind, *pairs = spec.split(":")
            self.args = {k: int(v) for k, v in (p.split("=") for p in pairs)}

    def maybe(self, kind: str, rank: int, step: int | None = None) -> None:
        if kind != self.kind or rank != self.args.get("rank") or (step is not None and step != self.args.get("step")):
            return
        while kind in ("stall", "link_silent"):  # the main thread computes "forever" / never joins the link check
            time.sleep(3600)
        if kind == "oom_load":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 20.00 GiB")
        if kind == "die_starting":
            print("injected: dying before hello", file=sys.stderr, flush=True)
            os._exit(3)
        if kind == "ping_fails":
            raise RuntimeError("injected: the memory report failed")


FAULTS = Faults(os.environ.get("PARADIT_FAULT", ""))


def _error_meta(exc: BaseException, state: WorkerState, phase: str) -> dict:
    when = "while loading the model" if phase == "load" else "while sampling"
    if isinstance(exc, torch.OutOfMemoryError):
        kind = "OutOfMemory"
        free = ""
        if state.device.type == "cuda":
            from ..planning.memory import device_memory

            free_b, total_b = device_memory(state.device)  # the cached blocks no tensor uses count as free
            free = f" ({free_b / 2**30:.1f} of {total_b / 2**30:.1f} GB free)"
        message = (f"rank {state.rank} ({state.label}) ran out of memory {when}{free}; lower the resolution or batch, "
                   f"pick weight_dtype bf16, or raise pipefusion_degree so each device holds fewer blocks.")
    elif isinstance(exc, ParaDiTError):
        kind, message = type(exc).__name__, str(exc)
    else:
        kind, message = "WorkerError", f"rank {state.rank} ({state.label}) failed {when}: {type(exc).__name__}: {exc}"
    return {"type": kind, "message": message, "phase": phase, "rank": state.rank,
            "traceback": traceback.format_exc(limit=20)}


def measure_speed(device: torch.device, meta: dict) -> float:
    """This device's speed on the job's own shapes: calls per second of one of the model's blocks (random weights,
    the job's text and image token counts, its dtype) over `seconds`. Every worker measures at the same time, so
    devices that share something (two workers on one core, GPUs on one PCIe switch) measure what a job gets."""
    from ..models.registry import read_model
    from ..strategies.attention.processor import AttentionContext
    from ..weights.checkpoint import open_checkpoint

    with open_checkpoint(meta["path"]) as reader:
        family, _, config = read_model(reader, os.path.basename(meta["path"]))
    dtype = resolve_dtype(meta.get("weight_dtype", "default"), device)
    run = family.probe_block(config, 0, AttentionContext(), meta["text_tokens"], meta["image_tokens"], dtype, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run()
    sync()
    calls, t0 = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - t0 < meta["seconds"]:
        run()
        sync()
        calls += 1
    return calls / (time.perf_counter() - t0)


def serve(state: WorkerState, chan: Channel, heartbeat_s: float) -> None:
    from ..planning.memory import worker_report
    from .watchdog import Heartbeat

    jobs: queue.Queue = queue.Queue()
    gate: queue.Queue = queue.Queue()  # the client's "go" / "abort" after every rank has loaded
    pulse = Heartbeat(chan.send, state.rank, heartbeat_s, state.device)

    def reader() -> None:
        try:
            read_messages()
        except BaseException:  # noqa: BLE001
            # Without this thread the worker cannot be pinged, cancelled or told to go: end it, so the client
            # reports an exit (with this traceback as its last output) rather than a hang.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def read_messages() -> None:
        while True:
            try:
                kind, meta, tensors = chan.recv()
            except (EOFError, OSError):
                os._exit(0)  # the client is gone: nobody will read our results
            if kind == "cancel":
                state.cancel.set()
            elif kind in ("go", "abort"):
                gate.put(kind)
            elif kind == "ping":  # answered here, so a busy main thread still proves the process alive
                FAULTS.maybe("ping_fails", state.rank)
                report = worker_report(state.device, state.resident(), state.stale_kv_bytes())
                chan.send("pong", {"rank": state.rank, **report})
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
        if kind == "calibrate":
            try:
                chan.send("speed", {"rank": state.rank, "calls_per_s": measure_speed(state.device, meta)})
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the client
                chan.send("error", _error_meta(exc, state, "calibrate"))
            continue
        if kind == "job":
            pulse.start_job()
            try:
                run_job(state, chan, meta, tensors, pulse, gate)
            except Aborted:
                pulse.end_job()
                chan.send("aborted", {"rank": state.rank})
            except Cancelled:
                pulse.end_job()
                state.end_job()
                chan.send("cancelled", {"rank": state.rank})
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the client
                phase = "load" if pulse.phase == "loading" else "run"
                pulse.end_job()
                # Report before cleaning up: after a CUDA error, end_job's empty_cache can fail too.
                chan.send("error", _error_meta(exc, state, phase))
                state.end_job()


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="ParaDiT worker (started by the runtime client)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--device", required=True)
    control = ap.add_mutually_exclusive_group(required=True)  # the client's listener (client._control_listener)
    control.add_argument("--socket", help="its AF_UNIX socket file")
    control.add_argument("--port", type=int, help="its port on 127.0.0.1, where Python has no AF_UNIX")
    control.add_argument("--join", help="a host's front door, ADDRESS:PORT (a worker its agent started: cluster.py)")
    ap.add_argument("--session", default="", help="with --join: the runtime start this worker belongs to")
    ap.add_argument("--parent-pid", type=int, default=None, help="with --join: its agent, whose end ends it too")
    ap.add_argument("--host", default=None, help="with --join: this machine's name in the runtime, for messages")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--core", type=int, default=None, help="pin this worker to one CPU core (devices cpu:K,...)")
    return ap.parse_args(argv)


def _control_channel(args: argparse.Namespace, authkey: bytes) -> Channel:
    """The authenticated channel to the client: its AF_UNIX socket or loopback port, or (a worker on another
    machine) the host's front door, which hands the connection to the session's client."""
    from multiprocessing.connection import Client

    if args.socket is not None:
        return Channel(Client(args.socket, family="AF_UNIX", authkey=authkey))
    if args.join is not None:
        from .cluster import connect_to

        _end_with_parent(args.parent_pid)
        chan = Channel(connect_to(args.join, authkey))
        chan.send("worker", {"session": args.session, "rank": args.rank})
        return chan
    conn = Client(("127.0.0.1", args.port), family="AF_INET", authkey=authkey)
    sock = socket.socket(fileno=conn.fileno())  # detached below: conn keeps the descriptor
    try:
        send_small_messages_now(sock)  # the worker sends most of the small messages (progress, votes' answers)
    finally:
        sock.detach()
    return Channel(conn)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    label = f"{args.host} {args.device}" if args.host else args.device
    if args.core is not None:
        pin_to_core(args.core)  # before torch starts its threads, so they inherit it

    authkey = bytes.fromhex(sys.stdin.readline().strip())
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chan = _control_channel(args, authkey)
    FAULTS.maybe("die_starting", args.rank)

    import torch.distributed as dist

    store = None
    # A runtime with ranks on other machines keeps its store in the client (see client.start): none is made here.
    if args.world > 1 and args.rank == 0 and args.join is None and not os.environ.get("PARADIT_CLIENT_STORE"):
        # Rendezvous on loopback only: TCPStore given a host still listens on every interface, so hand it a
        # socket already bound to 127.0.0.1. The port reaches the other ranks over the control channel.
        import socket

        listen = socket.socket()
        listen.bind(("127.0.0.1", 0))
        listen.listen()
        port = listen.getsockname()[1]
        store = loopback_store(port, args.world, listen_fd=listen.detach())  # the store closes it, not Python
    chan.send("hello", {"rank": args.rank, "pid": os.getpid(), "store_port": store.port if store else None})
    kind, meta, _ = chan.recv()
    if kind != "init":
        return
    collective_timeout = timedelta(seconds=meta["collective_timeout_s"])  # the default group's and every other's
    if args.world > 1:
        if store is None:
            # The store's timeout bounds rendezvous and every new_group: a peer that never arrives fails
            # the start within a minute instead of hanging it.
            store = loopback_store(meta["store_port"], args.world)
        # NCCL where torch has it (the client refuses several GPUs where it has not: devices.runtime_devices).
        backend = collective_backend(device.type)
        # The process group's timeout bounds each collective (see WatchdogConfig.collective_timeout_s).
        dist.init_process_group(backend, store=dist.PrefixStore(meta["session"], store), rank=args.rank,
                                world_size=args.world, timeout=collective_timeout,
                                **({"device_id": device} if backend == "nccl" else {}))
        FAULTS.maybe("link_silent", args.rank)
        broken = check_links(args.rank, args.world, device, backend, label=label)
        if broken:
            # A transfer may be stuck in the group: say why, then let the client end this process.
            chan.send("error", {"type": "WorkerError", "message": broken, "phase": "start", "rank": args.rank})
            try:
                chan.recv()
            except (EOFError, OSError):
                pass
            os._exit(1)
    chan.send("ready", {"rank": args.rank})
    try:
        serve(WorkerState(args.rank, args.world, device, collective_timeout, label), chan, meta["heartbeat_s"])
    except BaseException:  # noqa: BLE001
        # Whatever escapes (a failing cleanup, a send to a vanished client) must end the process: a live
        # worker whose main thread is gone would look healthy to pings yet never run a job.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    chan.close()
    os._exit(0)  # skip interpreter teardown: process-group destructors can block on dead peers


def _end_with_parent(parent: int | None) -> None:
    """End this process when its agent does: a worker on another machine must never outlive what started it."""
    if parent is None:
        return
    import psutil

    def watch():
        while os.getppid() == parent and psutil.pid_exists(parent):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="paradit-parent-watch").start()


if __name__ == "__main__":
    main()
