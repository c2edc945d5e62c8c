"""Cost model for choosing a strategy: calibrated by measurement on the machine at hand.

Inputs, all measured here unless stated:

* per-block compute: one block of each kind the model's family has (`config.block_kinds`: Flux's double
  and single blocks, SD3.5 Medium's blocks with and without the image-only attn2, PixArt's self- plus
  cross-attention block; the family's own diffusers module with random weights, run by its adapter with
  ParaDiT's attention processors) timed at the job's token count on the first device of the set, plus
  each of its attention layers' kernel alone at that size (joint: prompt + image rows; image-only;
  cross-attention: image rows over the prompt's), which splits a block's time into a part linear in its
  rows and attention parts (query rows x key rows);
* the link between two workers: latency and bandwidth of all_to_all_single between two processes on the
  first two devices of the set (gloo on CPU, NCCL on GPUs), fitted over a few message sizes.

Both are cached on disk (``$PARADIT_CACHE`` or ``~/.cache/paradit``, file ``costmodel.json``), the link
per device set and the blocks per (family, block structure, model shape, tokens, device, dtype, threads).

`project` turns a strategy into a per-step and per-job time from these inputs and the exact byte counts
of `traffic.py`, summing each rank's blocks by kind (PipeFusion stages hold different mixes);
`gpu_calibration` builds the same inputs for NVLink/PCIe GPUs from each block kind's FLOPs (counted on the
meta device) and nominal link figures (stated as assumptions) so the bench can project to machines it does not have.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from ..distributed.portability import collective_backend, loopback_interface, module_command
from ..distributed.topology import Topology
from ..spec import StrategySpec
from ..strategies.batch import largest_share
from .traffic import Shapes, attention_widths, branches_per_forward, job_traffic, shapes_of

CACHE_VERSION = 4  # 4: block timings per family block kind

# Projection assumptions for GPUs we do not have (printed next to every projection).
GPU_TFLOPS = 400.0  # effective bf16 TFLOP/s of an H100-class GPU on Flux's GEMMs and attention (~40% of peak)
GPU_BLOCK_OVERHEAD_S = 60e-6  # kernel launches and small ops per block
GPU_FIXED_ROWS = 256  # GEMMs/attention on r rows cost like r + 256 rows: small shards run less efficiently
LINKS = {  # name: (bandwidth bytes/s per GPU and direction, latency s per collective)
    "NVLink": (450e9, 10e-6),
    "PCIe": (64e9, 20e-6),
}


# -------------------------------------------------------------------------------------------------
# Disk cache


def cache_path() -> str:
    root = os.environ.get("PARADIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paradit")
    return os.path.join(root, "costmodel.json")


def _load_cache() -> dict:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if data.get("version") == CACHE_VERSION else {"version": CACHE_VERSION}
    except (OSError, ValueError):
        return {"version": CACHE_VERSION}


def _store(section: str, key: str, value: dict) -> None:
    data = _load_cache()
    data.setdefault(section, {})[key] = value
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".costmodel-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def _cached(section: str, key: str) -> dict | None:
    return _load_cache().get(section, {}).get(key)


def _host_id() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|{os.cpu_count()}|torch {torch.__version__}"


def _device_id(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    return "cpu"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# -------------------------------------------------------------------------------------------------
# Calibration data


@dataclass
class KindTiming:
    """One block of one kind at the calibration's token count: the whole block, and each of its attention
    layers' kernel alone (in `BlockKind.attention`'s order), which splits the block into a part linear in its
    rows and attention parts (query rows x key rows)."""

    block_s: float
    attention_s: tuple[float, ...]

    @property
    def linear_s(self) -> float:
        return max(self.block_s - sum(self.attention_s), 0.0)


@dataclass
class BlockTiming:
    """Seconds for one block forward of each of a model's block kinds (`config.block_kinds`' names) at
    `text_tokens + image_tokens` rows, batch 1."""

    kinds: dict[str, KindTiming]
    text_tokens: int
    image_tokens: int
    source: str = "measured"

    @classmethod
    def from_json(cls, data: dict) -> BlockTiming:
        kinds = {name: KindTiming(k["block_s"], tuple(k["attention_s"])) for name, k in data["kinds"].items()}
        return cls(kinds, data["text_tokens"], data["image_tokens"], data.get("source", "measured"))

    def of(self, name: str) -> KindTiming:
        if name not in self.kinds:
            raise ValueError(f"the cost model's calibration has no {name!r} block (it timed {sorted(self.kinds)}): "
                             f"it was calibrated for another model; calibrate for this one")
        return self.kinds[name]


@dataclass
class LinkTiming:
    latency_s: float  # per all_to_all / all_gather
    bandwidth: float  # bytes/s one rank pushes to its peers in an all_to_all
    p2p_latency_s: float | None = None  # per send/recv exchange (Ring hops, PipeFusion); None = as all_to_all
    p2p_bandwidth: float | None = None
    source: str = "measured"

    def for_op(self, op: str) -> tuple[float, float]:
        if op in P2P_OPS and self.p2p_latency_s is not None:
            return self.p2p_latency_s, self.p2p_bandwidth
        return self.latency_s, self.bandwidth


P2P_OPS = ("ring", "pipefusion", "pipefusion_x")


@dataclass
class Calibration:
    blocks: BlockTiming
    link: LinkTiming | None
    device: str  # "cpu" or "cuda"
    threads: int = 1
    cores: int = 1  # CPU cores the workers share (compute slows when workers x threads exceed them)
    overlap: bool = False  # whether p2p/ring transfers overlap compute (NCCL streams) or cost CPU time (gloo)
    fixed_rows: float = 0.0  # work on r rows costs like r + fixed_rows (kernel efficiency at small shards)

    def describe(self) -> str:
        b = self.blocks
        kinds = ", ".join(f"{name} block {k.block_s * 1e3:.1f} ms (attention "
                          f"{sum(k.attention_s) / max(k.block_s, 1e-12):.0%})" for name, k in b.kinds.items())
        text = f"{b.source} at {b.image_tokens}+{b.text_tokens} tokens: {kinds}"
        if self.link is not None:
            link = self.link
            text += (f"; link {link.source}: all_to_all {link.latency_s * 1e6:.0f} us + "
                     f"{link.bandwidth / 1e9:.2f} GB/s")
            if link.p2p_latency_s is not None:
                text += f", send/recv {link.p2p_latency_s * 1e6:.0f} us + {link.p2p_bandwidth / 1e9:.2f} GB/s"
        return text

    def to_json(self) -> dict:
        return asdict(self)


# -------------------------------------------------------------------------------------------------
# Block compute


def distinct_kinds(config) -> dict:
    """{name: (BlockKind, the first block index of that kind)} of `config`'s blocks, in pipeline order."""
    out = {}
    for index, kind in enumerate(config.block_kinds):
        out.setdefault(kind.name, (kind, index))
    return out


