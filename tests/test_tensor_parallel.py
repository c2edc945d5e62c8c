"""Tensor parallelism (`tensor_degree`): each rank holds its share of every block's linear layers and the block's
partial sums are all-reduced, so the result equals one worker's: on every family, in every storage kind, with a
LoRA, beside CFG and Ulysses, and per model call under a stock sampler.

Every comparison is tensor-parallel workers against one worker on the same file, job and storage: what changes is
only where the sums of the split layers are summed.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from conftest import make_job, rel_err
from test_comfy_quant import comfy_quant_twins
from test_families import FAMILIES, job
from test_fp8 import fp8_twins
from test_gguf import gguf_twins
from test_weight_patches import lora_stack, stacked
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families.wan import WanConfig
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.planning import costmodel
from parallel_runtime.planning.auto import candidate_strategies
from parallel_runtime.planning.traffic import compare, job_traffic, shapes_of
from parallel_runtime.spec import SamplingSpec
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

# fp32 parity bound, as tests/test_parallel.py's: a split layer sums its input columns in two halves and adds them
# (~1e-7 relative per op); measured 2e-7 .. 5e-7 over whole runs here. A wrong shard, head count or bias shows at
# 1e-2 or more.
EXACT_RTOL = 1e-4
# bf16 against the bf16 serial run, as tests/test_parallel.py's BF16_RTOL: the halves' partial sums round to bf16
# before the all-reduce adds them, moving an element to the neighbouring bf16 value now and then (measured below).
BF16_RTOL = 1e-2
# Each rank holds 1/2 of the blocks' attention, MLP and modulation weights; the embedders, norms and final layer
# are every rank's. The target for tp2; the tiny families measure 0.53-0.58.
PARAMS_PER_RANK = 0.6
TP2 = S(tensor_degree=2)
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]  # kontext: a Flux.1 dev file


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tensor")


@pytest.fixture(scope="module")
def flux(tiny_path, client1):
    """(path, serial result) of the tiny Flux file (4 heads: tp2 leaves each rank 2, which Ulysses-2 can split)."""
    return tiny_path, client1.run(make_job(tiny_path))


def test_flux_tp2_equals_serial_holding_half_the_blocks(flux, client2):
    path, serial = flux
    result = client2.run(make_job(path, TP2))
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    for stats in result.stats:
        assert stats["param_bytes"] <= PARAMS_PER_RANK * serial.stats[0]["param_bytes"]
        assert set(stats["traffic"]["by_op"]) == {"tensor"}  # all-reduces (and modulation gathers), nothing else
    # traffic.py's all-reduces per block; it leaves out the modulation gathers, 3.5% of the bytes at these 64 image
    # tokens (0.1% at the bench's 4096), within the bench's 10%.
    analytic = job_traffic(TP2, shapes_of(TINY, image_tokens=64, text_tokens=7), steps=8, cfg=2.0)
    ok, worst = compare([s["traffic"] for s in result.stats], analytic)
    assert ok and worst < 0.05, worst


def test_planning_knows_tensor_parallel():
    """Auto proposes tensor splits where the family has a plan and heads and MLP divide, and the memory estimate
    gives each tensor rank 1/P of the blocks' parameters."""
    cands = {s.label() for s in candidate_strategies(4, 3.5, heads=4, num_blocks=4, latent_hw=(32, 32),
                                                     mlp_hidden=512, tensor=True)}
    assert {"tp4", "cfg2xtp2", "ulysses2xtp2", "ring2xtp2", "pp2xtp2xM2w1"} <= cands
    assert not any(s.tensor_degree > 1 for s in candidate_strategies(4, 3.5, heads=4, num_blocks=4,
                                                                   latent_hw=(32, 32)))
    layout = costmodel.param_layout(TINY)
    whole, split = (costmodel.rank_memory(s, TINY, text_tokens=7, image_tokens=64, batch=1, cfg=2.0, weight_bytes=4,
                                          act_bytes=4)["params"] for s in (S(), TP2))
    assert whole - split == pytest.approx(4 * sum(layout.blocks) / 2, rel=1e-6)


