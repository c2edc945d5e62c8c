"""GGUF block formats: ParaDiT's torch dequantizers against the `gguf` package's reference (numpy) ones.

Q8_0 and Q4_0 blocks come from gguf's own quantizer; the K-quants (which gguf-py can read but not write)
from random bytes with finite fp16 scales, which exercises every bit of their packing. Equal bit for bit:
both follow ggml's float32 arithmetic in the same order.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as reference  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from parallel_runtime.weights.gguf_quants import BLOCKS, dequantize, row_bytes  # noqa: E402

ROWS, VALUES = 6, 512  # two K super-blocks, sixteen 32-blocks per row


def random_blocks(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, bytes_per_row] of random blocks whose fp16 fields are finite, moderate numbers."""
    per_block, size = BLOCKS[fmt]
    blocks = rng.integers(0, 256, size=(ROWS * VALUES // per_block, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}[fmt]
    for start in halves:
        blocks[:, start:start + 2] = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_dequantize_equals_the_reference_bit_for_bit(fmt):
    rng = np.random.default_rng(3)
    if fmt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = quantize(rng.standard_normal((ROWS, VALUES)).astype(np.float32), getattr(T, fmt))
    else:
        raw = random_blocks(fmt, rng)
    assert raw.shape == (ROWS, row_bytes(fmt, VALUES))
    want = torch.from_numpy(reference(raw, getattr(T, fmt)).copy())
    got = dequantize(torch.from_numpy(raw), fmt, (ROWS, VALUES), torch.float32, math=torch.float32)
    assert got.shape == want.shape and torch.equal(got, want)
    # a slice of rows dequantizes on its own (a rank holds only its rows of a fused tensor)
    part = dequantize(torch.from_numpy(raw[2:5]), fmt, (3, VALUES), torch.float32, math=torch.float32)
    assert torch.equal(part, want[2:5])
    # The runtime's default: ComfyUI-GGUF's fp16 block arithmetic (its numbers: tests/test_comfyui_integration.py),
    # within a few fp16 roundings (2^-11 relative each) of the reference, relative to the block's largest value.
    fp16 = dequantize(torch.from_numpy(raw), fmt, (ROWS, VALUES), torch.float32)
    assert 0 < (fp16 - want).abs().max() <= 4 * 2 ** -11 * want.abs().max()


def test_gguf_row_bytes_refuse_partial_blocks():
    assert row_bytes("Q4_K", 512) == 288 and row_bytes("Q8_0", 64) == 68
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        row_bytes("Q4_K", 100)


# ---- GGUF diffusion-model files through the runtime ------------------------------------------------------------

import dataclasses  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from conftest import rel_err  # noqa: E402
from test_families import FAMILIES, assert_two_workers_equal_one, job  # noqa: E402
from parallel_runtime.errors import ModelFileError  # noqa: E402
from parallel_runtime.models.registry import read_model  # noqa: E402
from parallel_runtime.weights.gguf_file import dequantize_blocks  # noqa: E402
from parallel_runtime.bench.storage import analytic_rank_bytes  # noqa: E402
from parallel_runtime.weights.checkpoint import open_checkpoint  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from parallel_runtime.spec import StrategySpec as S  # noqa: E402

# Both sides compute in fp32 from the same numbers (the GGUF side dequantizes them per layer): equal up to BLAS
# blocking of equal operands, ~1e-7. A misread block is off by O(1), fp32 instead of fp16 block math by ~5e-4.
GGUF_RTOL = 1e-5
EXACT_RTOL = 1e-4  # exact strategies at 2 workers vs 1 (tests/test_families.py)
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]
ARCH = {"kontext": "flux", "chroma": "flux", "sd3_medium_dual": "sd3", "qwen_image": "qwen_image", "pixart": "pixart"}
# Formats cycled over the linear weights each can hold: 256-value K-quant rows, 32-value legacy rows, the rest
# BF16/F16; 1-D tensors F32.
K_FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]
LEGACY_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"]
# fp16 fields of crafted K-quant blocks (byte offset: magnitude), so a weight stays ~0.01-0.1 like a real one.
K_FIELDS = {"Q4_K": {0: 2e-4, 2: 1e-3}, "Q5_K": {0: 1e-4, 2: 1e-3}, "Q6_K": {208: 2e-5},
            "Q3_K": {108: 4e-4}, "Q2_K": {80: 2e-3, 82: 2e-3}}


