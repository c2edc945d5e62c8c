"""ComfyUI-quantized layers on a GPU: the kernel path (comfy-kitchen's CUDA kernels) where ComfyUI's rule picks it.

What the CPU tests check with comfy-kitchen's eager versions (tests/test_comfy_quant.py), here with the CUDA
kernels ComfyUI runs: a rank's rows of a layer give those columns of F.linear on comfy-kitchen's QuantizedTensor
of the whole layer, in bf16, and `auto` picks the kernel exactly where comfy.ops.get_disabled_quant_formats does.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import rel_err
from parallel_runtime.weights.comfy_quant import kernel_formats
from parallel_runtime.weights.checkpoint import open_checkpoint
from parallel_runtime.weights.storage import Storage

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
pytestmark = pytest.mark.timeout(600)

DEVICE = torch.device("cuda", 0)
# comfy_quant format -> (layout, options, comfy_quant entry, whether the kernel takes the input in the layout)
FORMATS = {
    "float8_e4m3fn": ("TensorCoreFP8Layout", {}, {"format": "float8_e4m3fn"}, True),
    "int8_tensorwise": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256},
                        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}, False),
    "nvfp4": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}, True),
    "mxfp8": ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}, True),
}


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f"comfy_quant-{f}")
def test_kernel_rows_equal_comfy_kitchens_cuda_linear(tmp_path, fmt):
    if fmt not in kernel_formats(DEVICE):
        pytest.skip(f"ComfyUI runs {fmt} dequantized on this GPU (compute capability "
                    f"{torch.cuda.get_device_capability(DEVICE)})")
    layout, options, conf, quantizes_input = FORMATS[fmt]
    torch.manual_seed(0)
    w, b = torch.randn(512, 1024, device=DEVICE, dtype=torch.bfloat16), torch.randn(512)
    whole_qt = ck_tensor.QuantizedTensor.from_float(w, layout, **options)  # quantized by the CUDA kernels
    sd = {k: v.cpu() for k, v in whole_qt.state_dict("l.weight").items()} | {"l.bias": b}
    sd["l.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    save_file(sd, str(tmp_path / "layer.safetensors"))
    x = torch.randn(2, 300, 1024, device=DEVICE, dtype=torch.bfloat16)
    bias = b.to(DEVICE, torch.bfloat16)
    if quantizes_input:  # ComfyUI's fp8 layout quantizes an input without input_scale at scale 1
        scale = torch.ones((), device=DEVICE) if fmt == "float8_e4m3fn" else None
        rows = ck_tensor.QuantizedTensor.from_float(x.reshape(-1, 1024), layout, scale=scale)
        whole = torch.nn.functional.linear(rows, whole_qt, bias).reshape(2, 300, 512)
    else:
        whole = torch.nn.functional.linear(x, whole_qt, bias)
    storage = Storage(torch.bfloat16, kernel_formats=kernel_formats(DEVICE))
    with open_checkpoint(str(tmp_path / "layer.safetensors")) as reader:
        for part in (slice(0, 512), slice(128, 384), slice(100, 300)):  # 200 rows: not whole nvfp4 blocks
            layer = reader.read_kept("l.weight", part, None, DEVICE).linear(bias[part], storage)
            assert layer.kernel
            # The same kernel on a subset of the weight's rows: bf16 outputs may round differently where the
            # kernel tiles the smaller problem differently (one bf16 step, 2^-8, now and then).
            assert rel_err(layer(x).float(), whole[..., part].float()) <= 1e-2


def test_auto_follows_comfyuis_rule_on_this_gpu():
    major, minor = torch.cuda.get_device_capability(DEVICE)
    want = {"int8_tensorwise"}
    if torch.version.hip is None and (major, minor) >= (8, 9):
        want |= {"float8_e4m3fn"}
    if torch.version.hip is None and major >= 10:
        want |= {"nvfp4"} | ({"mxfp8"} if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 10) else set())
    assert kernel_formats(DEVICE) == want
