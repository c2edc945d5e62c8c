"""What the CUDA path needs, checked on CPU.

- The time inputs are rounded as ComfyUI rounds them in bf16.
- The step loop never waits for the device: run on the 'meta' device, where reading a tensor's value (an
  `if` on it, .item(), a copy to the host) raises, with every index tensor on x's device and no host-to-device
  copy whose count grows with the steps (on CUDA each blocking upload is a sync too).
- The dtype and attention-kernel choices for GPUs below compute capability 8.0.
- The CPU kernels behind Ring's log-sum-exp merge against float64 (tests/gpu repeats this on CUDA kernels).
"""
from __future__ import annotations

import math
import types

import pytest
import torch
from diffusers import FluxTransformer2DModel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import make_job, rel_err
from gpu.numerics import LSE_ATOL, OUT_RTOL, attention_bias, errors, inputs
from parallel_runtime.strategies.attention.local import lse_kernel
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.distributed.comm import Group
from parallel_runtime.strategies.denoise import Denoiser
from parallel_runtime.distributed.devices import default_dtype, resolve_dtype
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families.flux_adapter import load_flux
from parallel_runtime.models.families.flux_adapter import FluxAdapter, pipeline_stages
from parallel_runtime.models.tiny import TINY
from parallel_runtime.sampling import SAMPLERS, calculate_sigmas, make_sampler, model_sampling_for
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.distributed.topology import DIMS, Topology

# -- time inputs ----------------------------------------------------------------------------------------------


def comfyui_timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: int = 10000) -> torch.Tensor:
    """comfy/ldm/flux/layers.py timestep_embedding, for an already scaled t: float32 sinusoid [cos, sin]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def test_time_inputs_are_rounded_as_comfyui_rounds_them_in_bf16(tiny_path):
    config, model = load_flux(tiny_path, dtype=torch.bfloat16)
    adapter = FluxAdapter(config, model, [range(4)], AttentionContext())
    sigma = torch.tensor([0.7231, 0.0917])  # float32, as ComfyUI's sigmas
    pooled = torch.randn(2, config.pooled_dim, generator=torch.Generator().manual_seed(0))
    guidance = torch.full((2,), 3.5)
    embed = model.time_text_embed
    got = adapter.timestep_embedding(sigma, pooled, guidance)

    # ComfyUI's model_base: timestep(sigma).float(), x1000 in float32; guidance and pooled, like every extra
    # cond, converted to the model's dtype first, so guidance's x1000 happens in bf16 (3.5 -> 3504).
    assert float(guidance.bfloat16()[0] * 1000) == 3504.0
    assert torch.equal(got, embed(sigma * 1000, guidance.bfloat16() * 1000, pooled.bfloat16()))
    # diffusers builds the same float32 sinusoid from that t, bit for bit, and casts it afterwards, as ComfyUI.
    assert torch.equal(embed.time_proj(sigma * 1000), comfyui_timestep_embedding(sigma * 1000))
    # The old way (t rounded to bf16 before the x1000: 723.1 -> 724) moved the embedding by whole radians.
    old = embed(sigma.bfloat16() * 1000, guidance.bfloat16() * 1000, pooled.bfloat16())
    assert rel_err(old, got) > 1e-2  # measured 7e-2; it moved the latent 3.7e-2 from ComfyUI's bf16 KSampler


# -- no host-device syncs in the step loop ----------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLERS)
def test_sampler_steps_decide_on_the_host(name):
    """x and denoised on 'meta': every comparison of a device tensor in an `if` raises there."""
    sigmas = calculate_sigmas(model_sampling_for("dev"), "simple", 6)  # ends at 0: the branches are taken
    sampler = make_sampler(name, sigmas, 0, (1, 16, 8, 8), to_state=FluxAdapter.pack, noise_device="cpu")
    x = torch.empty(1, 16, 64, device="meta")
    for i in range(6):
        for region in (slice(0, 10), slice(10, 16)):
            x[:, region] = sampler.step(i, x[:, region], x[:, region], region)


_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "index_copy", "index_copy_", "index_select",
             "index_add", "index_add_", "gather", "scatter", "scatter_"}


class DeviceTraffic(TorchDispatchMode):
    """Counts host-to-device copies and records index tensors that live off the indexed tensor's device."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.uploads, self.stray_indices = torch.device(device), 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _INDEXING:
            for t in tree_flatten((args[1:], kwargs))[0]:
                if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.device != args[0].device:
                    self.stray_indices.append(name)
        if func is torch.ops.aten._to_copy.default:
            self.uploads += args[0].device.type == "cpu" and torch.device(kwargs.get("device") or "cpu") == self.device
        if func is torch.ops.aten.copy_.default:
            self.uploads += args[1].device.type == "cpu" and args[0].device == self.device
        return func(*args, **kwargs)


