"""ComfyUI's own ControlNet nodes on the parallel MODEL, in a real ComfyUI host (skipped without COMFYUI_DIR):
ControlNetLoader + ControlNetApplyAdvanced (strength, start/end percent, two chained) under KSampler, each graph
against UNETLoader + the same stock nodes on the same files, where ComfyUI runs its own ControlNetFlux,
comfy.cldm.mmdit.ControlNet (SD3) or ControlNetEmbedder (SD3.5).

The files: a random Flux DiT with ComfyUI's detection shape (3072 wide, one double and one single block, fp32)
and a random XLabs-layout Flux ControlNet of one double block (what ComfyUI's XLabs loader reads). The hint is
an image from a seeded latent (no VAE weights here), at another size than the output, so ComfyUI's upscale of
the hint is part of what is compared. ControlNets that encode their hint (InstantX's Flux Union, SD3's, SD3.5's)
get it from a seeded stand-in VAE. Flux with a Kontext reference latent, and a random SD3 DiT (256 wide, 4 blocks)
with two SD3 ControlNets in diffusers' layout and two SD3.5 ones (plain and "double y") in ComfyUI's.
"""
from __future__ import annotations

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import os  # noqa: E402

import torch  # noqa: E402

import comfy_host  # noqa: E402
from parallel_runtime.models.families.sd3 import SD3Config  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint, write_sd3_controlnet, write_sd35_controlnet  # noqa: E402
from comfy_host import explain, latent_parity, serve  # noqa: E402
from conftest import rel_err  # noqa: E402

pytestmark = pytest.mark.timeout(900)

DIT, CONTROLNET = comfy_host.FLUX_MINI_FILE, comfy_host.FLUX_CONTROLNET_FILE
# fp32 on CPU: ComfyUI's ControlNetFlux and DiT and the workers' run the same float32 maths in another op order
# (~1e-7 per op over 3 blocks and 3 steps); exact strategies on 2 workers add their own reordering.
ONE_WORKER_RTOL = 1e-5
EXACT_RTOL = 1e-4


# SD3: 4 heads of 64 (ComfyUI builds width / 64 = 4 joint blocks), SD3's text widths; its ControlNets as InstantX
# ships them (diffusers' SD3ControlNetModel names), 2 blocks (residuals listed [0, 0, 1]) and 1 block ([0, 0, 0]).
SD3_MINI = SD3Config(hidden_size=256, num_layers=4, pos_embed_max_size=16)
SD3_DIT, SD3_CONTROLNETS = "sd3-mini.safetensors", ("sd3-controlnet-2.safetensors", "sd3-controlnet-1.safetensors")
# Stability's SD3.5 kind as its files come (ComfyUI's names, without the DiT's layers): 2 image-only blocks, and a
# "double y" one of 2 blocks.
SD35_CONTROLNETS = ("sd35-controlnet.safetensors", "sd35-controlnet-double-y.safetensors")


