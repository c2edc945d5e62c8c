"""Comfy-Org's quantized checkpoints (comfy_quant layers: fp8, int8 with and without ConvRot, mxfp8, nvfp4) kept
quantized on every rank.

Each file is written here with comfy-kitchen's own layout classes (quantize, then the layout's state-dict tensors
under ComfyUI's names, a `.comfy_quant` JSON tensor per layer or the header's `_quantization_metadata`), mixed:
some layers stay bf16. Its fp32 twin holds the values comfy-kitchen dequantizes them to, which is what ComfyUI
computes with on a CPU (dequantize, then F.linear).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")

from conftest import rel_err  # noqa: E402
from test_families import FAMILIES, assert_two_workers_equal_one, job  # noqa: E402
from test_gguf import merged_twin  # noqa: E402
from test_weight_patches import assert_lora_on_file, lora_stack, stacked  # noqa: E402
from parallel_runtime.errors import ModelFileError  # noqa: E402
from parallel_runtime.bench.storage import analytic_rank_bytes  # noqa: E402
from parallel_runtime.weights.checkpoint import open_checkpoint  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from parallel_runtime.spec import ModelSpec  # noqa: E402
from parallel_runtime.spec import StrategySpec as S  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# Both sides compute in fp32 from the same numbers (comfy-kitchen's dequantization, per layer on the rank):
# ~1e-7. A misplaced block scale or row is off by O(1e-1).
QUANT_RTOL = 1e-5
EXACT_RTOL = 1e-4  # exact strategies at 2 workers vs 1 (tests/test_families.py)
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]
# comfy_quant format -> (comfy-kitchen layout, its options, rows/cols the layer must be whole multiples of)
FORMATS = {
    "float8_e4m3fn": ("TensorCoreFP8Layout", {}, 1),
    "int8_tensorwise": ("TensorWiseINT8Layout", {}, 1),
    # Groups of 16 (a power of 4, as ConvRot needs) divide every tiny width, PixArt's 144 too.
    "int8_convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 16}, 16),
    "mxfp8": ("TensorCoreMXFP8Layout", {}, 32),
    "nvfp4": ("TensorCoreNVFP4Layout", {}, 16),
}


def comfy_quant_twins(folder, name: str, fmt: str, header: bool = False, config=None) -> tuple[str, str]:
    """A mixed ComfyUI quantized file of a tiny `name` model (every linear weight that fits the format's blocks
    in `fmt`, except every third one, which stays bf16) and its fp32 twin. `header`: the layers are listed in
    the safetensors header instead of `.comfy_quant` tensors."""
    base = load_file(write_checkpoint(str(folder / f"{name}-base.safetensors"), config or FAMILIES[name], seed=11))
    layout, options, multiple = FORMATS[fmt]
    quant, meant, layers, n = {}, {}, {}, 0
    for key, t in base.items():
        fits = key.endswith(".weight") and t.ndim == 2 and t.shape[0] % multiple == 0 and t.shape[1] % multiple == 0
        if not fits or n % 3 == 2:
            n += fits
            quant[key] = t.to(torch.bfloat16) if t.ndim == 2 else t
            meant[key] = quant[key].float()
            continue
        n += 1
        qt = ck_tensor.QuantizedTensor.from_float(t, layout, **options)
        quant.update(qt.state_dict(key))
        meant[key] = qt.dequantize().float()
        conf = {"format": fmt.split("_convrot")[0] if fmt == "int8_convrot" else fmt}
        if fmt == "int8_convrot":
            conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": options["convrot_groupsize"]}
        layers[key[: -len(".weight")]] = conf
        if not header:
            quant[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    tag = f"{name}-{fmt}{'-header' if header else ''}"
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if header else None
    save_file(quant, str(folder / f"{tag}.safetensors"), metadata=metadata)
    save_file(meant, str(folder / f"{tag}-fp32.safetensors"))
    return str(folder / f"{tag}.safetensors"), str(folder / f"{tag}-fp32.safetensors")


def analytic_bytes(path: str, stage: int = 0, stages: int = 1) -> int:
    """Bytes a rank of PipeFusion-`stages` holds: each quantized weight's data and scales for its rows (as
    stored), everything else in fp32 (CPU compute)."""
    return analytic_rank_bytes(path, "default", stage, stages)


# Tiny PixArt (144 wide) has no layer of whole 32-row mxfp8 blocks; the released one (1152) has.
CASES = [pytest.param(name, fmt, id=f"{name}-comfy_quant-{fmt}") for name in NAMES for fmt in FORMATS
         if (name, fmt) != ("pixart", "mxfp8")]


@pytest.mark.parametrize("name,fmt", CASES)
def test_comfy_quant_file_equals_its_fp32_twin_and_stays_quantized(client1, tmp_path, name, fmt):
    quant, meant = comfy_quant_twins(tmp_path, name, fmt)
    with open_checkpoint(quant) as reader:
        assert {c["format"] for c in reader.quant_layers().values()} == {fmt.replace("_convrot", "_tensorwise")}
    got, ref = client1.run(job((name, quant))), client1.run(job((name, meant)))
    assert torch.isfinite(ref.latent).all()
    assert rel_err(got.latent, ref.latent) <= QUANT_RTOL
    held = got.stats[0]["param_bytes"]
    assert abs(held / analytic_bytes(quant) - 1) <= 0.05
    assert held < ref.stats[0]["param_bytes"]


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f"comfy_quant-{f}")
def test_comfy_quant_ulysses_and_pipefusion_at_two_workers_equal_one(client1, tmp_path, client2, fmt):
    name = "kontext"
    quant, _ = comfy_quant_twins(tmp_path, name, fmt)
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, warmup_steps=6)):
        assert_two_workers_equal_one(client1, client2, name, quant, strategy, analytic_bytes)


def test_comfy_quant_header_spelling_equals_per_layer_spelling_nvfp4(client1, tmp_path):
    name = "qwen_image"
    per_layer, _ = comfy_quant_twins(tmp_path, name, "nvfp4")
    header, _ = comfy_quant_twins(tmp_path, name, "nvfp4", header=True)
    a, b = client1.run(job((name, per_layer))), client1.run(job((name, header)))
    assert torch.equal(a.latent, b.latent)
    assert a.stats[0]["param_bytes"] == b.stats[0]["param_bytes"]


def test_comfy_quant_unsupported_format_fails_in_one_sentence(client1, tmp_path):
    name = "kontext"
    quant, meant = comfy_quant_twins(tmp_path, name, "nvfp4")
    sd = load_file(quant)
    layer = next(k[: -len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant"))
    sd[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "awq_w4a16"}'), dtype=torch.uint8)
    odd = str(tmp_path / "awq.safetensors")
    save_file(sd, odd)
    with pytest.raises(ModelFileError, match=f"awq.safetensors: layer '{layer}' is stored as 'awq_w4a16'") as info:
        client1.run(job((name, odd)))
    assert "\n" not in str(info.value)
    assert torch.isfinite(client1.run(job((name, meant))).latent).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_convrot"], ids=lambda f: f"comfy_quant-{f}")
def test_comfy_quant_lora_is_added_per_call_and_equals_the_merged_twin(client1, tmp_path, client2, fmt):
    """A LoRA stack on quantized layers: each layer dequantizes its rows, adds the patches in float32 and casts
    back when it runs (ComfyUI's dynamic-VRAM path), so the result is the fp32 twin with the deltas merged, at one
    worker and under Ulysses and PipeFusion at two, and the rank still holds only the quantized rows."""
    name = "kontext"
    quant, twin = comfy_quant_twins(tmp_path, name, fmt)
    patches, deltas = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    merged = merged_twin(twin, str(tmp_path / "merged.safetensors"), deltas)
    assert_lora_on_file(client1, client2, name, quant, merged, patches, QUANT_RTOL)


def test_comfy_quant_pre_quant_scale_multiplies_the_input_nvfp4(client1, tmp_path):
    """An AWQ-style layer (`pre_quant_scale` per input channel): the weight was quantized as W / s, the input is
    multiplied by s, so the layer means dequant(W / s) * s; the fp32 twin holds that product."""
    name = "kontext"
    quant, twin = comfy_quant_twins(tmp_path, name, "nvfp4")
    sd, meant = load_file(quant), load_file(twin)
    key = next(k[: -len("comfy_quant")] + "weight" for k in sd if k.endswith(".comfy_quant"))
    w = load_file(str(tmp_path / f"{name}-base.safetensors"))[key]
    s = torch.linspace(0.5, 2.0, w.shape[1])
    qt = ck_tensor.QuantizedTensor.from_float(w / s, "TensorCoreNVFP4Layout")
    sd.update(qt.state_dict(key))
    sd[key[: -len("weight")] + "pre_quant_scale"] = s.to(torch.bfloat16)
    meant[key] = qt.dequantize().float() * s.to(torch.bfloat16).float()
    save_file(sd, str(tmp_path / "awq-style.safetensors"))
    save_file(meant, str(tmp_path / "awq-style-fp32.safetensors"))
    got = client1.run(job((name, str(tmp_path / "awq-style.safetensors")))).latent
    ref = client1.run(job((name, str(tmp_path / "awq-style-fp32.safetensors")))).latent
    assert rel_err(got, ref) <= QUANT_RTOL


def test_comfy_quant_without_comfy_kitchen_is_one_sentence(tmp_path, monkeypatch):
    import sys

    quant, _ = comfy_quant_twins(tmp_path, "kontext", "nvfp4")
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # as if no wheel installed for this platform
    monkeypatch.setitem(sys.modules, "comfy_kitchen.tensor", None)
    with open_checkpoint(quant) as reader:
        key = next(iter(reader.quant_layers())) + ".weight"
        with pytest.raises(ModelFileError, match="needs the comfy-kitchen package .*pip install packaging comfy-kitchen"):
            reader.read(key)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_convrot"], ids=lambda f: f"comfy_quant-{f}")
def test_comfy_quant_under_weight_dtype_fp8_casts_the_dequantized_weights(client1, tmp_path, fmt):
    """weight_dtype fp8_e4m3fn on a quantized file: its layers dequantize to float32 at load and are cast to fp8
    like any full-precision file's (the same numbers as the fp32 twin under that setting), 1 byte per weight."""
    name = "kontext"
    quant, twin = comfy_quant_twins(tmp_path, name, fmt)
    runs = [client1.run(dataclasses.replace(job((name, path)), model=ModelSpec(path, weight_dtype="fp8_e4m3fn")))
            for path in (quant, twin)]
    assert rel_err(runs[0].latent, runs[1].latent) <= QUANT_RTOL
    assert runs[0].stats[0]["param_bytes"] == runs[1].stats[0]["param_bytes"]


# -- comfy-kitchen's quantized matmul (ComfyUI's path on GPUs with the kernels) ---------------------------------

def _one_layer_file(folder, fmt: str, w: torch.Tensor, b: torch.Tensor, **extra) -> tuple[str, object]:
    """A file holding one quantized linear layer `l` (and its bias); returns it and the whole QuantizedTensor."""
    layout, options, _ = FORMATS[fmt]
    qt = ck_tensor.QuantizedTensor.from_float(w, layout, **options)
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16} if fmt == "int8_convrot" \
        else {"format": fmt}
    conf.update(extra.pop("conf", {}))
    sd = dict(qt.state_dict("l.weight"), **{"l.bias": b}, **{f"l.{k}": v for k, v in extra.items()})
    sd["l.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    path = str(folder / f"layer-{fmt}.safetensors")
    save_file(sd, path)
    return path, qt


KERNEL_FORMATS = ["float8_e4m3fn", "int8_tensorwise", "int8_convrot", "nvfp4"]  # comfy-kitchen has no CPU mxfp8 mm


def scaled_mm_with_cudas_shape_rule(monkeypatch) -> list[tuple[int, int]]:
    """comfy-kitchen's fp8 matmul made to refuse what torch._scaled_mm refuses on CUDA, an fp8 weight with a
    dimension 16 does not divide (an H200 raised "mat2 shape (1024x200) must be divisible by 16" for a rank's 200
    rows), so the CPU shows what a GPU would raise. Returns the weight shapes it multiplied."""
    fp8 = pytest.importorskip("comfy_kitchen.tensor.fp8")
    real, seen = fp8._fp8_scaled_mm, []

    def checked(a, b, *args, **kwargs):
        if b.shape[0] % 16 or b.shape[1] % 16:
            raise ValueError(f"mat2 shape ({b.shape[0]}x{b.shape[1]}) must be divisible by 16")
        seen.append(tuple(b.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(fp8, "_fp8_scaled_mm", checked)
    return seen


@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f"comfy_quant-{f}")
def test_comfy_quant_kernel_layer_rows_equal_comfy_kitchens_linear(tmp_path, fmt, monkeypatch):
    """On the kernel path a rank's rows of a layer give exactly those columns of what ComfyUI computes with the
    whole layer (F.linear on comfy-kitchen's QuantizedTensor: the input quantized to the weight's layout for
    fp8 (at scale 1, ComfyUI's fp8 layout without an input_scale) and nvfp4, int8's per-row kernel), including
    rows that do not fill an nvfp4 block. Same arithmetic on a subset of rows: equal to fp32 round-off (1e-6;
    BLAS may block a different row count differently)."""
    from parallel_runtime.weights.storage import Storage

    torch.manual_seed(0)
    w, b, x = torch.randn(200, 256), torch.randn(200), torch.randn(2, 7, 256)
    path, qt = _one_layer_file(tmp_path, fmt, w, b)
    layout = FORMATS[fmt][0]
    if fmt in ("float8_e4m3fn", "nvfp4"):
        scale = torch.ones(()) if fmt == "float8_e4m3fn" else None
        rows = ck_tensor.QuantizedTensor.from_float(x.reshape(-1, 256), layout, scale=scale)
        whole = torch.nn.functional.linear(rows, qt, b)
        whole = whole.reshape(2, 7, 200)
    else:
        whole = torch.nn.functional.linear(x, qt, b)
    storage = Storage(torch.float32, kernel_formats=frozenset({fmt.replace("_convrot", "_tensorwise")}))
    fp8_matmuls = scaled_mm_with_cudas_shape_rule(monkeypatch)
    with open_checkpoint(path) as reader:
        for rows in (slice(0, 200), slice(48, 112), slice(100, 200)):  # 200 and 100 rows: not multiples of 16
            layer = reader.read_kept("l.weight", rows, None, "cpu").linear(b[rows], storage)
            assert layer.kernel
            assert rel_err(layer(x), whole[..., rows]) <= 1e-6
        # The dequantize path of the same rows: the weight-only arithmetic, off by the input's quantization.
        plain = reader.read_kept("l.weight", slice(0, 200), None, "cpu").linear(b, Storage(torch.float32))
        assert not plain.kernel
        assert rel_err(plain(x), torch.nn.functional.linear(x, qt.dequantize(), b)) <= 1e-6
        assert rel_err(plain(x), whole) > 1e-4
    assert bool(fp8_matmuls) == (fmt == "float8_e4m3fn")  # fp8's kernel ran, on 16-aligned weights only


def test_fp8_kernel_pads_uneven_rows_and_columns_to_what_scaled_mm_takes(monkeypatch):
    """A plain fp8 file's rank shard of 50 rows x 120 input columns (tensor parallelism cuts both) on the kernel
    path: torch gets a 64 x 128 weight, and every kept output is the fp8 arithmetic's own: the input quantized to
    e4m3 at the file's input scale, times the fp8 weight, times both scales, plus the bias (fp32 reference on the
    CPU; only the summation order differs, 1e-6)."""
    from parallel_runtime.weights.fp8 import Fp8Linear

    seen = scaled_mm_with_cudas_shape_rule(monkeypatch)
    torch.manual_seed(2)
    weight, bias = torch.randn(50, 120).to(torch.float8_e4m3fn), torch.randn(50)
    scale, input_scale, x = torch.tensor(0.5), torch.tensor(0.25), torch.randn(3, 5, 120)
    layer = Fp8Linear(weight, bias, scale, input_scale, kernel=True)
    out = layer(x)
    x_fp8 = (x / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * input_scale
    expected = torch.nn.functional.linear(x_fp8, weight.float() * scale, bias)
    assert seen == [(128, 64)] and out.shape == (3, 5, 50)  # the weight reaches torch transposed: K x N
    assert rel_err(out, expected) <= 1e-6


def test_comfy_quant_kernel_uses_the_files_input_scale_and_full_precision_flag(tmp_path):
    """A stored `input_scale` quantizes the input (as ComfyUI passes it to from_float), else scale 1 (ComfyUI's
    fp8 layout); a layer marked `full_precision_matrix_mult` never takes the kernel."""
    from parallel_runtime.weights.storage import Storage

    torch.manual_seed(1)
    w, b, x = torch.randn(64, 128), torch.randn(64), torch.randn(9, 128)
    scale = torch.tensor(0.02)
    path, qt = _one_layer_file(tmp_path, "float8_e4m3fn", w, b, input_scale=scale)
    static = torch.nn.functional.linear(
        ck_tensor.QuantizedTensor.from_float(x, "TensorCoreFP8Layout", scale=scale), qt, b)
    unit = torch.nn.functional.linear(
        ck_tensor.QuantizedTensor.from_float(x, "TensorCoreFP8Layout", scale=torch.ones(())), qt, b)
    storage = Storage(torch.float32, kernel_formats=frozenset({"float8_e4m3fn"}))
    with open_checkpoint(path) as reader:
        got = reader.read_kept("l.weight", None, None, "cpu").linear(b, storage)(x)
    assert rel_err(got, static) <= 1e-6 < rel_err(got, unit)
    plain, _ = _one_layer_file(tmp_path, "float8_e4m3fn", w, b)
    with open_checkpoint(plain) as reader:
        assert rel_err(reader.read_kept("l.weight", None, None, "cpu").linear(b, storage)(x), unit) <= 1e-6
    flagged, _ = _one_layer_file(tmp_path, "nvfp4", w, b, conf={"full_precision_matrix_mult": True})
    with open_checkpoint(flagged) as reader:
        layer = reader.read_kept("l.weight", None, None, "cpu").linear(b, Storage(torch.float32,
                                                                                  kernel_formats=frozenset({"nvfp4"})))
        assert not layer.kernel
        assert rel_err(layer(x), torch.nn.functional.linear(x, layer.dequantized(torch.float32), b)) <= 1e-6


def test_comfy_quant_pre_quant_scale_and_lora_as_comfyui_nvfp4(tmp_path):
    """ComfyUI multiplies the input by `pre_quant_scale` and patches the stored weight: (x * s) @ (W + dW)^T + b."""
    from parallel_runtime.weights.storage import Storage

    torch.manual_seed(2)
    w, b, x, s = torch.randn(32, 64), torch.randn(32), torch.randn(5, 64), torch.linspace(0.5, 2.0, 64)
    delta = 0.01 * torch.randn(32, 64)
    path, qt = _one_layer_file(tmp_path, "nvfp4", w / s, b, pre_quant_scale=s)
    with open_checkpoint(path) as reader:
        layer = reader.read_kept("l.weight", None, None, "cpu").linear(b, Storage(torch.float32))
        assert rel_err(reader.read("l.weight"), qt.dequantize() * s) <= 1e-6  # a full-precision load folds it
    layer.patch = lambda lay, dtype: lay.dequantized(dtype) + delta
    want = torch.nn.functional.linear(x * s, qt.dequantize() + delta, b)
    assert rel_err(layer(x), want) <= 1e-6


def test_comfy_quant_kernel_formats_follow_comfyuis_device_rule(monkeypatch):
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.weights.comfy_quant import LAYOUTS, kernel_formats

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_formats(cpu) == frozenset()  # ComfyUI disables every quantized matmul on a CPU
    # comfy-kitchen's eager CPU matmuls; none for mxfp8, and e5m2 inputs never reach _scaled_mm in ComfyUI
    assert kernel_formats(cpu, "kernel") == frozenset(LAYOUTS) - {"mxfp8", "float8_e5m2"}
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    fp8 = {"float8_e4m3fn"}
    for capability, want in [((8, 0), {"int8_tensorwise"}),  # A100: int8 only
                             ((8, 9), {"int8_tensorwise", *fp8}),  # RTX 40 / L40S
                             ((9, 0), {"int8_tensorwise", *fp8}),  # H100: nvfp4/mxfp8 need Blackwell
                             ((10, 0), set(LAYOUTS) - {"float8_e5m2"})]:  # B200 (torch 2.13 >= 2.10: mxfp8)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernel_formats(cuda) == want == kernel_formats(cuda, "kernel"), capability  # a GPU: kernel = auto
        assert kernel_formats(cuda, "dequantize") == frozenset()
    with pytest.raises(ConfigError, match="quantized_matmul 'fast' is unknown; choose one of auto, dequantize"):
        kernel_formats(cpu, "fast")


def _matmul_job(name: str, path: str, mode: str, strategy=None, steps: int = 6):
    return dataclasses.replace(job((name, path), strategy, steps=steps), model=ModelSpec(path, quantized_matmul=mode))


def _one_worker_latents(client1, name: str, path: str, modes: tuple[str, ...], steps: int = 6) -> list[torch.Tensor]:
    """The latent of `path` at one worker under each quantized_matmul mode."""
    return [client1.run(_matmul_job(name, path, mode, steps=steps)).latent for mode in modes]


def test_comfy_quant_kernel_path_runs_on_every_rank_int8_convrot(client1, tmp_path, client2):
    """quantized_matmul "kernel" on int8_convrot (comfy-kitchen's eager int8 linear: W8A8, inputs quantized per
    row). It differs from dequantize-then-matmul by the input's quantization (measured 6.5e-3 after 6 steps),
    so it runs; under PipeFusion (synchronous steps here) it equals one worker exactly. Ulysses and CFG parallel
    change fp32 round-off, which flips some int8 roundings of the inputs: they agree with one worker to that
    noise (measured 7.2e-3 / 6.7e-3), not to round-off; "dequantize" keeps them exact (the tests above)."""
    name = "kontext"
    quant, _ = comfy_quant_twins(tmp_path, name, "int8_convrot")
    kernel, plain, auto = _one_worker_latents(client1, name, quant, ("kernel", "dequantize", "auto"))
    assert torch.equal(auto, plain)  # a CPU has no int8 kernel in ComfyUI's rule
    # Bounds: 3x the measured activation-quantization noise; a broken kernel call is off by O(1).
    assert 1e-4 < rel_err(kernel, plain) <= 2e-2
    pipe = client2.run(_matmul_job(name, quant, "kernel", S(pipefusion_degree=2, warmup_steps=6))).latent
    assert rel_err(pipe, kernel) <= EXACT_RTOL
    for strategy in (S(ulysses_degree=2), S(cfg_degree=2)):
        assert rel_err(client2.run(_matmul_job(name, quant, "kernel", strategy)).latent, kernel) <= 2e-2


def test_comfy_quant_kernel_path_nvfp4_quantizes_inputs_like_comfyui(client1, tmp_path, client2):
    """nvfp4 on the kernel path quantizes every input to 4 bits (per 16 values, at one global scale from the amax
    of the whole input), as ComfyUI does on Blackwell: the result moves from dequantize-then-matmul by that
    quantization (measured 0.11 on this tiny random model after 6 steps). Each rank takes that amax over the whole
    forward pass (weights/input_amax.py), so one pass under Ulysses-2 / Ring-2 agrees with one worker but for
    4-bit roundings that the split's fp32 round-off flips (measured 8.0e-3 / 8.2e-3 after one step; 0.16 while each
    rank took its own tokens' amax). Each flip moves a value by up to a third, which this random model amplifies
    from step to step (0.1 after 6 steps whatever the amax), so the split is measured on one step."""
    name = "kontext"
    quant, _ = comfy_quant_twins(tmp_path, name, "nvfp4")
    kernel, plain = _one_worker_latents(client1, name, quant, ("kernel", "dequantize"))
    assert torch.isfinite(kernel).all()
    assert 1e-2 < rel_err(kernel, plain) <= 0.3  # ~3x the measured 4-bit input noise; garbage is O(1)
    one_step = _one_worker_latents(client1, name, quant, ("kernel",), steps=1)[0]
    for strategy in (S(ulysses_degree=2), S(ring_degree=2)):
        split = client2.run(_matmul_job(name, quant, "kernel", strategy, steps=1)).latent
        # 3e-2: the order int8's kernel path agrees to (7e-3 above); flips gave 8e-3, a per-rank amax 0.16
        assert rel_err(split, one_step) <= 3e-2, strategy


def test_comfy_quant_unknown_quantized_matmul_is_refused_before_work(client1, tmp_path):
    from parallel_runtime.errors import ConfigError

    quant, meant = comfy_quant_twins(tmp_path, "kontext", "nvfp4")
    with pytest.raises(ConfigError, match="quantized_matmul 'fast' is unknown; choose one of auto, dequantize"):
        client1.run(_matmul_job("kontext", quant, "fast"))
    assert torch.isfinite(client1.run(job(("kontext", meant))).latent).all()  # the runtime still serves