class LoopbackComm:
    """Just enough of Comm to run one rank alone: messages go nowhere and arrive empty (on 'meta' they have
    no data anyway); collectives return their output buffers."""

    def __init__(self, topology: Topology, rank: int):
        self.topology, self.rank, self.device = topology, rank, torch.device("meta")
        self._groups = {name: Group(ranks, ranks.index(rank))
                        for name, groups in [(d, topology.groups(d)) for d in DIMS] + [("sp", topology.sp_groups())]
                        for ranks in groups if rank in ranks}

    def group(self, name):
        return self._groups[name]

    def isend(self, t, dst, op=""):
        return types.SimpleNamespace(wait=lambda: None, is_completed=lambda: True)

    irecv = isend

    def ring_exchange(self, send, recv, group, op=""):
        return []

    def all_to_all(self, out, inp, out_splits, in_splits, group, op=""):
        return out

    def all_gather(self, t, group, op=""):
        return [t] * group.size

    def vote_async(self, flag):
        return None, torch.tensor([int(flag)])


def _device_traffic_per_rank(strategy: S, steps: int, sampler: str) -> list[DeviceTraffic]:
    topology = Topology.from_strategy(strategy)
    found = []
    for rank in range(topology.world_size):
        with torch.device("meta"):
            model = FluxTransformer2DModel(**TINY.diffusers_kwargs())
        context = AttentionContext()
        chunks = pipeline_stages(TINY, topology.pipefusion)[topology.coords(rank)["pipefusion"]]
        adapter = FluxAdapter(TINY, model, chunks, context)
        watch = DeviceTraffic("meta")
        with watch:
            Denoiser(adapter, topology, LoopbackComm(topology, rank), context).run(
                make_job("unused.safetensors", strategy, steps=steps, sampler=sampler))
        found.append(watch)
    return found


@pytest.mark.parametrize("strategy", [
    S(), S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
    S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1),
    S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=4, warmup_steps=2),
], ids=lambda s: s.label())
def test_step_loop_never_waits_for_the_device(monkeypatch, strategy):
    """Every rank's real Denoiser on 'meta'. Finishing at all proves no value was read back; on top, every
    index PipeFusion (or the sequence-parallel path) uses lives on x's device, and the uploads are a fixed
    set made before the loop: as many for 2 steps as for 5. dpmpp_2m: the sampler with a branch and a
    history (euler_ancestral draws its noise on x's device, and 'meta' has no generator; the sampler test
    above covers its branch)."""
    monkeypatch.setattr(Denoiser, "_gather_result", lambda self, x, spatial: None)  # the final .cpu() has no data
    short, long = (_device_traffic_per_rank(strategy, steps, "dpmpp_2m") for steps in (2, 5))
    assert all(not w.stray_indices for w in short + long), [w.stray_indices[:3] for w in short + long]
    assert [w.uploads for w in short] == [w.uploads for w in long]


# -- GPUs below compute capability 8.0 ---------------------------------------------------------------------