@pytest.mark.parametrize("strategy", [S(cfg_degree=2, tensor_degree=2), S(ulysses_degree=2, tensor_degree=2),
                                      S(ring_degree=2, tensor_degree=2)], ids=lambda s: s.label())
def test_flux_tp2_composes_with_cfg_ulysses_and_ring_on_four(flux, client4, strategy):
    """Ulysses inside a tensor rank all-to-alls the rank's 2 heads; CFG and Ring see a whole model's outputs."""
    path, serial = flux
    assert rel_err(client4.run(make_job(path, strategy)).latent, serial.latent) <= EXACT_RTOL


def test_flux_tp2_inside_pipefusion_and_displaced_patch_stages(flux, client2, client4):
    """Each PipeFusion stage (or displaced-patch rank) split over 2 tensor ranks: exact while every step warms up,
    and after one warm-up step the same stale-K/V result as the stages unsplit (the K/V cached per local head)."""
    path, serial = flux
    for strategy in (S(pipefusion_degree=2, tensor_degree=2, warmup_steps=8),
                     S(patch_degree=2, tensor_degree=2, warmup_steps=8)):
        assert rel_err(client4.run(make_job(path, strategy)).latent, serial.latent) <= EXACT_RTOL, strategy.label()
    stale = client4.run(make_job(path, S(pipefusion_degree=2, tensor_degree=2, warmup_steps=1))).latent
    unsplit = client2.run(make_job(path, S(pipefusion_degree=2, warmup_steps=1))).latent
    assert rel_err(stale, serial.latent) > 1e-3  # stale K/V really is approximate here
    assert rel_err(stale, unsplit) <= EXACT_RTOL


def test_flux_tp2_in_bf16(flux, client1, client2):
    path, serial = flux

    def bf16(j):
        return dataclasses.replace(j, model=dataclasses.replace(j.model, weight_dtype="bf16"))

    reference = client1.run(bf16(make_job(path))).latent
    err = rel_err(client2.run(bf16(make_job(path, TP2))).latent, reference)
    print(f"\nbf16 tp2 vs bf16 serial: {err:.2e}")
    assert err <= BF16_RTOL
    assert rel_err(reference, serial.latent) > 10 * BF16_RTOL  # the bf16 run really is bf16


def test_flux_model_call_under_tp2_equals_serial(flux, client1, client2, client4):
    """One stock-sampler call (cond and uncond rows batched): its raw output, alone and beside CFG parallel."""
    path, _ = flux
    g = torch.Generator().manual_seed(9)
    call = dataclasses.replace(make_job(path), sampling=SamplingSpec(steps=1), timestep=torch.tensor([0.7, 0.7]),
                               latent=torch.randn(2, 16, 16, 16, generator=g), call_step=0)
    serial = client1.run(call).latent
    assert rel_err(client2.run(dataclasses.replace(call, strategy=TP2)).latent, serial) <= EXACT_RTOL
    hybrid = dataclasses.replace(call, strategy=S(cfg_degree=2, tensor_degree=2))
    assert rel_err(client4.run(hybrid).latent, serial) <= EXACT_RTOL


def test_controlnets_split_with_the_dit_under_tp2(folder, client1, client2):
    """Chained ControlNets (XLabs; InstantX with a single block) on both branches of a model call: each tensor rank
    holds its part of their blocks too (they would otherwise run whole on every rank), and the output is one
    worker's."""
    import test_controlnet as cn
    from parallel_runtime.models.tiny import write_controlnet

    files = {"dit": write_checkpoint(str(folder / "cn-flux.safetensors"), TINY, seed=5),
             "xlabs": write_controlnet(folder / "xlabs.safetensors", TINY, "xlabs", double=2, seed=1),
             "instantx": write_controlnet(folder / "instantx.safetensors", TINY, "instantx", double=1, single=1,
                                          seed=2)}
    pos = [cn.control(files, "xlabs", 11, 0.6), cn.control(files, "instantx", 12, 1.3)]
    neg = [cn.control(files, "xlabs", 14)]
    serial = client1.run(cn.call_job(files, S(), pos, neg))
    result = client2.run(cn.call_job(files, TP2, pos, neg))
    plain = client1.run(cn.call_job(files, S()))
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    assert rel_err(plain.latent, serial.latent) > 1e-2  # the ControlNets really act
    # The DiT and both ControlNets: each rank's share, as for the DiT alone.
    ratio = max(st["param_bytes"] for st in result.stats) / serial.stats[0]["param_bytes"]
    print(f"\nDiT + 2 ControlNets under tp2: {ratio:.2f} of one worker's bytes per rank")
    assert ratio <= PARAMS_PER_RANK


