"""fp8 checkpoints kept in fp8 on every rank: plain e4m3fn/e5m2 files, ComfyUI's scaled-fp8 files, and
Load Parallel DiT's fp8 weight_dtype (a bf16/fp32 file cast at load).

Each is checked against an fp32 file holding the same values (the fp8 numbers upcast, times their scale):
a rank upcasts each fp8 weight to the compute dtype when its layer runs, so the latents are equal. ComfyUI's
UNETLoader on the same fp8 files: tests/test_comfyui_integration.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rel_err
from test_families import FAMILIES, assert_two_workers_equal_one, job
from test_weight_patches import assert_lora_on_file, lora_stack, merged_file, stacked
from parallel_runtime.errors import ModelFileError
from parallel_runtime.bench.storage import analytic_rank_bytes
from parallel_runtime.weights.storage import FP8_DTYPES
from parallel_runtime.weights.patches import stochastic_round, string_to_seed
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import ModelSpec
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
# Both sides compute in fp32 from the same fp8 numbers: only a scaled layer's multiply moves (weight * scale on
# the fly vs stored pre-multiplied: one fp32 rounding, ~1e-7). A weight read unscaled or cast twice is off by
# 1e-2 or more.
FP8_RTOL = 1e-5
EXACT_RTOL = 1e-4  # exact strategies at 2 workers vs 1 (tests/test_families.py)
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]


def is_linear_weight(key: str, tensor: torch.Tensor) -> bool:
    return key.endswith(".weight") and tensor.ndim == 2


def fp8_twins(folder, name: str, fp8: torch.dtype, scaled: bool, config=None) -> tuple[str, str]:
    """An fp8 file (matrices in `fp8`, the rest fp32; with `scaled`, ComfyUI's layout: matrix / scale stored,
    `scale_weight` per layer and the `scaled_fp8` marker) and its fp32 twin holding the values it means. ComfyUI
    builds a scaled-fp8 model's linear layers in fp8, so their biases are rounded to fp8 too."""
    base = load_file(write_checkpoint(str(folder / f"{name}-base.safetensors"), config or FAMILIES[name], seed=11,
                                      prefix=PREFIX))
    g = torch.Generator().manual_seed(4)
    quant, meant = {}, {}
    for key, t in base.items():
        if not is_linear_weight(key, t):
            linear_bias = key.endswith(".bias") and is_linear_weight(key[:-4] + "weight", base.get(key[:-4] + "weight",
                                                                                               torch.empty(0)))
            quant[key] = t
            meant[key] = t.to(fp8).float() if scaled and linear_bias else t
            continue
        scale = torch.rand((), generator=g) * 0.5 + 0.75 if scaled else None
        q = (t / scale if scaled else t).to(fp8)
        quant[key] = q
        meant[key] = q.float() * scale if scaled else q.float()
        if scaled:
            quant[key[:-len("weight")] + "scale_weight"] = scale.reshape(())
    if scaled:
        quant[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=fp8)
    tag = f"{name}-{str(fp8).split('_')[-1]}{'-scaled' if scaled else ''}"
    save_file(quant, str(folder / f"{tag}.safetensors"))
    save_file(meant, str(folder / f"{tag}-fp32.safetensors"))
    return str(folder / f"{tag}.safetensors"), str(folder / f"{tag}-fp32.safetensors")


def analytic_bytes(path: str, weight_dtype: str = "default", stage: int = 0, stages: int = 1) -> int:
    """Bytes a rank of PipeFusion-`stages` holds: its parameters, linear weights at 1 byte if kept in fp8 (and
    a 4-byte scale beside each in a scaled-fp8 file), the rest at 4 (fp32 compute on CPU)."""
    return analytic_rank_bytes(path, weight_dtype, stage, stages)


@pytest.fixture(scope="module", params=NAMES)
def family_files(request, tmp_path_factory):
    return request.param, tmp_path_factory.mktemp(request.param)


@pytest.mark.parametrize("fp8,scaled", [(FP8_DTYPES[0], False), (FP8_DTYPES[1], False), (FP8_DTYPES[0], True)],
                         ids=["e4m3fn", "e5m2", "e4m3fn-scaled"])
