"""Sharded block weights (`shard_weights`): each rank of a replica group keeps 1/N of every block's bytes and gathers
a block just before it runs, so the result is the unsharded run's while each rank holds about half the blocks.

Every comparison is the same strategy sharded against unsharded (and one worker) on the same file and job: what
changes is only where the block bytes live between uses, so the exact strategies stay exact. Per-rank bytes are
what the workers report holding (`param_bytes`: every tensor their model holds, the kept slices included),
measured after the job, not computed from the config.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import make_job, rel_err
from test_comfy_quant import comfy_quant_twins
from test_families import FAMILIES, job
from test_fp8 import fp8_twins
from test_gguf import gguf_twins
from test_weight_patches import lora_stack, stacked
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.planning import costmodel
from parallel_runtime.planning.traffic import compare, job_traffic, shapes_of
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.sharded_weights import bind_weight_gatherer

pytestmark = pytest.mark.timeout(600)

# fp32 parity, as tests/test_parallel.py's: the exact strategies reorder sums (~1e-7 per op); sharding moves bytes,
# not arithmetic, so sharded equals unsharded bit for bit where the same process computes the same rows.
EXACT_RTOL = 1e-4
# Each rank keeps 1/2 of the block bytes plus every non-block tensor (embedders, final layer): the target
# is 0.55 of the model; the tiny Flux's embedders weigh more than a released model's (measured 0.548 here).
BYTES_PER_RANK = 0.55
SHARDED = [S(ulysses_degree=2, shard_weights=True), S(ring_degree=2, shard_weights=True),
           S(cfg_degree=2, shard_weights=True)]


def unsharded(s: S) -> S:
    return dataclasses.replace(s, shard_weights=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("shard")


@pytest.fixture(scope="module")
def flux(tiny_path, client1):
    return tiny_path, client1.run(make_job(tiny_path))


@pytest.mark.parametrize("strategy", SHARDED, ids=lambda s: s.label())
def test_flux_sharded_equals_unsharded_at_half_the_bytes(flux, client2, strategy):
    path, serial = flux
    plain = client2.run(make_job(path, unsharded(strategy)))
    result = client2.run(make_job(path, strategy))
    assert rel_err(result.latent, plain.latent) <= EXACT_RTOL
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    whole = serial.stats[0]["param_bytes"]
    for stats in result.stats:
        assert stats["param_bytes"] <= BYTES_PER_RANK * whole
    # What the gathers moved, counted by the comm layer: every rank receives the other's slice of each block once
    # per forward pass (8 steps; CFG parallel runs one branch per rank, the others both branches in one pass), and
    # the first block once more: the prefetch the last pass starts, landed when the job ends.
    slices = whole - result.stats[0]["param_bytes"]  # the half of the blocks a rank does not keep
    first_block = sum(t.numel() * 4 for t in flux_meta().transformer_blocks[0].state_dict().values()) // 2
    received = result.stats[0]["traffic"]["by_op"]["weights"][1]
    expected = 8 * slices + first_block
    assert abs(received - expected) <= 0.001 * expected, (received, expected)  # 64-byte alignment of each tensor
    # The traffic model (the cost model's and the bench's) counts the same gathers.
    analytic = job_traffic(strategy, shapes_of(TINY, image_tokens=64, text_tokens=7, weight_bytes=4), steps=8, cfg=2.0)
    assert abs(analytic[0].ops["weights"][1] - received) <= 0.001 * received
    ok, worst = compare([st["traffic"] for st in result.stats], analytic)
    assert ok and worst < 0.05, worst


def flux_meta():
    from parallel_runtime.models.registry import family_of

    return family_of(TINY).meta_model(TINY)


def test_flux_sharded_inside_pipefusion_and_tensor_groups(flux, client4):
    """On 4 workers the replica groups are the Ulysses pairs of each PipeFusion stage, and the CFG pairs of each
    tensor rank: sharding over them equals the unsharded hybrids."""
    path, _ = flux
    for strategy in (S(pipefusion_degree=2, ulysses_degree=2, warmup_steps=8, shard_weights=True),
                     S(cfg_degree=2, tensor_degree=2, shard_weights=True)):
        plain = client4.run(make_job(path, unsharded(strategy)))
        result = client4.run(make_job(path, strategy))
        assert rel_err(result.latent, plain.latent) <= EXACT_RTOL, strategy.label()
        assert max(s["param_bytes"] for s in result.stats) < 0.8 * max(s["param_bytes"] for s in plain.stats)


def test_skipped_blocks_keep_the_gathers_in_step(flux, client1, client2):
    """SkipLayerGuidance's skip (a double and the last single block) under sharding: the walk still gathers the
    skipped blocks, so the group's all-gathers pair up and the result is one worker's with the same skip."""
    path, _ = flux
    call = dataclasses.replace(make_job(path), timestep=torch.tensor([0.6, 0.6]), call_step=0,
                               latent=torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(4)),
                               skip_blocks=(("double_block", 1), ("single_block", TINY.num_single_layers - 1)))
    serial = client1.run(call).latent
    for strategy in SHARDED:
        result = client2.run(dataclasses.replace(call, strategy=strategy))
        assert rel_err(result.latent, serial) <= EXACT_RTOL, strategy.label()
    # A job after them runs with fresh gathers (the walk ended every job at the cycle's end).
    assert rel_err(client2.run(make_job(path, SHARDED[0])).latent, flux[1].latent) <= EXACT_RTOL


def test_wan_call_sharded_equals_serial(folder, client1, client2):
    """Wan 2.1 text-to-video per model call (a stock sampler's): cond and uncond rows under Ulysses and Ring, one
    branch per rank under CFG parallel."""
    import test_wan

    path = write_checkpoint(str(folder / "wan.safetensors"), test_wan.TINY_WAN, seed=1, prefix="model.diffusion_model.")
    serial = client1.run(test_wan.call_job(path, S()))
    whole, blocks = serial.stats[0]["param_bytes"], block_bytes(test_wan.TINY_WAN)
    for strategy in SHARDED:
        result = client2.run(test_wan.call_job(path, strategy))
        assert rel_err(result.latent, serial.latent) <= EXACT_RTOL, strategy.label()
        # The tiny Wan's text and time embedders weigh 1/4 of it (two blocks of 256): each rank keeps them and
        # half the blocks, to the 64-byte alignment of each tensor.
        held = max(s["param_bytes"] for s in result.stats)
        assert held - (whole - blocks) <= 0.501 * blocks, (held, whole, blocks)


def block_bytes(config) -> int:
    """The fp32 bytes of a model's blocks, from its meta model (no file read)."""
    from parallel_runtime.models.registry import family_of

    return 4 * sum(family_of(config).parameter_counts(config)[0])


def test_cancel_mid_job_leaves_the_group_in_step(flux, client2):
    """A Cancel stops every rank at the same step (a vote); the sharded walk then ends its cycle on each, so the
    same workers run the next sharded job, exactly."""
    from parallel_runtime.errors import Cancelled

    path, serial = flux
    pids = [p.pid for p in client2.procs] if client2.alive else None
    seen = []
    with pytest.raises(Cancelled):
        client2.run(make_job(path, SHARDED[1], steps=40), progress=lambda step, total, info: seen.append(step),
                    interrupted=lambda: len(seen) >= 2)
    assert client2.alive and (pids is None or [p.pid for p in client2.procs] == pids)  # kept, not restarted
    pids = [p.pid for p in client2.procs]
    assert rel_err(client2.run(make_job(path, SHARDED[1])).latent, serial.latent) <= EXACT_RTOL
    assert [p.pid for p in client2.procs] == pids


# -- storage kinds and LoRA --------------------------------------------------------------------------------------


def assert_sharded_equals_serial(client1, client2, name: str, path: str, patches=None) -> None:
    one, two = job((name, path)), job((name, path), SHARDED[0])
    if patches is not None:
        one, two = (dataclasses.replace(j, weight_patches=patches) for j in (one, two))
    serial, result = client1.run(one), client2.run(two)
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    assert max(s["param_bytes"] for s in result.stats) <= 0.6 * serial.stats[0]["param_bytes"]


@pytest.mark.parametrize("kind", ["fp8_scaled", "gguf", "nvfp4"])
def test_compact_files_shard_as_their_bytes(folder, client1, client2, kind):
    """fp8 weights with their scales, GGUF blocks and ComfyUI nvfp4 data with its swizzled block scales are sliced
    and gathered as bytes, and dequantized after the gather as an unsharded rank does."""
    name = "pixart" if kind == "gguf" else "kontext"
    if kind == "fp8_scaled":
        path, _ = fp8_twins(folder, name, torch.float8_e4m3fn, scaled=True)
    elif kind == "gguf":
        path, _ = gguf_twins(folder, name)
    else:
        path, _ = comfy_quant_twins(folder, name, "nvfp4")
    assert_sharded_equals_serial(client1, client2, name, path)


@pytest.mark.parametrize("kind", ["fp32", "fp8_scaled", "gguf"])
def test_lora_stack_on_sharded_blocks(folder, client1, client2, kind):
    """Two stacked LoRAs: baked into each gathered copy of an fp32 block (and back into fp8 with ComfyUI's seeded
    stochastic rounding for a scaled-fp8 file), added per call to GGUF layers; then the LoRA is taken off again."""
    name = "pixart" if kind == "gguf" else "kontext"
    if kind == "fp32":
        path = write_checkpoint(str(folder / "lora-base.safetensors"), FAMILIES[name], seed=11)
    elif kind == "gguf":
        path, _ = gguf_twins(folder, name)
    else:
        path, _ = fp8_twins(folder, name, torch.float8_e4m3fn, scaled=True)
    patches, _ = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    assert_sharded_equals_serial(client1, client2, name, path, patches)
    plain = client1.run(job((name, path))).latent
    assert rel_err(client2.run(job((name, path), SHARDED[0])).latent, plain) <= EXACT_RTOL  # the LoRA is off again
    assert rel_err(client1.run(dataclasses.replace(job((name, path)), weight_patches=patches)).latent, plain) > 1e-2


class GroupOfTwo:
    """The replica group of two WorkerStates built in this process: gathering block i fills the buffer with both
    ranks' kept slices of it, as the all-gather does (no process group, so every rank's state can be looked at)."""

    def __init__(self, models):
        self.slices = {}  # id(a rank's kept slice) -> both ranks' slices of that block, in rank order
        for blocks in zip(*(m.sharded_blocks for m in models)):
            for block in blocks:
                self.slices[id(block.kept)] = [b.kept for b in blocks]

    def group(self, name):
        return self

    def all_gather_into_async(self, out, kept, group, op):
        out.copy_(torch.cat(self.slices[id(kept)]))


class HostReads(TorchFunctionMode):
    """Counts the host data a rank moves onto its device: the tensors it reads from the file (FileParameters'
    read_stored) and the LoRA factors it moves (`.to`/`copy_` of the job's WeightPatch tensors, kept on the host as
    the channel delivered them). On CUDA each is a host-to-device copy; a CPU worker runs the same calls."""

    def __init__(self, monkeypatch, factors):
        super().__init__()
        import parallel_runtime.weights.patches as patches

        self.factors, self.file_reads, self.uploads = {id(t) for t in factors}, 0, 0
        read_stored = patches.read_stored

        def counted(*args, **kwargs):
            self.file_reads += 1
            return read_stored(*args, **kwargs)

        monkeypatch.setattr(patches, "read_stored", counted)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        source = args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
        if name in ("to", "copy_", "cuda") and id(source) in self.factors:
            self.uploads += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[int, int]:
        counts = (self.file_reads, self.uploads)
        self.file_reads = self.uploads = 0
        return counts


def gathered_pass(state, comm) -> dict[str, torch.Tensor]:
    """One forward pass's gathers on a rank (each block entered in order, as its first module's hook enters it, then
    the job's finish): a copy of every block tensor as gathered, by its model name."""
    gatherer = bind_weight_gatherer(state.adapter.model, comm)
    names = {id(m): n for n, m in state.adapter.model.named_modules()}
    seen = {}
    for i, block in enumerate(gatherer.blocks):
        gatherer.enter(i)
        seen.update({f"{names[id(block.block)]}.{n}": getattr(s.module, s.name).detach().clone()
                     for n, s in block.names.items()})
    gatherer.finish()
    state.end_job()
    return seen


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("kind", ["fp32", "fp8_scaled"])
def test_lora_on_sharded_blocks_reads_the_file_once_per_stack_not_per_gather(folder, monkeypatch, kind):
    """A LoRA on a sharded model (two ranks' WorkerStates in this process, one stock-sampler job per step): the
    patched values are formed when the stack is applied, then every pass's gathers bring them with no file read and
    no LoRA factor moved to the device, however many steps; the gathered tensors equal an unsharded rank's with the
    same stack bit for bit (ComfyUI's seeded stochastic rounding into fp8 included), with a second stack and off
    again."""
    from parallel_runtime.distributed.topology import Topology
    from parallel_runtime.runtime.worker import WorkerState

    name = "kontext"
    if kind == "fp32":
        path = write_checkpoint(str(folder / "reads-base.safetensors"), FAMILIES[name], seed=11)
    else:
        path, _ = fp8_twins(folder, name, torch.float8_e4m3fn, scaled=True)
    spec = {"path": path, "weight_dtype": "default"}
    ranks = [WorkerState(r, 2, torch.device("cpu")) for r in range(2)]
    for state in ranks:
        state.ensure_model(spec, Topology.from_strategy(SHARDED[0]))
    serial = WorkerState(0, 1, torch.device("cpu"))
    serial.ensure_model(spec, Topology.from_strategy(S()))
    held = {**dict(serial.adapter.model.named_parameters()), **dict(serial.adapter.model.named_buffers())}
    comm = GroupOfTwo([state.adapter.model for state in ranks])
    a, b = lora_stack(name, 1, 0.8, "a")[0], lora_stack(name, 2, -0.5, "b")[0]
    factors = [t for stack in (a, b) for ps in stack.weights.values() for p in ps for t in p.tensors.values()]
    counted = HostReads(monkeypatch, factors)
    lora_params = {n for k in a.weights for n, _ in ranks[0].patcher.targets[k]}  # b patches the same ones
    for patches in (a, b, None):
        serial.patcher.apply(patches)
        counted.take()  # the unsharded reference's reads
        with counted:
            for state in ranks:
                state.patcher.apply(patches)
            per_pass = []
            for step in range(4):  # one job per step: apply() finds the stack in place
                for state in ranks:
                    state.patcher.apply(patches)
                gathered = [gathered_pass(state, comm) for state in ranks]
                per_pass.append(counted.take())
        for tensor_name, value in gathered[0].items():
            assert torch.equal(as_bits(value), as_bits(held[tensor_name].detach())), (patches and patches.id, tensor_name)
        assert gathered[0].keys() == gathered[1].keys()
        assert per_pass[1:] == [(0, 0)] * 3, per_pass  # no host data moved once the stack is in place
        # The stack's first job: at most one file read per LoRA'd parameter (the patched value formed, or the file's
        # put back) and one move per LoRA factor, on each of the two ranks.
        stack_factors = [t for ps in (patches.weights.values() if patches else ()) for p in ps for t in p.tensors.values()]
        reads, uploads = per_pass[0]
        assert 0 < reads <= 2 * len(lora_params) and uploads <= 2 * len(stack_factors), per_pass


# -- planning -----------------------------------------------------------------------------------------------------


def test_memory_estimate_of_a_sharded_plan():
    """The cost model's per-rank weights under shard_weights: the non-block parameters, 1/G of the blocks and two
    whole blocks (the running one and the prefetch), for Flux.1 dev's real config on 2 and 4 ranks."""
    from parallel_runtime.bench.models import FLUX_DEV as dev  # 19 double, 38 single blocks of width 3072

    layout = costmodel.param_layout(dev)
    blocks, biggest = sum(layout.blocks), max(layout.blocks)
    for g in (2, 4):
        s = S(ulysses_degree=g, shard_weights=True)
        mem = costmodel.rank_memory(s, dev, text_tokens=512, image_tokens=4096, batch=1, cfg=1.0, weight_bytes=2,
                                    act_bytes=2, layout=layout)
        assert mem["params"] == int((layout.total - blocks + blocks / g + 2 * biggest) * 2)
        plain = costmodel.rank_memory(unsharded(s), dev, text_tokens=512, image_tokens=4096, batch=1, cfg=1.0,
                                      weight_bytes=2, act_bytes=2, layout=layout)
        print(f"\nFlux.1 dev bf16 on {g}: {mem['params'] / 2**30:.1f} GB of weights per rank sharded, "
              f"{plain['params'] / 2**30:.1f} GB unsharded")
        assert mem["params"] < (1 / g + 0.1) * plain["params"]


def test_auto_shards_only_where_the_model_does_not_fit():
    """Flux.1 dev in bf16 (22 GB) on two 16 GB GPUs: the replicated splits do not fit, their sharded twins do and
    are ranked with their gathers; with room for the whole model nothing is sharded."""
    from parallel_runtime.bench.models import FLUX_DEV
    from parallel_runtime.planning.auto import describe_choice, pick, rank_candidates

    calib = costmodel.gpu_calibration(FLUX_DEV, 512, 4096, "PCIe")
    kw = dict(text_len=512, steps=28, weight_dtype="bf16")
    tight = rank_candidates(FLUX_DEV, (1, 16, 128, 128), 1.0, ["cuda:0", "cuda:1"], calib,
                            memory_budget_bytes=16 * 2**30, **kw)
    replicated = [c for c in tight if c.strategy.pipefusion_degree == 1 and c.strategy.tensor_degree == 1]
    assert replicated and all(c.strategy.sharded and c.fits for c in replicated)
    best = pick(tight)
    assert best.fits
    roomy = rank_candidates(FLUX_DEV, (1, 16, 128, 128), 1.0, ["cuda:0", "cuda:1"], calib,
                            memory_budget_bytes=70 * 2**30, **kw)
    assert not any(c.strategy.sharded for c in roomy)
    sharded = next(c for c in replicated if c.strategy.ulysses_degree == 2)
    text = describe_choice(sharded, tight, 100.0, 1.0, calib, 16 * 2**30)
    assert "sharding weights: the model does not fit replicated in 16.0 GB per device" in text
    assert sharded.projection.comm_by_op["weights"] > 0  # the gathers are in its projection


def test_client_settles_auto_sharding_and_refuses_what_never_fits(folder):
    """shard_weights "auto" turns on for a job that does not fit a rank unsharded and does sharded; a job that fits
    neither way is refused before loading in one sentence that names what each lean plan would need. (A Flux of
    18 blocks: with the tiny one's 4, two whole blocks in flight outweigh the half a rank leaves out.)"""
    from parallel_runtime.planning.memory import check_job_memory, job_rank_memory, settle_weight_sharding

    deep = dataclasses.replace(TINY, num_layers=6, num_single_layers=12)
    path = write_checkpoint(str(folder / "deep-flux.safetensors"), deep, seed=0)
    job = make_job(path, S(ulysses_degree=2, shard_weights="auto"))
    devices = ["cuda:0", "cuda:1"]
    plain = job_rank_memory(job, devices[0], S(ulysses_degree=2))["total"]
    sharded = job_rank_memory(job, devices[0], S(ulysses_degree=2, shard_weights=True))["total"]
    assert sharded < plain

    def reports(budget):  # a GPU worker's ping: usable = 0.9 x free
        return [{"held_bytes": 0, "device_free": int(budget / 0.9), "host_available": 2**34}] * 2

    assert settle_weight_sharding(job, devices, reports(plain * 1.01)).strategy.shard_weights is False
    settled = settle_weight_sharding(job, devices, reports((plain + sharded) / 2))
    assert settled.strategy.shard_weights is True and settled.strategy.label() == "ulysses2+shard"
    check_job_memory(settled, devices, reports((plain + sharded) / 2))
    too_small = settle_weight_sharding(job, devices, reports(sharded * 0.9))
    with pytest.raises(ConfigError, match=r"this job needs about .* per worker .* but worker \d \(cuda:\d\) has .* "
                                          r"available; per worker, .*PipeFusion over 2 devices about"):
        check_job_memory(too_small, devices, reports(sharded * 0.9))
    unsharded_job = make_job(path, S(ulysses_degree=2))
    with pytest.raises(ConfigError, match=r"shard_weights on about"):
        check_job_memory(unsharded_job, devices, reports(sharded * 1.2))


# -- refusals ------------------------------------------------------------------------------------------------------


def test_shard_without_replicas_is_refused_in_one_sentence(flux, client2):
    path, _ = flux
    with pytest.raises(ConfigError, match="shard_weights needs ranks that hold the same blocks .* each PipeFusion "
                                          "stage already holds only its blocks; set shard_weights off"):
        client2.run(make_job(path, S(pipefusion_degree=2, shard_weights=True)))
    with pytest.raises(ConfigError, match="each tensor rank already holds only its part"):
        client2.run(make_job(path, S(tensor_degree=2, shard_weights=True)))

