"""Wan 2.2 Animate on the parallel MODEL in a real ComfyUI host (skipped without COMFYUI_DIR): ComfyUI's own
WanAnimateToVideo (reference image, pose video, face video, CLIP vision) feeds Load Parallel DiT and UNETLoader,
where ComfyUI runs its AnimateWanModel on the same file (its motion encoder on every model call).

The file: Wan Animate's shape at 256 wide (2 heads of 128) with 10 blocks, so face blocks run after blocks 0 and 5,
fp32, in ComfyUI's layout (its blur kernels included). 64x48 px x 5 frames: 2 latent frames after the reference
image's one, 3 x 3 x 4 = 36 video tokens; the face video's 5 frames (ramps, resized to 512 x 512 by the node) make
2 motion frames, and the 3rd latent frame reads the zero padding, as ComfyUI pads it.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import latent_parity, serve  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from test_comfyui_wan import ENTRANCE_RTOL, EXACT_RTOL, ONE_WORKER_RTOL, WAN, graph  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

ANIMATE = dataclasses.replace(WAN, num_layers=10, in_channels=36, image_to_video=True, animate=True)
DIT = "wan2.2_animate_mini.safetensors"
FRAMES = 5


LORA = "wan2.2_animate_face_lora_mini.safetensors"


def write_models(root: str) -> None:
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), ANIMATE, seed=51,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    write_lora(os.path.join(root, "models", "loras"))


def write_lora(folder: str) -> None:
    """A LoRA in ComfyUI's key names (lora_up / lora_down, alpha) on a main block's self-attention, on face block 0's
    q and kv projections and face block 1's output, and on the face encoder's output projection (which the
    workers' per-run motion tokens must then be made with)."""
    from safetensors.torch import save_file

    h = ANIMATE.hidden_size
    targets = {"blocks.0.self_attn.q": (h, h), "face_adapter.fuser_blocks.0.linear1_q": (h, h),
               "face_adapter.fuser_blocks.0.linear1_kv": (2 * h, h), "face_adapter.fuser_blocks.1.linear2": (h, h),
               "face_encoder.out_proj": (h, 1024)}
    g = torch.Generator().manual_seed(53)
    tensors = {}
    for key, (rows, cols) in targets.items():
        tensors[f"diffusion_model.{key}.lora_up.weight"] = torch.randn(rows, 8, generator=g) * 0.05
        tensors[f"diffusion_model.{key}.lora_down.weight"] = torch.randn(8, cols, generator=g) * 0.05
        tensors[f"diffusion_model.{key}.alpha"] = torch.tensor(8.0)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, LORA))


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-wananimate-", write_models)


def animate_graph(devices: str = "cpu:1", strat: dict | None = None, steps: int = 2) -> dict:
    """graph() with WanAnimateToVideo (5): a grey reference image, a 5-frame pose video and face video, seeded
    stand-ins for the Wan VAE's encode and CLIPVisionEncode; its latent (3 frames: the reference's first) into both
    samplers."""
    g = graph(devices, strat, dit=DIT)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 17}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["32"] = {"class_type": "ParaDiTTestRampVideo", "inputs": {"frames": FRAMES, "width": 64, "height": 48}}
    g["33"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": FRAMES,
                                                      "color": 4210752}}
    g["5"] = {"class_type": "WanAnimateToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": FRAMES, "batch_size": 1, "continue_motion_max_frames": 5, "video_frame_offset": 0,
                         "reference_image": ["31", 0], "clip_vision_output": ["30", 1], "face_video": ["32", 0],
                         "pose_video": ["33", 0]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2], steps=steps)
    return g


def parity(server, g: dict, what: str) -> float:
    err, par, _ = latent_parity(server, g, what)
    assert par.shape == (1, 16, 3, 6, 8)
    return err


def test_wan_animate_one_worker_equals_unetloader(server):
    assert parity(server, animate_graph(), "Wan 2.2 Animate, 1 worker") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(ulysses=2, warmup=3), comfy_host.strategy(tensor=2)],
                         ids=["ulysses2", "tp2"])
def test_wan_animate_exact_strategies_equal_unetloader(server, strat):
    assert parity(server, animate_graph("cpu:2", strat), f"Wan 2.2 Animate {strat['inputs']}") <= EXACT_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(pp=2, patches=3, warmup=3),
                                   comfy_host.strategy(cfg=2, warmup=1)], ids=["pp2_warm", "cfg2"])
def test_wan_animate_parallel_sampler_runs_the_worker_loop(server, strat):
    """Parallel Sampler on WanAnimateToVideo's conditioning: the MODEL's own extra_conds makes the CLIP-vision tokens,
    the pose latent and the face video for the workers' own step loop (no per-call routing), which equals KSampler on
    the same MODEL and UNETLoader under CFG-2 and PipeFusion-2 over whole frames (its warm-up steps: exact)."""
    g = comfy_host.with_parallel_sampler(animate_graph("cpu:2", strat))
    same, unet, summary = comfy_host.entrance_parity(server, g, f"Wan 2.2 Animate Parallel Sampler {strat['inputs']}")
    assert "per model call" not in summary
    assert same <= ENTRANCE_RTOL and unet <= EXACT_RTOL


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", comfy_host.strategy(ulysses=2, warmup=3))],
                         ids=["serial", "ulysses2"])
def test_wan_animate_lora_equals_unetloader_and_remakes_the_motion_tokens(server, devices, strat):
    """LoraLoaderModelOnly on both loaders: the LoRA reaches the face blocks and the face encoder on the workers. The
    same graph ran without it first on the same workers, so their motion tokens for this face video are kept: the
    patched face encoder must make them anew (kept by weights), or the latent would be the unpatched encoder's."""
    from conftest import rel_err

    err, plain, _ = latent_parity(server, animate_graph(devices, strat), "Wan 2.2 Animate without the LoRA")
    assert err <= EXACT_RTOL
    g = animate_graph(devices, strat)
    for loader in ("11", "20"):
        g[loader + "l"] = {"class_type": "LoraLoaderModelOnly",
                           "inputs": {"model": [loader, 0], "lora_name": LORA, "strength_model": 1.0}}
    g["12"]["inputs"]["model"], g["21"]["inputs"]["model"] = ["11l", 0], ["20l", 0]
    err, patched, _ = latent_parity(server, g, f"Wan 2.2 Animate with a face LoRA on {devices}")
    assert err <= EXACT_RTOL
    assert rel_err(patched, plain) > 1e-3