@pytest.mark.parametrize("name", NAMES)
def test_family_tp2_equals_serial(folder, client1, client2, name):
    """Flux (double and fused single blocks, Kontext references), SD3.5 Medium (joint and image-only attention,
    a pre-only last block), Qwen-Image (its own modulation layers), PixArt (self- and cross-attention) and Chroma
    (Flux's blocks, no modulation layers)."""
    path = write_checkpoint(str(folder / f"{name}.safetensors"), FAMILIES[name], seed=11,
                            prefix="model.diffusion_model.")
    serial = client1.run(job((name, path)))
    result = client2.run(job((name, path), TP2))
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    assert max(s["param_bytes"] for s in result.stats) <= PARAMS_PER_RANK * serial.stats[0]["param_bytes"]


# Families tested per model call, with their own modules' tiny configs and call jobs: (module, config name).
CALL_FAMILIES = {"wan": ("test_wan", "TINY_WAN"), "wan_i2v": ("test_wan", "TINY_WAN_I2V"),
                 "flux2": ("test_flux2", "DEV"), "qwen_image21": ("test_qwen_image21", "TINY"),
                 "z_image": ("test_z_image", "TINY"), "lumina2": ("test_lumina2", "TINY"),
                 "hunyuan_video15": ("test_hunyuan_video15", "TINY")}


@pytest.mark.parametrize("name", list(CALL_FAMILIES))
def test_call_family_tp2_equals_serial(folder, client1, client2, name):
    """Wan 2.1 (its q/k RMSNorms span all heads: their sums of squares are all-reduced; image-to-video's CLIP keys
    and values split too), FLUX.2 (fused q/k/v/MLP projection and SwiGLU, cut by diffusers' packed plan),
    Qwen-Image 2.1, Z-Image (LLaMA-style SwiGLU), Lumina 2 (fused GQA q/k/v in three parts) and HunyuanVideo 1.5."""
    module_name, config_name = CALL_FAMILIES[name]
    module = importlib.import_module(module_name)
    path = write_checkpoint(str(folder / f"{name}.safetensors"), getattr(module, config_name), seed=1,
                            prefix="model.diffusion_model.")
    call = module.i2v_job if name == "wan_i2v" else module.call_job
    serial = client1.run(call(path, S()))
    result = client2.run(call(path, TP2))
    print(f"\n{name} tp2: {rel_err(result.latent, serial.latent):.1e} from serial, params per rank "
          f"{result.stats[0]['param_bytes'] / serial.stats[0]['param_bytes']:.2f} of the model")
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    # At these tiny widths what every rank holds weighs more than in released models (Wan 2.1 I2V's CLIP-vision
    # projection, HunyuanVideo 1.5's token refiner, FLUX.2's shared modulations): measured 0.60-0.86 of the model.
    assert max(s["param_bytes"] for s in result.stats) < 0.9 * serial.stats[0]["param_bytes"]


# -- storage kinds ---------------------------------------------------------------------------------------------


def assert_tp2_equals_serial(client1, client2, name: str, path: str, patches=None) -> None:
    """`path` (with `patches`, if any) under tp2 equals one worker, each rank holding less than the whole file."""
    one, two = job((name, path)), job((name, path), TP2)
    if patches is not None:
        one, two = (dataclasses.replace(j, weight_patches=patches) for j in (one, two))
    serial, result = client1.run(one), client2.run(two)
    assert rel_err(result.latent, serial.latent) <= EXACT_RTOL
    assert max(s["param_bytes"] for s in result.stats) <= PARAMS_PER_RANK * serial.stats[0]["param_bytes"]