def write_files(root: str) -> None:
    """The Flux files (comfy_host), the SD3 DiT and its two ControlNets."""
    comfy_host.write_flux_mini_and_controlnet(root)
    write_checkpoint(os.path.join(root, "models", "diffusion_models", SD3_DIT), SD3_MINI, seed=1,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    for name, blocks, seed in zip(SD3_CONTROLNETS, (2, 1), (2, 3)):
        write_sd3_controlnet(os.path.join(root, "models", "controlnet", name), SD3_MINI, blocks=blocks, seed=seed,
                             layout="diffusers")
    for name, double_y, seed in zip(SD35_CONTROLNETS, (False, True), (4, 5)):
        write_sd35_controlnet(os.path.join(root, "models", "controlnet", name), SD3_MINI, blocks=2, double_y=double_y,
                              seed=seed)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-controlnet-", write_files)


def strategy(**degrees) -> dict:
    """warmup_steps = the graphs' 3 steps: PipeFusion runs the whole image every step (exact)."""
    return comfy_host.strategy(warmup=3, **degrees)


def apply(positive: list, negative: list, hint: str, strength: float, start: float = 0.0, end: float = 1.0) -> dict:
    return {"class_type": "ControlNetApplyAdvanced",
            "inputs": {"positive": positive, "negative": negative, "control_net": ["30", 0], "image": [hint, 0],
                       "strength": strength, "start_percent": start, "end_percent": end}}


def graph(devices: str = "cpu:1", strat: dict | None = None, chained: bool = False,
          parallel_sampler: bool = False, kontext: bool = False) -> dict:
    """Seeded prompts (1, 2), a 160x128 latent (4), a ControlNet (30) applied with hint 33 at strength 0.8
    (40), and when `chained` again with hint 35 at strength 1.2 for 30%..80% of the schedule (41); the same
    sampling on Load Parallel DiT (11 -> 12 -> 13) and on UNETLoader (20 -> 21 -> 22). `kontext`: the positive
    first gets a 96 x 80 reference latent (ReferenceLatent, 51), as in ComfyUI's Kontext template (the negative
    none)."""
    g = {"1": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 1, "tokens": 8, "guidance": 3.5}},
         "2": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 2, "tokens": 8, "guidance": 3.5}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 1}},
         "10": strat or strategy(),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}},
         "30": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CONTROLNET}}}
    for node, seed, (w, h) in (("32", 7, (96, 80)), ("34", 8, (160, 128))):  # hint latents -> images 33, 35
        g[node] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": seed, "width": w, "height": h}}
        g[str(int(node) + 1)] = {"class_type": "ParaDiTTestLatentToImage", "inputs": {"samples": [node, 0]}}
    positive = ["1", 0]
    if kontext:
        g["50"] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 31, "width": 80, "height": 96}}
        g["51"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": positive, "latent": ["50", 0]}}
        positive = ["51", 0]
    g["40"] = apply(positive, ["2", 0], "33", 0.8)
    final = "40"
    if chained:
        g["41"] = apply(["40", 0], ["40", 1], "35", 1.2, 0.3, 0.8)
        final = "41"
    sampling = {"seed": 5, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": [final, 0], "negative": [final, 1], "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        cls = "ParaDiTSampler" if parallel_sampler and loader == "11" else "KSampler"
        g[sampler] = {"class_type": cls, "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"c/{save}"}}
    return g


REFERENCES: dict[str, torch.Tensor] = {}  # UNETLoader's latents by graph, to show each ControlNet acts


def parity(server, g: dict, what: str) -> float:
    err, par, REFERENCES[what] = latent_parity(server, g, what)
    assert par.shape == (1, 16, 16, 20)
    return err


def test_one_controlnet_equals_unetloader(server):
    assert parity(server, graph(), "one") <= ONE_WORKER_RTOL
    g = graph()
    g["21"]["inputs"].update(positive=["1", 0], negative=["2", 0])  # UNETLoader's chain without the ControlNet
    result = server.run({k: v for k, v in g.items() if k not in ("11", "12", "13")})
    assert result["status"] == "success", explain(result)
    assert rel_err(server.latent(result, "22"), REFERENCES["one"]) > 1e-2  # the ControlNet changes the image


def test_chained_controlnets_with_a_timestep_range_equal_unetloader(server):
    assert parity(server, graph(chained=True), "chained") <= ONE_WORKER_RTOL
    if "one" in REFERENCES:  # the second ControlNet acts too (in its 30%..80% of the schedule)
        assert rel_err(REFERENCES["chained"], REFERENCES["one"]) > 1e-3


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2), strategy(pp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_chained_controlnets_on_two_workers_equal_unetloader(server, strat):
    """PipeFusion with warmup_steps = steps: the whole image every step (exact)."""
    err = parity(server, graph("cpu:2", strat, chained=True), f"2 chained ControlNets, {strat['inputs']}")
    assert err <= EXACT_RTOL


@pytest.mark.parametrize("strat", [strategy(ulysses=2), strategy(pp=2)], ids=["ulysses2", "pp2_warm"])
def test_chained_controlnets_under_parallel_sampler_equal_ksampler(server, strat):
    """Parallel Sampler routes a ControlNet graph to ComfyUI's sampler (KSampler's own code, the ControlNets on the
    workers): KSampler's latent on the same MODEL, and it says why in its summary."""
    g = comfy_host.with_parallel_sampler(graph("cpu:2", strat, chained=True))
    same, unet, summary = comfy_host.entrance_parity(server, g, f"2 ControlNets, Parallel Sampler {strat['inputs']}")
    assert same <= ONE_WORKER_RTOL and unet <= EXACT_RTOL  # the same model calls as KSampler's: round-off at most
    assert "per-call pipeline: the graph has a ControlNet in the positive conditioning" in summary


def union_graph(devices: str = "cpu:1", strat: dict | None = None,
                union_type: str | None = "canny/lineart/anime_lineart/mlsd") -> dict:
    """graph() with an InstantX Union ControlNet as downloaded (diffusers' names; ComfyUI converts it), its hint
    encoded by a seeded stand-in VAE (36) and typed by ComfyUI's own SetUnionControlNetType (31)."""
    g = graph(devices, strat)
    g["30"]["inputs"]["control_net_name"] = comfy_host.FLUX_UNION_CONTROLNET_FILE
    g["36"] = {"class_type": "ParaDiTTestImageVAE", "inputs": {}}
    g["40"]["inputs"]["vae"] = ["36", 0]
    if union_type:
        g["31"] = {"class_type": "SetUnionControlNetType", "inputs": {"control_net": ["30", 0], "type": union_type}}
        g["40"]["inputs"]["control_net"] = ["31", 0]
    return g


def test_union_controlnet_with_a_type_equals_unetloader(server):
    assert parity(server, union_graph(), "union, typed") <= ONE_WORKER_RTOL
    assert parity(server, union_graph(union_type=None), "union, no type") <= ONE_WORKER_RTOL
    assert rel_err(REFERENCES["union, typed"], REFERENCES["union, no type"]) > 1e-3  # the type token acts


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2)],
                         ids=["cfg2", "ulysses2", "ring2"])
