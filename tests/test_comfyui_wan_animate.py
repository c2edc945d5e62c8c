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


def write_models(root: str) -> None:
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), ANIMATE, seed=51,
                     prefix="model.diffusion_model.", dtype=torch.float32)


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


def test_wan_animate_parallel_sampler_routes_per_call_and_equals_ksampler(server):
    """Parallel Sampler on WanAnimateToVideo's conditioning (its CLIP vision, pose and face video are read per model
    call, so ComfyUI's sampler drives the workers) under PipeFusion-2 over whole frames, warm-up only: KSampler's
    latent on the same MODEL and UNETLoader's."""
    g = comfy_host.with_parallel_sampler(animate_graph("cpu:2", comfy_host.strategy(pp=2, patches=3, warmup=3)))
    same, unet, summary = comfy_host.entrance_parity(server, g, "Wan 2.2 Animate Parallel Sampler, PipeFusion-2")
    assert same <= ENTRANCE_RTOL and unet <= EXACT_RTOL
    assert "per-call pipeline: the graph has CLIP-vision tokens" in summary