def test_fp8_scaled_file_under_tp2(folder, client1, client2):
    """Each rank keeps its rows (columns) of every fp8 weight with the layer's per-tensor scale."""
    path, _ = fp8_twins(folder, "kontext", torch.float8_e4m3fn, scaled=True)
    assert_tp2_equals_serial(client1, client2, "kontext", path)


def test_gguf_file_under_tp2(folder, client1, client2):
    """PixArt's GGUF: Q8_0/Q4_x/Q5_x and BF16 MLP weights (a row-wise cut at column 288 falls on a 32-value block
    boundary), F16 attention weights: each rank reads its rows' blocks, or its whole blocks of each row."""
    path, _ = gguf_twins(folder, "pixart")
    assert_tp2_equals_serial(client1, client2, "pixart", path)


def test_gguf_cut_inside_a_block_is_refused_in_one_sentence(folder, client2):
    """Kontext's 256-wide MLP down projection is one Q4_K block of 256 values per row: tp2 would cut it at 128."""
    path, _ = gguf_twins(folder, "kontext")
    with pytest.raises(ConfigError, match=r"tensor parallelism would cut .* at column 128, inside one of its Q\d_K "
                                          r"blocks of 256 values; pick a lower tensor_degree"):
        client2.run(job(("kontext", path), TP2))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_convrot", "mxfp8", "nvfp4"])
def test_comfy_quant_file_under_tp2(folder, client1, client2, fmt):
    """Rows of every layout; a row-wise rank's columns as whole blocks (nvfp4's 16, mxfp8's 32 with their
    swizzled block scales re-cut, ConvRot's groups of 16); per-row int8 scales with their rows."""
    path, _ = comfy_quant_twins(folder, "kontext", fmt)
    assert_tp2_equals_serial(client1, client2, "kontext", path)


# -- LoRA ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "gguf", "nvfp4"])
def test_lora_under_tp2_equals_lora_serial(folder, client1, client2, kind):
    """Two stacked LoRAs (fused q/k/v patched part by part, a bias diff): baked into an fp32 file's slices from the
    whole patched tensor; added per call to a GGUF's and a ComfyUI nvfp4 file's slices (each rank adds its part
    of what the patches add, never holding a patched weight)."""
    name = "pixart" if kind == "gguf" else "kontext"
    if kind == "fp32":
        path = write_checkpoint(str(folder / "lora-base.safetensors"), FAMILIES[name], seed=11)
    elif kind == "gguf":
        path, _ = gguf_twins(folder, name)
    else:
        path, _ = comfy_quant_twins(folder, name, "nvfp4")
    patches, _ = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    plain = client1.run(job((name, path))).latent
    assert_tp2_equals_serial(client1, client2, name, path, patches)
    assert rel_err(client1.run(dataclasses.replace(job((name, path)), weight_patches=patches)).latent, plain) > 1e-2


# -- refusals -------------------------------------------------------------------------------------------------------


def test_degrees_that_do_not_divide_heads_or_mlp_are_refused_before_work(folder, flux):
    from parallel_runtime.runtime.client import RuntimeClient

    path, _ = flux
    wan = write_checkpoint(str(folder / "wan-odd-mlp.safetensors"), WanConfig(hidden_size=256, num_layers=1,
                                                                             ffn_dim=513, text_dim=64), seed=1)
    client3 = RuntimeClient("cpu:3", threads_per_worker=1)
    client2 = RuntimeClient("cpu:2", threads_per_worker=1)
    try:
        with pytest.raises(ConfigError, match=r"^tensor_degree=3 does not divide the model's 4 attention heads; "
                                              r"pick a divisor of 4 \(1, 2, 4\)\.$"):
            client3.run(make_job(path, S(tensor_degree=3)))
        from test_wan import call_job

        with pytest.raises(ConfigError, match=r"^tensor_degree=2 does not divide the model's MLP width of 513; "):
            client2.run(call_job(wan, TP2))
        assert not client2.procs and not client3.procs  # refused before any worker started
    finally:
        client3.shutdown()
        client2.shutdown()