def test_union_controlnet_with_a_type_on_two_workers_equals_unetloader(server, strat):
    """The type token lengthens the ControlNet's prompt: its own prompt shards, the DiT's image rows."""
    assert parity(server, union_graph("cpu:2", strat), f"union, typed, {strat['inputs']}") <= EXACT_RTOL


def test_controlnet_with_kontext_references_equals_unetloader(server):
    """ComfyUI's Flux adds the residuals to the image rows, before the reference rows, and its ControlNet never
    sees the references."""
    assert parity(server, graph(chained=True, kontext=True), "kontext") <= ONE_WORKER_RTOL
    if "chained" in REFERENCES:  # the reference latent acts too
        assert rel_err(REFERENCES["kontext"], REFERENCES["chained"]) > 1e-3


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2), strategy(pp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_controlnet_with_kontext_references_on_two_workers_equals_unetloader(server, strat):
    """The reference rows split over the ranks after their image rows; PipeFusion runs the positive (references)
    and the negative (none) in two lanes."""
    err = parity(server, graph("cpu:2", strat, chained=True, kontext=True), f"kontext, {strat['inputs']}")
    assert err <= EXACT_RTOL


def sd3_graph(devices: str = "cpu:1", strat: dict | None = None,
              controlnets: tuple[str, str] = SD3_CONTROLNETS) -> dict:
    """graph(chained=True) on the SD3 file: SD3's conditioning widths (no guidance), the 2-block ControlNet (30) and
    the 1-block one (31) chained (or other `controlnets`), their hints encoded by the stand-in VAE (36), as SD3
    ControlNets need."""
    g = graph(devices, strat, chained=True)
    for node in ("1", "2"):
        g[node]["inputs"].update(width=4096, pooled=2048, guidance=-1.0)
    g["11"]["inputs"]["unet_name"] = g["20"]["inputs"]["unet_name"] = SD3_DIT
    g["30"]["inputs"]["control_net_name"] = controlnets[0]
    g["31"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": controlnets[1]}}
    g["36"] = {"class_type": "ParaDiTTestImageVAE", "inputs": {}}
    g["40"]["inputs"]["vae"] = g["41"]["inputs"]["vae"] = ["36", 0]
    g["41"]["inputs"]["control_net"] = ["31", 0]
    return g


def test_sd3_controlnets_equal_unetloader(server):
    """ComfyUI's comfy.cldm.mmdit ControlNets (converted from diffusers' layout on load), chained, against its MMDiT;
    without them the image differs."""
    assert parity(server, sd3_graph(), "sd3") <= ONE_WORKER_RTOL
    assert rel_err(sd3_without_controlnets(server), REFERENCES["sd3"]) > 1e-2


def sd3_without_controlnets(server) -> torch.Tensor:
    """UNETLoader's latent of sd3_graph without its ControlNets (once per module)."""
    if "sd3, none" not in REFERENCES:
        g = sd3_graph()
        g["21"]["inputs"].update(positive=["1", 0], negative=["2", 0])
        result = server.run({k: v for k, v in g.items() if k not in ("11", "12", "13")})
        REFERENCES["sd3, none"] = server.latent(result, "22")
    return REFERENCES["sd3, none"]


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2), strategy(pp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_sd3_controlnets_on_two_workers_equal_unetloader(server, strat):
    assert parity(server, sd3_graph("cpu:2", strat), f"sd3, {strat['inputs']}") <= EXACT_RTOL


def test_sd35_controlnets_equal_unetloader(server):
    """Stability's SD3.5 ControlNets (ComfyUI's ControlNetSD35, which copies the DiT's x or y embedder in; the
    workers read them from their DiT), a plain one and a "double y" one chained."""
    assert parity(server, sd3_graph(controlnets=SD35_CONTROLNETS), "sd35") <= ONE_WORKER_RTOL
    assert rel_err(sd3_without_controlnets(server), REFERENCES["sd35"]) > 1e-2


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2), strategy(pp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_sd35_controlnets_on_two_workers_equal_unetloader(server, strat):
    assert parity(server, sd3_graph("cpu:2", strat, SD35_CONTROLNETS), f"sd35, {strat['inputs']}") <= EXACT_RTOL