def test_fp8_file_equals_its_fp32_twin_and_stays_fp8(client1, family_files, fp8, scaled):
    name, folder = family_files
    quant, meant = fp8_twins(folder, name, fp8, scaled)
    got, ref = client1.run(job((name, quant))), client1.run(job((name, meant)))
    assert rel_err(got.latent, ref.latent) <= FP8_RTOL
    held = got.stats[0]["param_bytes"]
    assert held == analytic_bytes(quant)  # every linear weight 1 byte, exactly
    assert held < 0.4 * ref.stats[0]["param_bytes"]


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
                                      S(pipefusion_degree=2, warmup_steps=6)], ids=lambda s: s.label())
def test_fp8_exact_strategies_at_two_workers_equal_one(client1, family_files, client2, strategy):
    name, folder = family_files
    quant, _ = fp8_twins(folder, name, FP8_DTYPES[0], True)
    assert_two_workers_equal_one(client1, client2, name, quant, strategy,
                                 lambda p, r, n: analytic_bytes(p, "default", r, n))


def test_fp8_weight_dtype_casts_a_full_precision_file_at_load(client1, tmp_path):
    """weight_dtype fp8_e4m3fn, as UNETLoader's: every linear weight stored in fp8, every other tensor rounded
    through fp8 as ComfyUI's fp8-typed layers store it, all computed in fp32."""
    name = "kontext"
    base_path = write_checkpoint(str(tmp_path / "base.safetensors"), FAMILIES[name], seed=11, prefix=PREFIX)
    rounded = {k: t.to(FP8_DTYPES[0]).float() for k, t in load_file(base_path).items()}
    save_file(rounded, str(tmp_path / "rounded.safetensors"))
    cast = client1.run(dataclasses.replace(job((name, base_path)),
                                          model=ModelSpec(base_path, weight_dtype="fp8_e4m3fn")))
    ref = client1.run(job((name, str(tmp_path / "rounded.safetensors"))))
    plain = client1.run(job((name, base_path)))
    assert rel_err(cast.latent, ref.latent) <= FP8_RTOL
    assert rel_err(cast.latent, plain.latent) > 1e-3  # the cast really happened
    assert cast.stats[0]["param_bytes"] == analytic_bytes(base_path, "fp8_e4m3fn")


def test_fp8_stochastic_round_lands_on_a_neighbour_unbiased_and_seeded():
    """ComfyUI's rounding of a patched fp8 weight: each value goes to one of its two fp8 neighbours, with the
    probability that makes the mean exact, from a generator seeded by the tensor's name (identical to ComfyUI's
    comfy.float.stochastic_rounding: tests/test_comfyui_integration.py compares the LoRA'd images)."""
    # ComfyUI's string_to_seed is the bitwise CRC-32 (init and final xor 0xFFFFFFFF, polynomial 0xEDB88320):
    assert string_to_seed("x") == 0x8CDC1683 and string_to_seed("123456789") == 0xCBF43926  # the CRC-32 check value
    value = torch.full((256, 512), 0.3)
    for fp8 in FP8_DTYPES:
        got = stochastic_round(value, fp8, seed=7)
        grid = sorted({float(v) for v in got.float().unique()})
        below = value.to(fp8).float()[0, 0].item()
        assert len(grid) == 2 and grid[0] <= 0.3 <= grid[1] and below in grid
        assert abs(got.float().mean().item() - 0.3) < 2e-3 * 0.3 * 8  # unbiased: 131k draws
        assert torch.equal(got.view(torch.uint8), stochastic_round(value, fp8, seed=7).view(torch.uint8))
        assert not torch.equal(got.view(torch.uint8), stochastic_round(value, fp8, seed=8).view(torch.uint8))
    x = torch.randn(64, 96) * 3
    err = (stochastic_round(x, FP8_DTYPES[0], 1).float() - x).abs()
    assert (err <= x.abs() / 8 + 2 ** -9).all()  # within one e4m3 step (3 mantissa bits; subnormal step 2^-9)


