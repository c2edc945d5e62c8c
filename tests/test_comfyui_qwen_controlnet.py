"""A Qwen-Image ControlNet (InstantX's, ComfyUI's QwenImageControlNetModel) on the parallel MODEL, in a real
ComfyUI host (skipped without COMFYUI_DIR): ControlNetLoader + ControlNetApplyAdvanced under KSampler, text to image
and Edit (ReferenceLatent), against UNETLoader + the same stock nodes on the same files.

ComfyUI hard-codes Qwen-Image's width (3072, 24 heads of 128; the text 3584 wide), so the files are one block each,
1.4 GB in fp32: one host start for this module, apart from test_comfyui_controlnet's small Flux and SD3 files.
PipeFusion needs two blocks to split, so it is checked on tiny files in tests/test_qwen_image_controlnet.py.
"""
from __future__ import annotations

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import os  # noqa: E402

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import explain, latent_parity, serve  # noqa: E402
from conftest import rel_err  # noqa: E402
from parallel_runtime.models.families.qwen_image import QwenImageConfig  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint, write_qwen_image_controlnet  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

# fp32 on CPU: ComfyUI's and the workers' float32 maths in another op order over 2 blocks and 3 steps.
ONE_WORKER_RTOL = 1e-5
EXACT_RTOL = 1e-4
QWEN = QwenImageConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=1)
DIT, CONTROLNET = "qwen-image-mini.safetensors", "qwen-image-controlnet-mini.safetensors"


def write_files(root: str) -> None:
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), QWEN, seed=1,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    write_qwen_image_controlnet(os.path.join(root, "models", "controlnet", CONTROLNET), QWEN, blocks=1, seed=2)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-qwen-controlnet-", write_files)


def graph(devices: str = "cpu:1", strat: dict | None = None, edit: bool = False, control: bool = True) -> dict:
    """Seeded Qwen-shaped prompts (1, 2), a 160 x 128 latent (4), the ControlNet (30) applied with hint 33 (encoded
    by a stand-in Wan VAE, 36) at strength 0.8 (40); `edit`: the positive first gets a 96 x 80 reference latent
    (ReferenceLatent, 51). The same sampling on Load Parallel DiT (11 -> 12 -> 13) and UNETLoader (20 -> 21 -> 22)."""
    cond = {"tokens": 8, "guidance": -1.0, "width": 3584, "pooled": 0}
    g = {"1": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 1, **cond}},
         "2": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 2, **cond}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 1}},
         "10": strat or comfy_host.strategy(warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}},
         "30": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CONTROLNET}},
         "32": {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 7, "width": 96, "height": 80}},
         "33": {"class_type": "ParaDiTTestLatentToImage", "inputs": {"samples": ["32", 0]}},
         "36": {"class_type": "ParaDiTTestImageVAE", "inputs": {"video": True}}}
    positive, negative = ["1", 0], ["2", 0]
    if edit:
        g["50"] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 31, "width": 80, "height": 96, "video": True}}
        g["51"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": positive, "latent": ["50", 0]}}
        positive = ["51", 0]
    if control:
        g["40"] = {"class_type": "ControlNetApplyAdvanced",
                   "inputs": {"positive": positive, "negative": negative, "control_net": ["30", 0], "image": ["33", 0],
                              "strength": 0.8, "start_percent": 0.0, "end_percent": 1.0, "vae": ["36", 0]}}
        positive, negative = ["40", 0], ["40", 1]
    sampling = {"seed": 5, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": positive, "negative": negative, "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        g[sampler] = {"class_type": "KSampler", "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"q/{save}"}}
    return g


REFERENCES: dict[str, tuple] = {}  # latent_parity results by graph, to show each input acts


def test_qwen_image_controlnet_equals_unetloader(server):
    err, par, ref = REFERENCES["t2i"] = latent_parity(server, graph(), "qwen-image controlnet")
    assert par.shape == (1, 16, 1, 16, 20)
    assert err <= ONE_WORKER_RTOL
    bare = {k: v for k, v in graph(control=False).items() if k not in ("11", "12", "13")}
    result = server.run(bare)
    assert result["status"] == "success", explain(result)
    assert rel_err(server.latent(result, "22"), ref) > 1e-2  # the ControlNet changes the image


def test_qwen_image_edit_controlnet_equals_unetloader(server):
    """The residuals add to the image rows, before the reference rows; the ControlNet never sees the reference."""
    err, _, ref = latent_parity(server, graph(edit=True), "qwen-image edit controlnet")
    assert err <= ONE_WORKER_RTOL
    if "t2i" in REFERENCES:  # the reference latent acts too
        assert rel_err(ref, REFERENCES["t2i"][2]) > 1e-3


@pytest.mark.parametrize("strat", [comfy_host.strategy(warmup=3, cfg=2), comfy_host.strategy(warmup=3, ulysses=2),
                                   comfy_host.strategy(warmup=3, ring=2)], ids=["cfg2", "ulysses2", "ring2"])
def test_qwen_image_edit_controlnet_on_two_workers_equals_unetloader(server, strat):
    what = f"qwen-image edit controlnet, {strat['inputs']}"
    err, _, _ = latent_parity(server, graph("cpu:2", strat, edit=True), what)
    assert err <= EXACT_RTOL
