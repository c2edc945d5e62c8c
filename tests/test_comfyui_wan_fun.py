"""Wan's Fun camera and Fun control files on the parallel MODEL in a real ComfyUI host (skipped without COMFYUI_DIR):
ComfyUI's own WanCameraEmbedding + WanCameraImageToVideo and Wan22FunControlToVideo feed Load Parallel DiT and
UNETLoader, where ComfyUI runs its CameraWanModel / WanModel on the same file.

Files as tests/test_comfyui_wan.py writes them (256 wide, 2 blocks, fp32), in ComfyUI's detection shapes: Wan 2.1
Fun camera (in_dim 32, CLIP vision: WAN21_Camera), 2.2 Fun camera (in_dim 36: WAN22_Camera), 2.2 Fun control
(in_dim 52 and a ref_conv: WAN21 with concat_mask_index and reference_latent), 2.1 Fun control (in_dim 48, CLIP
vision: WAN21_FunControl2V) and 2.2 Fun inpaint (the 2.2 I2V shape, WanFunInpaintToVideo's start and end frames).
64x48 px x 17 frames: a [1, 24, 5, 48, 64] camera embedding for 5 x 3 x 4 tokens.
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
from test_comfyui_wan import EXACT_RTOL, ONE_WORKER_RTOL, WAN, graph  # noqa: E402

pytestmark = pytest.mark.timeout(900)

FILES = {"wan2.1_fun_camera_mini.safetensors": dataclasses.replace(WAN, in_channels=32, image_to_video=True,
                                                                    camera_channels=24),
         "wan2.2_fun_camera_mini.safetensors": dataclasses.replace(WAN, in_channels=36, camera_channels=24),
         "wan2.2_fun_control_mini.safetensors": dataclasses.replace(WAN, in_channels=52, reference_channels=16),
         "wan2.1_fun_control_mini.safetensors": dataclasses.replace(WAN, in_channels=48, image_to_video=True),
         "wan2.2_fun_inpaint_mini.safetensors": dataclasses.replace(WAN, in_channels=36),
         "wan2.2_fun_control_5B_mini.safetensors": dataclasses.replace(WAN, in_channels=148, out_channels=48,
                                                                       reference_channels=48)}
CAMERA21, CAMERA22, CONTROL22, CONTROL21, INPAINT22, CONTROL5B = FILES
ENTRANCE_RTOL = 1e-5  # Parallel Sampler's loop and KSampler's calls on the same workers: the same maths per step


def write_models(root: str) -> None:
    for seed, (name, config) in enumerate(FILES.items()):
        write_checkpoint(os.path.join(root, "models", "diffusion_models", name), config, seed=30 + seed,
                         prefix="model.diffusion_model.", dtype=torch.float32)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-wanfun-", write_models)


def camera_graph(dit: str, devices: str = "cpu:1", strat: dict | None = None, clip: bool = False) -> dict:
    """graph() with WanCameraEmbedding (32, "Zoom In") into WanCameraImageToVideo (5): a grey start image, a seeded
    stand-in for the Wan VAE and (clip) for CLIPVisionEncode's tokens."""
    g = graph(devices, strat, dit=dit)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 11}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["32"] = {"class_type": "WanCameraEmbedding", "inputs": {"camera_pose": "Zoom In", "width": 64, "height": 48,
                                                              "length": 17}}
    g["5"] = {"class_type": "WanCameraImageToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "start_image": ["31", 0], "camera_conditions": ["32", 0],
                         **({"clip_vision_output": ["30", 1]} if clip else {})}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