@pytest.mark.parametrize("device_type,capability,dtype", [
    ("cpu", None, torch.float32),
    ("cuda", (9, 0), torch.bfloat16), ("cuda", (8, 0), torch.bfloat16), ("cuda", (8, 6), torch.bfloat16),
    ("cuda", (12, 0), torch.bfloat16),
    ("cuda", (7, 5), torch.float16), ("cuda", (7, 0), torch.float16), ("cuda", (6, 1), torch.float16),
])
def test_default_dtype(device_type, capability, dtype):
    assert default_dtype(device_type, capability) == dtype


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("default", cpu) == torch.float32
    assert [resolve_dtype(n, cpu) for n in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    assert [resolve_dtype(n, cpu) for n in ("fp8_e4m3fn", "fp8_e5m2")] == [torch.float32] * 2  # fp8 computes in fp32
    with pytest.raises(ConfigError, match="choose one of default, bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2"):
        resolve_dtype("fp8", cpu)


@pytest.mark.parametrize("device_type,dtype,capability,kernel", [
    ("cpu", torch.float32, None, "flash_cpu"), ("cpu", torch.bfloat16, None, "flash_cpu"),
    ("cuda", torch.bfloat16, (9, 0), "flash"), ("cuda", torch.float16, (8, 0), "flash"),
    ("cuda", torch.bfloat16, (12, 1), "flash"),
    ("cuda", torch.bfloat16, (13, 0), "efficient"),  # newer than torch's flash build: still a fused LSE
    ("cuda", torch.float32, (9, 0), "efficient"),  # flash has no fp32 kernel
    ("cuda", torch.float16, (7, 5), "efficient"), ("cuda", torch.float16, (7, 0), "efficient"),
    ("cuda", torch.float32, (6, 1), "efficient"),
    ("cuda", torch.bfloat16, (7, 5), "math"),  # no fused bf16 kernel below sm80
    ("meta", torch.float32, None, "math"), ("mps", torch.float16, None, "math"),
])
def test_lse_kernel_choice(device_type, dtype, capability, kernel):
    assert lse_kernel(device_type, dtype, capability) == kernel
    # An attention mask's bias: flash takes none, so the memory-efficient kernel (which does) runs instead.
    assert lse_kernel(device_type, dtype, capability, biased=True) == ("efficient" if kernel == "flash" else kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "bias"])
def test_cpu_lse_kernels_and_ring_merge_match_float64(kernel, dtype, masked):
    q, k, v = inputs("cpu", dtype)
    bias = attention_bias(q, k) if masked else None
    e = errors(q, k, v, kernel, bias=bias)  # tolerances and their reasons: tests/gpu/numerics.py
    assert e["out"] <= OUT_RTOL[dtype] and e["merged_out"] <= OUT_RTOL[dtype], e
    assert e["lse"] <= LSE_ATOL and e["merged_lse"] <= LSE_ATOL, e


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value back to the host (`int(t)`, `.item()`, an `if` on a tensor): each is a
    device sync on CUDA."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_camera_and_vace_rows_are_embedded_once_per_index_and_never_read_back():
    """Wan Fun camera, Wan Animate's pose and VACE keep per-rows tensors (the camera adapter's output, the pose
    embedding, the VACE context's embedding): made once for each index tensor the step loop holds, and no later
    forward reads the index's values back to key on them (one sync per forward on a GPU before). A new index tensor
    of other rows gets its own rows."""
    from parallel_runtime.strategies.denoise import Branches

    rows, width, made = 12, 4, []

    class Adapter:  # embeds a row as its index, so the rows each forward got are visible
        def embed_image(self, x, index, hw):
            return x[..., :1].expand(-1, -1, width) * 0 + index[None, :, None].float()

        def embed_camera(self, camera, index, hw):
            made.append("camera")
            return camera[:, index]

        def embed_vace(self, context):
            made.append("vace")
            return context.flatten(1, 2)

        def embed_pose(self, pose, index, hw):
            made.append("pose")
            return pose[:, index] * 0.5

    branches = Branches.__new__(Branches)
    branches.concat = None
    branches.camera = torch.arange(rows, dtype=torch.float32)[None, :, None].expand(1, rows, width) * 100
    branches.vace = torch.arange(rows, dtype=torch.float32)[None, None, :, None].expand(1, 1, rows, width) * -1
    branches._camera_rows, branches._vace_rows = {}, {}
    branches.pose = torch.arange(rows, dtype=torch.float32)[None, :, None].expand(1, rows, width) * 2
    branches._pose_rows = {}
    adapter, first, second = Adapter(), torch.arange(0, 6), torch.arange(6, 12)
    x = torch.zeros(1, 6, width)
    out = branches.embed(adapter, x, first, None)
    with HostReads() as watch:
        for _ in range(3):
            again = branches.embed(adapter, x, first, None)
    assert watch.reads == 0 and made == ["camera", "pose", "vace"], (watch.reads, made)
    assert torch.equal(again, out)
    assert torch.equal(out[0, :6, 0], torch.arange(6) * 102.0) and torch.equal(out[0, 6:, 0], -torch.arange(6.0))
    other = branches.embed(adapter, x, second, None)
    assert made == ["camera", "pose", "vace"] * 2
    assert torch.equal(other[0, :6, 0], torch.arange(6, 12) * 102.0)
    assert torch.equal(other[0, 6:, 0], -torch.arange(6.0, 12))