def audio_rows(config, image_tokens: int) -> int:
    """A two-stream family's audio rows beside `image_tokens` video rows (LTX-2), else 0."""
    rows = getattr(config, "audio_rows", None)
    return rows(image_tokens) if rows else 0


AUDIO_WIDTH_LAYERS = ("audio", "audio_prompt", "a2v", "v2a")  # LTX-2 runs these at the audio stream's width
CROSS_ATTENTION = ("prompt", "audio_prompt")  # over the prompt every rank holds: nothing travels


def attention_width(config, layer: str) -> int:
    """Query width (heads x head size) of an attention layer: the audio stream's for LTX-2's audio layers."""
    if layer in AUDIO_WIDTH_LAYERS and hasattr(config, "audio_hidden_size"):
        return config.audio_hidden_size
    return config.num_heads * config.head_dim


def attention_shapes(kind, text_tokens: int, image_tokens: int, audio_tokens: int = 0) -> list[tuple[int, int]]:
    """(query rows, key rows) of each attention layer of `kind` over one whole forward."""
    joint, n, a = text_tokens + image_tokens, image_tokens, audio_tokens
    rows = {"joint": (joint, joint), "image": (n, n), "prompt": (n, text_tokens), "audio": (a, a),
            "audio_prompt": (a, text_tokens), "a2v": (n, a), "v2a": (a, n)}
    return [rows[layer] for layer in kind.attention]


