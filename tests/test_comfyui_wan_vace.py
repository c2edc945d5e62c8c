"""Wan VACE on the parallel MODEL in a real ComfyUI host (skipped without COMFYUI_DIR): ComfyUI's own WanVaceToVideo
(a control video, a mask and a reference image) feeds Load Parallel DiT and UNETLoader, where ComfyUI runs its
VaceWanModel on the same file, and TrimVideoLatent cuts the reference frame off both results.

The file: a random Wan 2.1 VACE in ComfyUI's detection shape (256 wide, 4 blocks, 2 VACE blocks after blocks 0 and
2, vace_in_dim 96), fp32. 64x48 px x 17 frames and a reference image: a 6-frame latent while sampling (the
reference's frame first, as WanVaceToVideo makes it), 5 x 3 x 4 tokens after the trim.
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

VACE = dataclasses.replace(WAN, num_layers=4, vace_layers=2, vace_channels=96)
DIT = "wan2.1_vace_mini.safetensors"
ENTRANCE_RTOL = 1e-5  # Parallel Sampler's loop and KSampler's calls on the same workers: the same maths per step


def write_models(root: str) -> None:
    for seed, name in enumerate((DIT, *TEMPLATE_FILES)):
        write_checkpoint(os.path.join(root, "models", "diffusion_models", name), VACE, seed=60 + seed,
                         prefix="model.diffusion_model.", dtype=torch.float32)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-wanvace-", write_models)


def vace_graph(devices: str = "cpu:1", strat: dict | None = None, reference: bool = True,
               second: float | None = None) -> dict:
    """graph() with WanVaceToVideo (5, strength 0.8) on a 17-frame control video under a mask that keeps its left
    half, a reference image (`reference`), a seeded stand-in for the Wan VAE; `second`: a second WanVaceToVideo (6)
    chained after it with that strength (ComfyUI appends its vace_frames / vace_strength: two VACE inputs). Each
    sampler's latent goes through TrimVideoLatent (trim_latent of the last node) before SaveLatent."""
    g = graph(devices, strat, dit=DIT)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 16}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 17, "color": 4210752}}
    g["32"] = {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 32, "height": 48}}
    g["34"] = {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 64, "height": 48}}
    g["35"] = {"class_type": "MaskComposite", "inputs": {"destination": ["34", 0], "source": ["32", 0], "x": 0, "y": 0,
                                                         "operation": "add"}}
    g["33"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    last = "5"
    g["5"] = {"class_type": "WanVaceToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "strength": 0.8, "control_video": ["31", 0],
                         "control_masks": ["35", 0], **({"reference_image": ["33", 0]} if reference else {})}}
    if second is not None:
        g["6"] = {"class_type": "WanVaceToVideo",
                  "inputs": dict(g["5"]["inputs"], positive=["5", 0], negative=["5", 1], strength=second,
                                 control_video=["33", 0])}
        last = "6"
    for sampler, trim, save in (("12", "14", "13"), ("21", "23", "22")):
        g[sampler]["inputs"].update(positive=[last, 0], negative=[last, 1], latent_image=[last, 2])
        g[trim] = {"class_type": "TrimVideoLatent", "inputs": {"samples": [sampler, 0], "trim_amount": [last, 3]}}
        g[save]["inputs"]["samples"] = [trim, 0]
    return g


def parity(server, g: dict, what: str) -> float:
    err, par, _ = latent_parity(server, g, what)
    assert par.shape == (1, 16, 5, 6, 8)  # the reference frame trimmed off
    return err


@pytest.mark.parametrize("what, g", [
    ("control video + mask + reference", lambda: vace_graph()),
    ("two inputs (0.8, 1.3), no reference", lambda: vace_graph(reference=False, second=1.3)),
], ids=["reference", "two_inputs"])
def test_wan_vace_one_worker_equals_unetloader(server, what, g):
    assert parity(server, g(), f"Wan VACE {what}, 1 worker") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("what, g", [
    ("Ulysses-2", lambda: vace_graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3))),
    ("PipeFusion-2", lambda: vace_graph("cpu:2", comfy_host.strategy(pp=2, patches=3, warmup=3))),
], ids=["ulysses2", "pp2"])
def test_wan_vace_exact_strategies_equal_unetloader(server, what, g):
    assert parity(server, g(), f"Wan VACE control video + mask + reference, {what}") <= EXACT_RTOL