class DeviceReads(HostReads):
    """HostReads plus the reads a CPU run hides: a boolean-mask index or assignment (its row count is read back on
    CUDA) and `.tolist()` (counted by the test's patch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) else ()
        self.reads += any(i is not None and i.dtype == torch.bool for i in indices)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_hidream_moe_reads_its_routing_back_once_and_equals_comfyui_bit_for_bit(monkeypatch):
    """HiDream's mixture of experts runs each picked expert on the rows ComfyUI's per-expert boolean masks give it,
    in their order, so the result is ComfyUI's bit for bit (an expert nobody picked included); it reads the rows per
    expert back once per call, where the masks read back twice per expert (8 device syncs per block of the 48)."""
    from test_hidream import _moe as comfyui_moe

    from parallel_runtime.models.families.hidream import HiDreamAdapter

    dim, hidden, experts = 64, 96, 4
    g = torch.Generator().manual_seed(3)
    sd = {"ff.gate.weight": torch.randn(experts, dim, generator=g) / 8}
    sd["ff.gate.weight"][3] = -100.0  # with positive rows, expert 3 is never picked
    for name in [f"experts.{e}" for e in range(experts)] + ["shared_experts"]:
        for w, shape in (("w1", (hidden, dim)), ("w3", (hidden, dim)), ("w2", (dim, hidden))):
            sd[f"ff.{name}.{w}.weight"] = torch.randn(*shape, generator=g) / 8

    def swiglu(name):  # w1, w3, w2 as bias-free linear layers holding the state dict's tensors
        linear = lambda w: torch.nn.utils.skip_init(torch.nn.Linear, *w.shape[::-1], bias=False).requires_grad_(False)
        layers = {w: linear(sd[f"ff.{name}.{w}.weight"]) for w in ("w1", "w3", "w2")}
        for w, layer in layers.items():
            layer.weight.copy_(sd[f"ff.{name}.{w}.weight"])
        return types.SimpleNamespace(**layers)

    moe = types.SimpleNamespace(gate=types.SimpleNamespace(weight=sd["ff.gate.weight"]),
                                experts=[swiglu(f"experts.{e}") for e in range(experts)],
                                shared_experts=swiglu("shared_experts"))
    adapter = HiDreamAdapter.__new__(HiDreamAdapter)
    adapter.model = types.SimpleNamespace()  # no tensor_split: the whole MoE on this rank
    x = torch.randn(1, 37, dim, generator=g).abs()

    tolist, lists = torch.Tensor.tolist, []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: lists.append(t.shape) or tolist(t))
    with torch.no_grad(), DeviceReads() as watch:
        out = adapter._moe(moe, x)
    assert watch.reads + len(lists) == 1, (watch.reads, lists)
    with torch.no_grad(), DeviceReads() as watch:
        reference = comfyui_moe(sd, "ff", x)
    assert watch.reads >= 2 * (experts - 1)  # what the masks cost: the counter sees them
    assert torch.equal(out, reference)