def control_graph(devices: str = "cpu:1", strat: dict | None = None, five: bool = False) -> dict:
    """graph() with Wan22FunControlToVideo (5) on a 17-frame control video and a reference image: its concat is
    [control latent, mask, start latent] (concat_mask_index 16), as ComfyUI's WAN21.concat_cond builds it, and the
    reference's latent goes through the model's ref_conv (reference_latents)."""
    width, height = (128, 96) if five else (64, 48)  # five: the 5B file on the Wan 2.2 VAE's 48 channels, 16x smaller
    g = graph(devices, strat, dit=CONTROL5B if five else CONTROL22)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 13, "channels": 48 if five else 16}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": width, "height": height, "batch_size": 17,
                                                      "color": 4210752}}
    g["5"] = {"class_type": "Wan22FunControlToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": width,
                         "height": height, "length": 17, "batch_size": 1, "control_video": ["31", 0],
                         "ref_image": ["31", 0]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


def control21_graph(devices: str = "cpu:1", strat: dict | None = None) -> dict:
    """graph() with WanFunControlToVideo (5): a start image, a 17-frame control video and CLIP vision; its concat is
    the control and start latents, no mask (WAN21_FunControl2V: image_to_video off)."""
    g = graph(devices, strat, dit=CONTROL21)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 14}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 17, "color": 4210752}}
    g["33"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["5"] = {"class_type": "WanFunControlToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "control_video": ["31", 0], "start_image": ["33", 0],
                         "clip_vision_output": ["30", 1]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


def inpaint_graph(devices: str = "cpu:1", strat: dict | None = None) -> dict:
    """graph() with WanFunInpaintToVideo (5): start and end images, so the mask keeps the first and last frames."""
    g = graph(devices, strat, dit=INPAINT22)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 15}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["33"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 4210752}}
    g["5"] = {"class_type": "WanFunInpaintToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "start_image": ["31", 0], "end_image": ["33", 0]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


def parity(server, g: dict, what: str, channels: int = 16) -> float:
    err, par, _ = latent_parity(server, g, what)
    assert par.shape == (1, channels, 5, 6, 8)
    return err


def test_wan22_5b_fun_control_with_reference_equals_unetloader(server):
    """The 5B Fun control file (48-channel latent, in_dim 148, a 48-channel ref_conv; ComfyUI's WAN22), Ulysses-2."""
    g = control_graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3), five=True)
    assert parity(server, g, "Wan 2.2 5B Fun control + reference Ulysses-2", channels=48) <= EXACT_RTOL


@pytest.mark.parametrize("what, g", [
    ("2.1 camera + CLIP vision", lambda: camera_graph(CAMERA21, clip=True)),
    ("2.2 camera", lambda: camera_graph(CAMERA22)),
    ("2.2 control + reference", lambda: control_graph()),
    ("2.1 control + CLIP vision", lambda: control21_graph()),
    ("2.2 inpaint, start and end", lambda: inpaint_graph()),
], ids=["camera21", "camera22", "control22", "control21", "inpaint22"])
def test_wan_fun_one_worker_equals_unetloader(server, what, g):
    assert parity(server, g(), f"Wan Fun {what}, 1 worker") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("what, g", [
    ("2.2 camera Ulysses-2", lambda: camera_graph(CAMERA22, "cpu:2", comfy_host.strategy(ulysses=2, warmup=3))),
    ("2.1 camera Ring-2", lambda: camera_graph(CAMERA21, "cpu:2", comfy_host.strategy(ring=2, warmup=3), clip=True)),
    ("2.2 camera PipeFusion-2", lambda: camera_graph(CAMERA22, "cpu:2", comfy_host.strategy(pp=2, patches=5,
                                                                                            warmup=3))),
    ("2.2 control + reference Ring-2", lambda: control_graph("cpu:2", comfy_host.strategy(ring=2, warmup=3))),
], ids=["camera22_ulysses2", "camera21_ring2", "camera22_pp2", "control22_ring2"])
def test_wan_fun_exact_strategies_equal_unetloader(server, what, g):
    assert parity(server, g(), f"Wan Fun {what}") <= EXACT_RTOL


@pytest.mark.parametrize("what, g", [
    ("2.2 camera", lambda: camera_graph(CAMERA22, "cpu:2", comfy_host.strategy(ulysses=2, warmup=3))),
    ("2.2 control + reference", lambda: control_graph("cpu:2", comfy_host.strategy(cfg=2, warmup=3))),
], ids=["camera22", "control22"])
def test_wan_fun_parallel_sampler_runs_the_worker_loop(server, what, g):
    """camera_conditions, concat_mask_index and Wan's reference latent are read by the workers' own loop (no
    per-call routing): Parallel Sampler equals KSampler on the same MODEL and UNETLoader's KSampler."""
    g = comfy_host.with_parallel_sampler(g())
    same, unet, summary = comfy_host.entrance_parity(server, g, f"Wan Fun {what} Parallel Sampler")
    assert same <= ENTRANCE_RTOL and unet <= EXACT_RTOL
    assert "per model call" not in summary