def baked_fp8_file(quant: str, path: str, deltas: list[dict]) -> str:
    """`quant` with each patched tensor baked back as ComfyUI bakes a LoRA into an fp8 model: the whole tensor
    upcast (times its scale), every delta added in float32, then stochastically rounded (divided by the scale)
    with the seed of its ComfyUI name. Tensors ComfyUI keeps in higher precision just add the deltas."""
    sd = load_file(quant)
    scaled = PREFIX + "scaled_fp8" in sd
    for stack_keys in {k for stack in deltas for k in stack}:
        key = PREFIX + stack_keys
        scale_key = key[: -len("weight")] + "scale_weight" if key.endswith(".weight") else None
        scale = sd.get(scale_key) if scale_key else None
        stored = sd[key]
        fp8 = stored.dtype if stored.dtype in FP8_DTYPES else (FP8_DTYPES[0] if scaled and key.endswith(".bias") else None)
        w = stored.to(fp8).float() if fp8 is not None else stored.float()
        w = w * scale if scale is not None else w
        for stack in deltas:
            for offset, delta in stack.get(stack_keys, ()):
                (w.narrow(*offset) if offset is not None else w).add_(delta)
        if fp8 is None:
            sd[key] = w
            continue
        rounded = stochastic_round(w / scale if scale is not None else w, fp8, string_to_seed("diffusion_model." + stack_keys))
        sd[key] = rounded if stored.dtype in FP8_DTYPES else rounded.float()
    save_file(sd, path)
    return path


@pytest.mark.parametrize("scaled", [False, True], ids=["e4m3fn", "e4m3fn-scaled"])
def test_fp8_lora_lands_as_comfyui_lands_it(client1, tmp_path, client2, scaled):
    """A LoRA on an fp8 model, the rank still holding fp8. ComfyUI holds a scaled-fp8 model in fp8, so each patched
    tensor is rebuilt whole, patched in float32 and baked back with ComfyUI's seeded stochastic rounding: equal to
    a file holding those baked fp8 numbers. A plain fp8 file ComfyUI upcasts at load on a device without fp8
    compute (this CPU) and patches in float32: the rank adds the patch per call to its upcast fp8 weight, equal to
    the merged fp32 twin. At one worker and under Ulysses and PipeFusion at two (each stage patches its blocks)."""
    name = "kontext"
    quant, twin = fp8_twins(tmp_path, name, FP8_DTYPES[0], scaled)
    patches, deltas = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    expected = (baked_fp8_file(quant, str(tmp_path / "baked.safetensors"), deltas) if scaled else
                merged_file(twin, str(tmp_path / "merged.safetensors"), deltas))
    assert_lora_on_file(client1, client2, name, quant, expected, patches, FP8_RTOL)


def test_a_truncated_fp8_file_fails_in_one_sentence_and_the_next_job_runs(client1, tmp_path):
    name = "kontext"
    quant, meant = fp8_twins(tmp_path, name, FP8_DTYPES[0], True)
    data = open(quant, "rb").read()
    bad = tmp_path / "truncated-fp8.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated-fp8.safetensors is not a valid safetensors file"):
        client1.run(job((name, str(bad))))
    assert client1.run(job((name, meant))).latent.abs().sum() > 0