def crafted_k_blocks(fmt: str, rows: int, values: int, rng: np.random.Generator) -> np.ndarray:
    size = gguf.GGML_QUANT_SIZES[getattr(T, fmt)][1]
    blocks = rng.integers(0, 256, size=(rows * values // 256, size), dtype=np.uint8)
    for offset, magnitude in K_FIELDS[fmt].items():
        field = rng.uniform(0.5, 1.0, size=(blocks.shape[0], 1)) * magnitude
        blocks[:, offset:offset + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_twins(folder, name: str, config=None, arch: str | None = None) -> tuple[str, str]:
    """A GGUF file of a tiny `name` model (keys without prefix, as ComfyUI-GGUF's converter writes them) and the
    fp32 safetensors file of the values it holds as ComfyUI-GGUF dequantizes them (fp16 block arithmetic: the
    dequantizer is checked against gguf's reference above and against ComfyUI-GGUF in the host tests)."""
    base = load_file(write_checkpoint(str(folder / f"{name}-base.safetensors"), config or FAMILIES[name], seed=11))
    rng = np.random.default_rng(5)
    writer = gguf.GGUFWriter(str(folder / f"{name}.gguf"), arch=arch or ARCH[name])
    meant, legacy, k_quant = {}, 0, 0
    for key, t in base.items():
        array = t.numpy()
        if key.endswith(".weight") and t.ndim == 2 and t.shape[1] % 256 == 0:
            fmt, k_quant = K_FORMATS[k_quant % len(K_FORMATS)], k_quant + 1
            raw = crafted_k_blocks(fmt, *t.shape, rng)
        elif key.endswith(".weight") and t.ndim == 2 and t.shape[1] % 32 == 0:
            fmt, legacy = LEGACY_FORMATS[legacy % len(LEGACY_FORMATS)], legacy + 1
            raw = quantize(array, getattr(T, fmt))
        else:
            fmt, raw = ("F16", array.astype(np.float16)) if t.ndim >= 2 else ("F32", array)
        if fmt in ("F16", "F32"):
            writer.add_tensor(key, raw)
            meant[key] = torch.from_numpy(raw.astype(np.float32))
        else:
            writer.add_tensor(key, raw, raw_dtype=getattr(T, fmt))
            meant[key] = dequantize_blocks(torch.from_numpy(raw), fmt, tuple(t.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(meant, str(folder / f"{name}-gguf-fp32.safetensors"))
    return str(folder / f"{name}.gguf"), str(folder / f"{name}-gguf-fp32.safetensors")


def analytic_bytes(path: str, stage: int = 0, stages: int = 1) -> int:
    """Bytes a rank of PipeFusion-`stages` holds: each linear weight's blocks as stored (BF16/F16 ones upcast:
    only block formats stay compact), everything else at 4 bytes (fp32 compute on CPU)."""
    return analytic_rank_bytes(path, "default", stage, stages)


@pytest.fixture(scope="module", params=NAMES)
def gguf_files(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    return (request.param, *gguf_twins(folder, request.param))


def test_gguf_file_equals_its_fp32_twin_and_stays_quantized(client1, gguf_files):
    name, quant, meant = gguf_files
    with open_checkpoint(quant) as reader:
        formats = {reader.quant_format(k) for k in reader.keys()}
    assert {"Q8_0", "Q4_0", "Q4_K"} <= formats  # the file really mixes block formats
    got, ref = client1.run(job((name, quant))), client1.run(job((name, meant)))
    assert torch.isfinite(ref.latent).all() and ref.latent.abs().sum() > 0
    assert rel_err(got.latent, ref.latent) <= GGUF_RTOL
    held = got.stats[0]["param_bytes"]
    assert held == analytic_bytes(quant)  # blocks as stored, exactly
    # Tiny PixArt's width (144) is not whole 32-value blocks, so most of its linears stay F16 there (as
    # ComfyUI-GGUF's converter leaves them); the other tiny models quantize nearly every weight.
    assert held < (0.85 if name == "pixart" else 0.5) * ref.stats[0]["param_bytes"]


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
                                      S(pipefusion_degree=2, warmup_steps=6)], ids=lambda s: s.label())
def test_gguf_exact_strategies_at_two_workers_equal_one(client1, gguf_files, client2, strategy):
    name, quant, _ = gguf_files
    assert_two_workers_equal_one(client1, client2, name, quant, strategy, analytic_bytes)


def write_gguf(path, arch: str | None, tensors: dict) -> str:
    """A GGUF file of `tensors` (name -> (numpy data, GGML type or None for a plain array))."""
    writer = gguf.GGUFWriter(str(path), arch=arch or "flux")
    if arch is None:  # stable-diffusion.cpp files carry no architecture
        writer.kv_data[0].pop("general.architecture", None)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_bad_files_fail_in_one_sentence_and_the_next_job_runs(client1, tmp_path):
    name = "kontext"
    quant, meant = gguf_twins(tmp_path, name)
    data = open(quant, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 100)
    llm = write_gguf(tmp_path / "text-encoder.gguf", "llama", {"blk.0.attn_q.weight": (np.zeros((32, 32), np.float32), None)})
    odd = write_gguf(tmp_path / "q8k.gguf", "flux",
                     {"img_in.weight": (np.zeros((4, 292), np.uint8), T.Q8_K)})  # a type nobody dequantizes
    cases = {str(truncated): "truncated.gguf is not a valid GGUF file .*re-download it",
             str(garbage): "garbage.gguf is not a valid GGUF file",
             llm: "text-encoder.gguf is a GGUF of a 'llama' model .*not a diffusion transformer",
             odd: "q8k.gguf stores 'img_in.weight' as GGUF type Q8_K, which ParaDiT cannot read"}
    for path, message in cases.items():
        with pytest.raises(ModelFileError, match=message) as info:
            client1.run(job((name, path)))
        assert "\n" not in str(info.value)
    assert torch.isfinite(client1.run(job((name, quant))).latent).all()


def test_gguf_without_architecture_is_read_by_its_keys(tmp_path):
    """stable-diffusion.cpp writes no general.architecture: the keys decide, as in ComfyUI-GGUF."""
    name = "kontext"
    base = load_file(write_checkpoint(str(tmp_path / "base.safetensors"), FAMILIES[name], seed=11))
    path = write_gguf(tmp_path / "sdcpp.gguf", None, {k: (t.numpy(), None) for k, t in base.items()})
    with open_checkpoint(path) as reader:
        assert reader.architecture is None
        family, match, config = read_model(reader)
        assert config == FAMILIES[name]
        key = "double_blocks.0.img_attn.qkv.weight"
        assert torch.equal(reader.read(key, rows=slice(64, 128)), base[key][64:128])


# ---- LoRA on GGUF weights: patched per call, as ComfyUI-GGUF patches them ---------------------------------------

from test_weight_patches import lora_stack, stacked  # noqa: E402


def merged_twin(twin: str, path: str, deltas: list[dict]) -> str:
    """The fp32 twin with each delta added in order, in float32 (keys without prefix, as in the GGUF file)."""
    sd = load_file(twin)
    for stack in deltas:
        for key, parts in stack.items():
            w = sd[key].float()
            for offset, delta in parts:
                (w.narrow(*offset) if offset is not None else w).add_(delta)
            sd[key] = w
    save_file(sd, path)
    return path


@pytest.mark.parametrize("strategy", [S(), S(ulysses_degree=2), S(pipefusion_degree=2, warmup_steps=6)],
                         ids=lambda s: s.label())
def test_gguf_lora_stack_equals_the_merged_twin_and_holds_no_dense_copy(gguf_files, client1, client2, strategy):
    """Each GGUF layer dequantizes its blocks and adds the patches in float32 when it runs (ComfyUI-GGUF's
    order): the same numbers as a file holding the merged weights. The rank still holds only the blocks."""
    name, quant, twin = gguf_files
    patches, deltas = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    merged = merged_twin(twin, twin.replace(".safetensors", f"-merged-{strategy.label()}.safetensors"), deltas)
    world = strategy.world_size
    client = client2 if world == 2 else client1
    reference = client.run(job((name, merged), strategy)).latent
    plain = client.run(job((name, quant), strategy))
    result = client.run(dataclasses.replace(job((name, quant), strategy), weight_patches=patches))
    assert rel_err(reference, plain.latent) > 1e-2  # the LoRAs really change the image
    assert rel_err(result.latent, reference) <= (GGUF_RTOL if world == 1 else EXACT_RTOL)
    assert [s["param_bytes"] for s in result.stats] == [s["param_bytes"] for s in plain.stats]


def test_gguf_lora_swap_and_removal_repatch_without_reloading(client1, tmp_path):
    name = "kontext"
    quant, twin = gguf_twins(tmp_path, name)
    a, b = lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b")
    expected = {tag: client1.run(job((name, merged_twin(twin, str(tmp_path / f"{tag}.safetensors"), deltas)))).latent
                for tag, deltas in (("a", [a[1]]), ("b", [b[1]]), ("none", []))}
    loads = None
    for tag, patches in (("a", a[0]), ("b", b[0]), ("none", None), ("a", a[0])):
        result = client1.run(dataclasses.replace(job((name, quant)), weight_patches=patches))
        assert rel_err(result.latent, expected[tag]) <= GGUF_RTOL, tag
        loads = loads if loads is not None else client1.model_loads
    assert client1.model_loads == loads  # every swap only re-patched