def _timed(fn, device: str, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_blocks(config, text_tokens: int, image_tokens: int, *, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, threads: int | None = None, repeats: int = 3) -> BlockTiming:
    """Time one block of each of the model's kinds (the family's own diffusers block with ParaDiT's processors,
    run by its adapter) and each of its attention layers' kernel alone, at this token count."""
    from ..models.registry import family_of
    from ..strategies.attention.local import attention
    from ..strategies.attention.processor import AttentionContext

    family, heads = family_of(config), config.num_heads
    old_threads = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    kinds = {}
    try:
        with torch.inference_mode():
            for name, (kind, index) in distinct_kinds(config).items():
                run = family.probe_block(config, index, AttentionContext(), text_tokens, image_tokens, dtype, device)
                block_s = _timed(run, device, repeats)
                del run  # one block's weights at a time
                attention_s = []
                audio = audio_rows(config, image_tokens)
                for layer, (q_rows, kv_rows) in zip(kind.attention,
                                                    attention_shapes(kind, text_tokens, image_tokens, audio)):
                    width = attention_width(config, layer)  # the same heads, narrower where the audio's
                    q = torch.randn(1, q_rows, heads, width // heads, device=device, dtype=dtype)
                    kv = torch.randn(1, kv_rows, heads, width // heads, device=device, dtype=dtype)
                    attention_s.append(_timed(functools.partial(attention, q, kv, kv), device, repeats))
                kinds[name] = KindTiming(block_s, tuple(attention_s))
    finally:
        torch.set_num_threads(old_threads)
    return BlockTiming(kinds, text_tokens, image_tokens)


def block_timing(config, text_tokens: int, image_tokens: int, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, threads: int = 1, refresh: bool = False) -> BlockTiming:
    """`measure_blocks`, cached on disk per family, block structure, model shape, token count, device, dtype
    and threads."""
    structure = ",".join(f"{name}:{'+'.join(kind.attention)}" for name, (kind, _) in distinct_kinds(config).items())
    key = (f"{_host_id()}|{_device_id(device)}|{str(dtype)}|threads {threads}|{config.family} blocks {structure}|"
           f"{config!r}|text {text_tokens}|image {image_tokens}")
    if not refresh:
        hit = _cached("blocks", key)
        if hit:
            return BlockTiming.from_json(hit)
    timing = measure_blocks(config, text_tokens, image_tokens, device=device, dtype=dtype, threads=threads)
    _store("blocks", key, asdict(timing))
    return timing


# -------------------------------------------------------------------------------------------------
# Link


PROBE_SIZES = (4096, 256 * 1024, 4 * 1024 * 1024)  # bytes each rank sends per all_to_all


def _probe(rank: int, world: int, store_dir: str, device: str) -> None:
    """Child process of `measure_link`; rank 0 prints {mode: {bytes: seconds}} as JSON.

    On CPU the cost of a message is measured *in use*: between chunks of compute, as the strategies issue
    them, since a gloo transfer needs CPU time and a wake-up of a peer that was computing, which an idle
    ping-pong never shows (here ~1 ms against ~0.1 ms idle). "a2a" is a blocking all_to_all_single after a
    compute chunk (Ulysses, CFG); "p2p" is a send/recv exchange posted before the chunk and waited for
    after it (Ring hops, PipeFusion), so only what the chunk does not hide counts. On GPUs (NCCL on its own
    stream) both are timed alone. Long because it is one child process's whole measurement: its closures
    share the process group, the compute chunk and the message buffers.
    """
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = torch.device(device)
    backend = collective_backend(dev.type)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    cpu = dev.type == "cpu"
    mat = torch.randn(256, 256, device=dev)

    def compute():
        if cpu:
            for _ in range(8):  # ~2-3 ms of matmul on one thread
                mat @ mat

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def per_iteration(fn, reps):
        times = []
        dist.barrier()
        for i in range(reps + 2):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    base = per_iteration(compute, 20) if cpu else 0.0
    results = {"a2a": {}, "p2p": {}, "a2a_idle": {}, "p2p_idle": {}, "compute_s": base}
    for nbytes in PROBE_SIZES:
        reps = 30 if nbytes < 1 << 20 else 15
        n = max(1, nbytes // 4)
        inp = torch.ones(n * world, device=dev)
        out = torch.empty_like(inp)
        send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)

        def a2a():
            dist.all_to_all_single(out, inp)

        def blocking():
            compute()
            a2a()

        def exchange(between=lambda: None):
            ops = [dist.P2POp(dist.isend, send, peer_next), dist.P2POp(dist.irecv, recv, peer_prev)]
            works = dist.batch_isend_irecv(ops)
            between()
            for work in works:
                work.wait()

        # An all_to_all where each rank sends `nbytes` to every peer: (world - 1) * nbytes leave the rank.
        key = str(nbytes * (world - 1))
        results["a2a_idle"][key] = per_iteration(a2a, reps)
        results["p2p_idle"][str(nbytes)] = per_iteration(exchange, reps)
        if cpu:
            results["a2a"][key] = max(per_iteration(blocking, reps) - base, 1e-7)
            results["p2p"][str(nbytes)] = max(per_iteration(lambda: exchange(compute), reps) - base, 1e-7)
        else:
            results["a2a"][key] = results["a2a_idle"][key]
            results["p2p"][str(nbytes)] = results["p2p_idle"][str(nbytes)]
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _fit(points: dict) -> tuple[float, float]:
    """(latency, bandwidth) from {bytes: seconds}: the smallest message's time, and the largest message's
    bytes over its time (a slope between two noisy points can come out negative or infinite)."""
    pts = {int(k): v for k, v in points.items()}
    sizes = sorted(pts)
    return pts[sizes[0]], sizes[-1] / max(pts[sizes[-1]], 1e-9)


def measure_link(devices: list[str], timeout_s: float = 120.0) -> LinkTiming:
    """Latency and bandwidth of all_to_all between the first two devices, in two fresh processes."""
    pair = devices[:2]
    env = dict(os.environ)
    loopback = loopback_interface()
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
    env["OMP_NUM_THREADS"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the plugin folder
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory(prefix="paradit-probe-") as tmp:
        procs = [subprocess.Popen(module_command("parallel_runtime.planning.costmodel", root)
                                  + ["--probe", str(r), str(len(pair)), tmp, dev],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=root)
                 for r, dev in enumerate(pair)]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode for p in procs):
        err = b" ".join(o[1][-400:] for o in outs).decode(errors="replace")
        raise RuntimeError(f"link probe between {pair} failed: {err}")
    data = json.loads(outs[0][0].decode().strip().splitlines()[-1])
    # Per-message cost from the smallest message *in use*; bandwidth from the idle transfers (in use, the
    # wake-up jitter of ~1 ms swamps the size dependence at these sizes).
    lat = _fit(data["a2a"])[0]
    bw = _fit(data["a2a_idle"])[1]
    p2p_lat = _fit(data["p2p"])[0]
    p2p_bw = _fit(data["p2p_idle"])[1]
    return LinkTiming(latency_s=lat, bandwidth=bw, p2p_latency_s=p2p_lat, p2p_bandwidth=p2p_bw)


def link_timing(devices: list[str], refresh: bool = False) -> LinkTiming | None:
    """`measure_link`, cached on disk per device set (all CPU worker sets share loopback)."""
    if len(devices) < 2:
        return None
    key = f"{_host_id()}|" + ("cpu" if all(d == "cpu" for d in devices) else ",".join(_device_id(d) for d in devices))
    if not refresh:
        hit = _cached("links", key)
        if hit:
            return LinkTiming(**hit)
    timing = measure_link(devices)
    _store("links", key, asdict(timing))
    return timing


CPU_ASSUMED_GFLOPS = 50.0  # per thread, only if timing a block here fails
CPU_ASSUMED_LINK = (2e-4, 2e9)  # loopback gloo, only if the probe fails


def calibrate(config, text_tokens: int, image_tokens: int, devices: list[str], *, threads: int = 1,
              dtype: torch.dtype | None = None, refresh: bool = False, refresh_link: bool = False) -> Calibration:
    """Measured inputs for `project` on this device set. A measurement that fails (a GPU without room
    for one block, a probe that cannot start) falls back to stated assumptions rather than failing the
    job; `describe()` then says "assumed"."""
    device = devices[0]
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if dtype is None:  # the workers' "default" (fp16 on GPUs below compute capability 8.0)
        from ..distributed.devices import default_dtype

        dtype = default_dtype(kind, torch.cuda.get_device_capability(device) if kind == "cuda" else None)
    try:
        blocks = block_timing(config, text_tokens, image_tokens, device=device, dtype=dtype, threads=threads,
                              refresh=refresh)
    except Exception as exc:  # noqa: BLE001 - any failure to measure means: use the stated assumption
        tflops = GPU_TFLOPS if kind == "cuda" else CPU_ASSUMED_GFLOPS * threads / 1e3
        blocks = gpu_calibration(config, text_tokens, image_tokens, "PCIe", tflops=tflops).blocks
        blocks.source = f"assumed {tflops * 1e3:.0f} GFLOP/s ({type(exc).__name__} while timing a block)"
    try:
        link = link_timing(devices, refresh=refresh or refresh_link)
    except Exception as exc:  # noqa: BLE001
        lat, bw = CPU_ASSUMED_LINK if kind == "cpu" else LINKS["PCIe"][::-1]
        link = LinkTiming(lat, bw, source=f"assumed ({type(exc).__name__} in the link probe)")
    return Calibration(blocks, link, kind, threads=threads, cores=available_cores(), overlap=kind == "cuda",
                       fixed_rows=GPU_FIXED_ROWS if kind == "cuda" else 0.0)


# -------------------------------------------------------------------------------------------------
# FLOP-based inputs for GPUs we do not have


@functools.lru_cache(maxsize=64)
def kind_flops(config, text_tokens: int, image_tokens: int) -> dict[str, tuple[float, tuple[float, ...]]]:
    """Per block kind, (linear FLOPs, FLOPs of each attention layer) of one block forward, batch 1: the
    family's own block run on the meta device under torch's FLOP counter (every matmul it makes, attn2 and
    cross-attention included); attention is 4 q k H per layer (two matmuls of q x k rows x H)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..models.registry import family_of
    from ..strategies.attention.processor import AttentionContext

    family, audio = family_of(config), audio_rows(config, image_tokens)
    out = {}
    for name, (kind, index) in distinct_kinds(config).items():
        run = family.probe_block(config, index, AttentionContext(), text_tokens, image_tokens, torch.float32, "meta")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
        attention = tuple(4.0 * q * kv * attention_width(config, layer) for layer, (q, kv) in
                          zip(kind.attention, attention_shapes(kind, text_tokens, image_tokens, audio)))
        out[name] = (max(counter.get_total_flops() - sum(attention), 0.0), attention)
    return out


def block_flops(config, text_tokens: int, image_tokens: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of the model's average block (its kinds weighted by their counts)."""
    flops, kinds = kind_flops(config, text_tokens, image_tokens), config.block_kinds
    linear = sum(flops[kind.name][0] for kind in kinds) / len(kinds)
    attention = sum(sum(flops[kind.name][1]) for kind in kinds) / len(kinds)
    return linear, attention


def gpu_calibration(config, text_tokens: int, image_tokens: int, link: str, *, tflops: float = GPU_TFLOPS) -> Calibration:
    """Inputs for `project` on GPUs we do not have: each block kind's FLOPs at `tflops`, nominal links."""
    rate = tflops * 1e12
    kinds = {name: KindTiming((linear + sum(attention)) / rate + GPU_BLOCK_OVERHEAD_S,
                              tuple(a / rate for a in attention))
             for name, (linear, attention) in kind_flops(config, text_tokens, image_tokens).items()}
    blocks = BlockTiming(kinds, text_tokens, image_tokens, source=f"assumed {tflops:.0f} TFLOP/s")
    bw, lat = LINKS[link]
    return Calibration(blocks, LinkTiming(lat, bw, source=f"assumed {link}"), "cuda", threads=1, cores=1,
                       overlap=True, fixed_rows=GPU_FIXED_ROWS)


# -------------------------------------------------------------------------------------------------
# Projection


@dataclass
class Projection:
    strategy: StrategySpec
    step_s: float  # steady-state seconds per step (what the bench's median measures)
    job_s: float  # whole denoise, warm-up and result gather included
    compute_s: float  # per step, on the slowest rank
    comm_s: float  # per step, the part not hidden behind compute
    comm_by_op: dict = field(default_factory=dict)  # op -> seconds per step (before overlap)

    def describe(self) -> str:
        ops = ", ".join(f"{op} {t * 1e3:.1f} ms" for op, t in sorted(self.comm_by_op.items()) if op != "result")
        return f"compute {self.compute_s * 1e3:.0f} ms/step" + (f", {ops}" if ops else "")


@functools.lru_cache(maxsize=64)
def _stages(config, stages: int) -> tuple[tuple[range, ...], ...]:
    """Per PipeFusion rank, the block ranges (chunks) it runs, as the workers split them."""
    from ..models.registry import family_of

    return tuple(tuple(chunks) for chunks in family_of(config).pipeline_stages(config, stages))


def stage_block_kinds(config, stages: int) -> list[dict[str, int]]:
    """{block kind: count} per PipeFusion rank (all its chunks), as the workers split them."""
    kinds = config.block_kinds
    return [dict(Counter(kinds[i].name for r in chunks for i in r)) for chunks in _stages(config, stages)]


@dataclass(frozen=True)
class Rows:
    """Token rows of one forward on one rank: `text` and `image` rows through its linear layers, and its
    self-attention's query rows (`q_text`, `q_image`) over key rows (`kv_text`, `kv_image`) on `heads` of the
    heads (cross-attention: its own image rows over the whole prompt, every head)."""

    text: float
    image: float
    q_text: float
    q_image: float
    kv_text: float
    kv_image: float
    heads: float = 1.0


def kind_seconds(kind, timing: KindTiming, rows: Rows, text_tokens: int, image_tokens: int,
                 fixed_rows: float = 0.0, audio_tokens: int = 0) -> float:
    """One block of `kind` on `rows`, scaled from its calibration at `text_tokens + image_tokens`: the linear
    part by the rows it sees (the prompt's only where it attends jointly), each attention layer by its query x
    key rows; work on r rows costs like r + `fixed_rows`. A two-stream family's `audio_tokens` split as its
    image rows do (both streams are cut over the same ranks)."""
    k, joint, n, a = fixed_rows, text_tokens + image_tokens, image_tokens, max(audio_tokens, 1)
    mine, full = (rows.text + rows.image, joint) if kind.prompt_rows else (rows.image, image_tokens)
    seconds = timing.linear_s * (mine + k) / (full + k)
    q_a, kv_a = a * rows.q_image / n, a * rows.kv_image / n  # this rank's audio queries and keys
    shapes = {"joint": (rows.q_text + rows.q_image, rows.kv_text + rows.kv_image, joint, joint, rows.heads),
              "image": (rows.q_image, rows.kv_image, n, n, rows.heads),
              # cross-attention needs no communication, so it runs on the rank's own rows over the whole prompt
              "prompt": (rows.image, text_tokens, n, text_tokens, 1.0),
              "audio_prompt": (a * rows.image / n, text_tokens, a, text_tokens, 1.0),
              "audio": (q_a, kv_a, a, a, rows.heads), "a2v": (rows.q_image, kv_a, n, a, rows.heads),
              "v2a": (q_a, rows.kv_image, a, n, rows.heads)}
    for layer, attention_s in zip(kind.attention, timing.attention_s):
        q, kv, q_full, kv_full, heads = shapes[layer]
        seconds += attention_s * heads * (q + k) * kv / ((q_full + k) * kv_full)
    return seconds


def project(strategy: StrategySpec, config, calib: Calibration, *, cfg: float, steps: int, batch: int = 1,
            act_bytes: int | None = None, stage_kinds: list[dict[str, int]] | None = None,
            per_call: bool = False, links: dict[str, LinkTiming] | None = None) -> Projection:
    """Seconds per step and per job of `strategy` under `calib`. `per_call`: a stock sampler calls the model
    once per step, so PipeFusion's pipeline fills and drains within every step. `links`: {op: link} for the ops
    whose groups cross a slower link than the calibration's (placement.links_by_op: groups across hosts)."""
    topo = Topology.from_strategy(strategy)
    bt = calib.blocks
    t_len, n_len = bt.text_tokens, bt.image_tokens
    if act_bytes is None:
        act_bytes = 2 if calib.device == "cuda" else 4
    batch = largest_share(strategy, batch)  # batch parallel: the fullest group's images set the step
    b_mult = batch * branches_per_forward(strategy, cfg)
    world = topo.world_size
    slow = 1.0
    if calib.device == "cpu":
        slow = max(1.0, world * calib.threads / calib.cores) / max(1.0, calib.threads / calib.cores)
    kinds = {kind.name: kind for kind in config.block_kinds}
    a_len = audio_rows(config, n_len)

    def blocks(counts: dict[str, int], rows: Rows) -> float:
        """The blocks `counts` (per kind) of one forward on `rows`, all branches, on a shared CPU; a tensor rank runs
        1/P of every block's heads and MLP units."""
        return b_mult * slow * sum(n * kind_seconds(kinds[name], bt.of(name), rows, t_len, n_len, calib.fixed_rows,
                                                    a_len) for name, n in counts.items()) / topo.tensor

    all_blocks = dict(Counter(kind.name for kind in config.block_kinds))
    if stage_kinds is None and topo.pipefusion > 1:
        stage_kinds = stage_block_kinds(config, topo.pipefusion)
    shapes = shapes_of(config, image_tokens=n_len, text_tokens=t_len, pipefusion=topo.pipefusion, batch=batch,
                       act_bytes=act_bytes, weight_bytes=act_bytes if strategy.sharded else 0.0)
    comm = _comm_times(strategy, shapes, calib, steps, cfg, links or {})
    comm_by_op, comm_job_extra, comm_rank = comm

    if topo.pipefusion > 1:
        m, u, r = strategy.patches, topo.ulysses, topo.ring
        sp = u * r
        # M patch forwards: queries (T + N/M) of which this rank computes 1/(U R) (its ring member's 1/R on 1/U of
        # the heads), keys over the whole sequence.
        patch = Rows(t_len / sp, n_len / (m * sp), t_len / r, n_len / (m * r), t_len, n_len, 1.0 / u)
        whole = Rows(t_len / sp, n_len / sp, t_len / r, n_len / r, t_len, n_len, 1.0 / u)
        steady_stage = [m * blocks(counts, patch) for counts in stage_kinds]
        warm_stage = [blocks(counts, whole) for counts in stage_kinds]
        return _pipeline_projection(strategy, calib, steps, steady_stage, warm_stage, comm, per_call)

    if topo.naive_patch > 1:
        p = topo.naive_patch
        compute = blocks(all_blocks, Rows(t_len, n_len / p, t_len, n_len / p, t_len, n_len / p))
    elif topo.patch > 1:  # displaced patch: its shard's rows over the whole (partly stale) K/V buffer
        p = topo.patch
        compute = blocks(all_blocks, Rows(t_len / p, n_len / p, t_len / p, n_len / p, t_len, n_len))
    else:
        sp, r, u = topo.ulysses * topo.ring, topo.ring, topo.ulysses
        compute = blocks(all_blocks, Rows(t_len / sp, n_len / sp, t_len / r, n_len / r, t_len, n_len, 1.0 / u))
    comm_s = max(sum(c.values()) for c in comm_rank) if comm_rank else 0.0
    if calib.overlap and topo.ring > 1:
        # Ring hops hide behind the self-attention that runs between them (cross-attention is not ringed).
        ring = max(c.get("ring", 0.0) for c in comm_rank)
        self_attention = sum(n * sum(t for layer, t in zip(kinds[name].attention, bt.of(name).attention_s)
                                     if layer not in CROSS_ATTENTION) for name, n in all_blocks.items())
        attn_share = b_mult * self_attention / (topo.ulysses * topo.ring) * (topo.ring - 1)
        comm_s = comm_s - ring + max(ring - attn_share, 0.0)
    if calib.overlap and strategy.sharded:
        # The next block's gather runs while this one computes (a prefetch on its own process group).
        weights = max(c.get("weights", 0.0) for c in comm_rank)
        comm_s = comm_s - weights + max(weights - compute, 0.0)
    step = compute + comm_s
    return Projection(strategy, step, steps * step + comm_job_extra, compute, comm_s, comm_by_op)


def _pipeline_projection(strategy: StrategySpec, calib: Calibration, steps: int, steady_stage: list[float],
                         warm_stage: list[float], comm: tuple, per_call: bool) -> Projection:
    """PipeFusion's step and job time from each stage's compute per step (steady: M patch forwards; warm-up:
    one whole forward) and its communication (`_comm_times`)."""
    comm_by_op, comm_job_extra, comm_rank = comm
    topo, m = Topology.from_strategy(strategy), strategy.patches
    comm_stage = [comm_rank[topo.rank_of(pipefusion=k)] for k in range(topo.pipefusion)]
    p2p = [sum(t for op, t in c.items() if op in ("pipefusion", "pipefusion_x")) for c in comm_stage]
    other = [sum(t for op, t in c.items() if op not in ("pipefusion", "pipefusion_x")) for c in comm_stage]
    if calib.overlap:
        stage_time = [max(c, p) + o for c, p, o in zip(steady_stage, p2p, other)]
    else:
        stage_time = [c + p + o for c, p, o in zip(steady_stage, p2p, other)]
    step = max(max(stage_time), sum(steady_stage) / m)
    compute = max(steady_stage)
    warm = sum(warm_stage) + sum(other) + sum(p2p)
    fill = sum(steady_stage[:-1]) / m
    if per_call:  # every patch goes through every stage before the call returns: the bubble, each step
        step, fill = sum(stage_time) / m + (m - 1) * max(stage_time) / m, 0.0
    w = min(strategy.warmup_steps, steps)
    job = w * warm + (steps - w) * step + (fill if steps > w else 0.0) + comm_job_extra
    return Projection(strategy, step, job, compute, max(step - compute, 0.0), comm_by_op)


def _comm_times(strategy: StrategySpec, shapes: Shapes, calib: Calibration, steps: int, cfg: float,
                links: dict[str, LinkTiming]):
    """Per rank {op: seconds per step}, the slowest rank's per-op figures, and the one-off result gather; each op
    on its link in `links`, else the calibration's."""
    topo = Topology.from_strategy(strategy)
    if topo.world_size == 1 or calib.link is None:
        return {}, 0.0, [{} for _ in range(topo.world_size)]
    link = calib.link
    traffic = job_traffic(strategy, shapes, steps=steps, cfg=cfg)
    per_rank, result = [], 0.0
    for rt in traffic:
        ops = {}
        for op, (sent, recv, msgs) in rt.ops.items():
            lat, bw = links.get(op, link).for_op(op)
            t = msgs * lat + max(sent, recv) / bw
            if op == "result":
                result = max(result, t)
                continue
            ops[op] = t / steps
        per_rank.append(ops)
    worst = {}
    for ops in per_rank:
        for op, t in ops.items():
            worst[op] = max(worst.get(op, 0.0), t)
    return worst, result, per_rank


# -------------------------------------------------------------------------------------------------
# Memory


@dataclass
class ParamLayout:
    """Parameter counts by who owns them (see flux_adapter.stage_ownership)."""

    blocks: list[int]
    always: int  # every stage (timestep/guidance/pooled embedders)
    first: int  # stage 0 only (image and text embedders)
    last: int  # last stage only (norm_out, proj_out)

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.always + self.first + self.last


def param_layout(config) -> ParamLayout:
    from ..models.registry import family_of

    blocks, always, first, last = family_of(config).parameter_counts(config)
    return ParamLayout(list(blocks), always, first, last)


def _kv_width(config, tensor: int = 1, ulysses: int = 1) -> int:
    """Width of the K (or V) rows one rank keeps per layer: its kv heads (GQA: fewer than the q heads) x head size."""
    heads = config.num_heads
    return attention_widths(config.hidden_size, heads, getattr(config, "num_kv_heads", heads), tensor, ulysses)[1]


def rank_memory(strategy: StrategySpec, config, *, text_tokens: int, image_tokens: int, batch: int, cfg: float,
                weight_bytes: float, act_bytes: int, layout: ParamLayout | None = None) -> dict:
    """Estimated peak bytes on the fullest rank: parameters, KV buffers and transient activations."""
    layout = layout or param_layout(config)
    topo = Topology.from_strategy(strategy)
    b = largest_share(strategy, batch) * branches_per_forward(strategy, cfg)  # batch parallel: the fullest group
    h, s_len = config.hidden_size, text_tokens + image_tokens
    if topo.pipefusion > 1:
        stages = _stages(config, topo.pipefusion)
        per_stage = []
        g = strategy.shard_group if strategy.sharded else 1
        for k, chunks in enumerate(stages):
            held = [layout.blocks[i] / topo.tensor for r in chunks for i in r]
            n = sum(held) / g + (2 * max(held) if g > 1 else 0) + layout.always
            n += layout.first if k == 0 else 0
            n += layout.last if k == len(stages) - 1 else 0
            per_stage.append((n, sum(len(r) for r in chunks)))
        params, layers = max(per_stage)
        # Stale K/V of every layer: the whole sequence on the kv heads of 1/U of the q heads (fewer under GQA), or
        # under Ring its ring member's 1/R.
        kv_width = _kv_width(config, topo.tensor, topo.ulysses)
        kv = 2 * b * -(-s_len // topo.ring) * kv_width * act_bytes * max(layers for _, layers in per_stage)
        rows = (text_tokens + image_tokens / strategy.patches) / (topo.ulysses * topo.ring)
    else:
        # Tensor parallelism splits the blocks' layers (modulation included); embedders and the head are whole.
        params = layout.total - sum(layout.blocks) * (1 - 1 / topo.tensor)
        if strategy.sharded:  # 1/G of each block kept, the running block and the prefetched one whole
            g = strategy.shard_group
            params -= sum(layout.blocks) / topo.tensor * (1 - 1 / g) - 2 * max(layout.blocks) / topo.tensor
        kv = 0
        sp = topo.ulysses * topo.ring * topo.naive_patch * topo.patch
        rows = s_len / sp
        if topo.patch > 1:  # the full-sequence K/V buffers of displaced patch, one per attention layer, and
            # the one layer's all-gather in flight per kind of attention (joint, image-only): the one tensor it
            # lands in (every member's shard padded to the longest, see displaced.py) and this rank's shard, which
            # the transfer reads until it completes
            kinds = len({joint for layers in config.attention_layers for joint in layers})
            longest = -(-s_len // topo.patch)
            in_flight = (topo.patch + 1) * longest
            kv = 2 * b * _kv_width(config) * act_bytes * (s_len * sum(len(layers) for layers in config.attention_layers)
                                                          + in_flight * kinds)
    # One block's live tensors: hidden, q/k/v, MLP hidden (4H) and norms on this rank's rows (q/k/v, attention
    # output and MLP hidden: a tensor rank's 1/P); the gathered sequence for Ulysses/Ring attention; about 3x for
    # temporaries.
    tp = topo.tensor
    act = 3 * b * rows * (4 * h + (4 * h + config.mlp_hidden) / tp) * act_bytes
    act += 3 * b * s_len * (h // (topo.ulysses * tp)) * act_bytes if (topo.ulysses > 1 or topo.ring > 1) else 0
    if strategy.cache != "off":  # the step cache keeps two hidden tensors of this rank's rows (step_cache.py)
        act += 2 * b * rows * h * act_bytes
    return {"params": int(params * weight_bytes), "kv": kv, "activations": int(act),
            "total": int(params * weight_bytes) + kv + int(act)}


# -------------------------------------------------------------------------------------------------


if __name__ == "__main__":
    if len(sys.argv) >= 6 and sys.argv[1] == "--probe":
        _probe(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        print("usage: python -m parallel_runtime.planning.costmodel --probe RANK WORLD STORE_DIR DEVICE (internal)")