def test_fp8_scaled_file_multiplies_in_fp8_where_comfyui_does(tmp_path):
    """ComfyUI reads a scaled-fp8 file as float8_e4m3fn quantized layers, so where the device has the fp8 kernel
    (or under quantized_matmul "kernel") a layer with a `scale_weight` quantizes its input (at the file's
    `scale_input`, else 1, as ComfyUI's fp8 layout) and multiplies in fp8: exactly comfy-kitchen's F.linear on
    the same tensors (same arithmetic, 1e-6). A layer without `scale_weight`, a plain fp8 file and a
    full-precision marker (2 elements) keep dequantize-then-matmul, as in ComfyUI."""
    ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
    from parallel_runtime.weights.checkpoint import open_checkpoint
    from parallel_runtime.weights.keymap import Source
    from parallel_runtime.weights.mapping import read_stored
    from parallel_runtime.weights.storage import Storage

    torch.manual_seed(5)
    w, b, x = torch.randn(48, 64), torch.randn(48), torch.randn(3, 5, 64)
    scale, q = torch.tensor(0.01), (w / 0.01).to(torch.float8_e4m3fn)
    qt = ck_tensor.QuantizedTensor(q, "TensorCoreFP8Layout", ck_tensor.TensorCoreFP8Layout.Params(
        scale=scale, orig_dtype=torch.float32, orig_shape=(48, 64)))
    storage = Storage(torch.float32, kernel_formats=frozenset({"float8_e4m3fn"}))

    def layer(marker, unscaled=False, **extra):
        sd = {"l.weight": q, "l.bias": b, **({} if unscaled else {"l.scale_weight": scale}), **extra}
        if marker is not None:
            sd["scaled_fp8"] = marker
        path = str(tmp_path / f"f{len(list(tmp_path.iterdir()))}.safetensors")
        save_file(sd, path)
        with open_checkpoint(path) as reader:
            st = storage.for_file(reader)
            return read_stored(reader, Source("l.weight"), st, "cpu", "weight").linear(b, st)

    def comfy(input_scale):
        rows = ck_tensor.QuantizedTensor.from_float(x.reshape(-1, 64), "TensorCoreFP8Layout", scale=input_scale)
        return torch.nn.functional.linear(rows, qt, b).reshape(3, 5, 48)

    marker = torch.empty(0, dtype=torch.float8_e4m3fn)
    static = layer(marker, **{"l.scale_input": torch.tensor(0.05)})
    assert static.kernel and rel_err(static(x), comfy(torch.tensor(0.05))) <= 1e-6
    unit = layer(marker, **{"l.scale_input": torch.tensor(1.0)})
    assert unit.kernel and rel_err(unit(x), comfy(torch.ones(()))) <= 1e-6
    assert rel_err(unit(x), comfy(torch.tensor(0.05))) > 1e-4  # the two input scales really differ
    for plain in (layer(None), layer(torch.zeros(2, dtype=torch.float8_e4m3fn))):
        assert not plain.kernel
        assert rel_err(plain(x), torch.nn.functional.linear(x, q.float() * scale, b)) <= 1e-6
    assert not layer(marker, unscaled=True).kernel


def test_fp8_scaled_file_kernel_path_at_two_workers(client1, tmp_path, client2):
    """quantized_matmul "kernel" on a scaled-fp8 model: the fp8 input quantization moves the result from
    dequantize-then-matmul (measured 3.9e-2 after 6 steps on this tiny random model), and Ulysses-2 agrees with
    one worker to that noise (2.5e-2: round-off flips fp8 roundings of the inputs), not to round-off."""
    pytest.importorskip("comfy_kitchen.tensor")
    name = "kontext"
    quant, _ = fp8_twins(tmp_path, name, torch.float8_e4m3fn, scaled=True)

    def run(client, mode, strategy=None):
        j = job((name, quant), strategy)
        return client.run(dataclasses.replace(j, model=ModelSpec(quant, quantized_matmul=mode))).latent

    kernel, plain = run(client1, "kernel"), run(client1, "dequantize")
    assert 1e-4 < rel_err(kernel, plain) <= 0.1  # ~3x the fp8 input noise; a broken fp8 matmul is off by O(1)
    assert rel_err(run(client2, "kernel", S(ulysses_degree=2)), kernel) <= 0.1


def test_one_storage_rule_serves_the_workers_and_the_memory_estimate(tiny_path):
    """Storage.for_weight_dtype is the rule the workers store by; the memory estimate asks it per tensor kind, so
    the two cannot drift apart (an fp8 weight_dtype: 1 byte per weight; bf16/fp32: the compute size)."""
    from parallel_runtime.validate import stored_bytes_per_parameter
    from parallel_runtime.weights.storage import Storage

    cast = Storage.for_weight_dtype("fp8_e4m3fn", torch.float32)
    assert cast.cast_fp8 == torch.float8_e4m3fn and cast.keep_quantized
    assert Storage.for_weight_dtype("fp8_e5m2", torch.float32).cast_fp8 == torch.float8_e5m2
    default, upcast = Storage.for_weight_dtype("default", torch.float32), Storage.for_weight_dtype("bf16", torch.bfloat16)
    assert default.keep_quantized and default.cast_fp8 is None and not upcast.keep_quantized
    assert default.linear_dtype(torch.float8_e4m3fn) == torch.float8_e4m3fn and upcast.linear_dtype(torch.float8_e4m3fn) is None
    assert stored_bytes_per_parameter(tiny_path, "fp8_e4m3fn", 4) == 1.0  # the fp32 tiny file, cast at load
    assert stored_bytes_per_parameter(tiny_path, "default", 4) == 4.0
    assert stored_bytes_per_parameter(tiny_path, "bf16", 2) == 2.0