def test_wan_vace_parallel_sampler_runs_the_worker_loop(server):
    """vace_frames / vace_mask / vace_strength are read by the workers' own loop (WAN21_Vace.extra_conds on the
    host builds the context, no per-call routing): Parallel Sampler, its latent trimmed like the others, equals
    KSampler on the same MODEL and UNETLoader's KSampler."""
    g = comfy_host.with_parallel_sampler(vace_graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3)))
    g["97"] = {"class_type": "TrimVideoLatent", "inputs": {"samples": ["98", 0], "trim_amount": ["5", 3]}}
    g["99"]["inputs"]["samples"] = ["97", 0]
    same, unet, summary = comfy_host.entrance_parity(server, g, "Wan VACE Parallel Sampler")
    assert same <= ENTRANCE_RTOL and unet <= EXACT_RTOL
    assert "per model call" not in summary


# ComfyUI's VACE templates (comfyui-workflow-templates-json): each UNETLoader names one of these two files.
TEMPLATE_FILES = ("wan2.1_vace_14B_fp16.safetensors", "wan2.1_vace_1.3B_fp16.safetensors")
VACE_TEMPLATES = ("video_wan_vace_14B_t2v", "video_wan_vace_14B_ref2v", "video_wan_vace_14B_v2v",
                  "video_wan_vace_outpainting")
# Templates that need node classes this late-2025 host lacks (ComfyUI 2026's switch and math nodes, SAM 3).
VACE_TEMPLATES_NEWER_HOST = {"video_wan_vace_flf2v": "ComfySwitchNode", "video_wan_vace_inpainting": "SAM3_Detect"}


def test_wan_vace_templates_validate_on_load_parallel_dit(server):
    """Each VACE template converts (scripts/ui_workflow.py, the live /object_info), takes Load Parallel DiT in place of
    its UNETLoader (Ulysses-2 on 2 CPU workers) and is refused by /prompt only for the files this server lacks (text
    encoder, VAE, LoRA, inputs); the DiT file it names (here a random VACE of that name) loads as a Wan VACE model,
    which 01a6cd6 refused."""
    import json
    import sys
    import urllib.error

    sys.path.insert(0, os.path.join(comfy_host.REPO, "scripts"))
    import paradit_swap
    import queue_workflow as qw
    import ui_workflow as uw
    from test_ui_workflow import FILE_WIDGETS, template

    from parallel_runtime.validate import model_config

    live = server.get("/object_info")
    for name in VACE_TEMPLATES:
        graph, _ = uw.convert(template(name), live)
        swapped, notes = paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("ulysses=2"), "cpu:2", live)
        loaders = [n for n in swapped.values() if n["class_type"] == "ParaDiTLoader"]
        assert loaders and all(n["inputs"]["unet_name"] in TEMPLATE_FILES for n in loaders), (name, notes)
        with pytest.raises(urllib.error.HTTPError) as refused:
            qw.http_json(f"{server.url}/prompt", {"prompt": swapped})
        body = json.loads(refused.value.read())
        errors = {(e["type"], e["extra_info"].get("input_name")) for n in body["node_errors"].values()
                  for e in n["errors"]}
        assert {t for t, _ in errors} <= {"value_not_in_list", "custom_validation_failed"}, (name, errors)
        assert {i for _, i in errors} <= FILE_WIDGETS | {"file", "video"}, (name, errors)
    for name, missing in VACE_TEMPLATES_NEWER_HOST.items():
        with pytest.raises(uw.ConversionError, match=missing):
            uw.convert(template(name), live)
    for file in TEMPLATE_FILES:
        assert model_config(os.path.join(server.root, "models", "diffusion_models", file)).vace_layers == 2
