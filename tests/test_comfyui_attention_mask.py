"""ComfyUI's attention_mask on the parallel MODEL, in a real ComfyUI host (skipped without COMFYUI_DIR).

The mask comes from ComfyUI's own StyleModelApply with strength_type attn_bias (what Flux Redux graphs use): it
appends the style model's tokens to the prompt and sets an additive bias of log(strength) on them, which the
host's Flux extra_conds upscales to the latent's tokens every call. Each graph runs on Load Parallel DiT and on
UNETLoader with the same stock nodes; ComfyUI's own Flux adds the mask in its attention. The style model and
vision output are seeded stand-ins (tests/comfy_host.py, no Redux or SigCLIP weights here); the mask logic and
the model code are ComfyUI's.
"""
from __future__ import annotations

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import explain, latent_parity, serve  # noqa: E402
from conftest import rel_err  # noqa: E402

pytestmark = pytest.mark.timeout(900)

DIT, CONTROLNET = comfy_host.FLUX_MINI_FILE, comfy_host.FLUX_CONTROLNET_FILE
# fp32 on CPU: ComfyUI's Flux and the workers run the same float32 maths in another op order (~1e-7 per op over
# 2 blocks and 3 steps); exact strategies on 2 workers add their own reordering (Ring's merged partial softmax).
ONE_WORKER_RTOL = 1e-5
EXACT_RTOL = 1e-4


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-mask-", comfy_host.write_flux_mini_and_controlnet)


def style(conditioning: list, seed: int, strength: float, kind: str = "attn_bias") -> list:
    """StyleModelApply (ComfyUI's node) of a seeded style model on `conditioning`: two nodes, ids from seed."""
    return [({"class_type": "ParaDiTTestStyleModel", "inputs": {"seed": seed, "tokens": 4, "width": 4096}}, f"5{seed}"),
            ({"class_type": "StyleModelApply",
              "inputs": {"conditioning": conditioning, "style_model": [f"5{seed}", 0],
                         "clip_vision_output": [f"5{seed}", 1], "strength": strength, "strength_type": kind}},
             f"6{seed}")]


def graph(devices: str = "cpu:1", strat: dict | None = None, styles=((1, 0.5),), kind: str = "attn_bias",
          negative_style: bool = False, controlnet: bool = False, parallel_sampler: bool = False) -> dict:
    """Seeded prompts (1, 2), a 160x128 latent (4); the positive through StyleModelApply once per (seed,
    strength) in `styles` (chained: the second adds its tokens and bias to the first's mask), the negative too
    when `negative_style`; optionally an XLabs ControlNet (30) at strength 0.8 on the result; the same sampling on
    Load Parallel DiT (11 -> 12 -> 13) and on UNETLoader (20 -> 21 -> 22)."""
    g = {"1": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 1, "tokens": 8, "guidance": 3.5}},
         "2": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 2, "tokens": 8, "guidance": 3.5}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 1}},
         "10": strat or comfy_host.strategy(warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}}}
    positive, negative = ["1", 0], ["2", 0]
    for seed, strength in styles:
        for node, node_id in style(positive, seed, strength, kind):
            g[node_id] = node
        positive = [node_id, 0]
    if negative_style:
        for node, node_id in style(negative, 9, 0.3, kind):
            g[node_id] = node
        negative = [node_id, 0]
    if controlnet:
        g["30"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CONTROLNET}}
        g["32"] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 7, "width": 160, "height": 128}}
        g["33"] = {"class_type": "ParaDiTTestLatentToImage", "inputs": {"samples": ["32", 0]}}
        g["40"] = {"class_type": "ControlNetApplyAdvanced",
                   "inputs": {"positive": positive, "negative": negative, "control_net": ["30", 0],
                              "image": ["33", 0], "strength": 0.8, "start_percent": 0.0, "end_percent": 1.0}}
        positive, negative = ["40", 0], ["40", 1]
    sampling = {"seed": 5, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": positive, "negative": negative, "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        cls = "ParaDiTSampler" if parallel_sampler and loader == "11" else "KSampler"
        g[sampler] = {"class_type": cls, "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"m/{save}"}}
    return g


REFERENCES: dict[str, torch.Tensor] = {}  # UNETLoader's latents by graph, to show the mask acts


def parity(server, g: dict, what: str) -> float:
    err, par, REFERENCES[what] = latent_parity(server, g, what)
    assert par.shape == (1, 16, 16, 20)
    return err


def test_one_worker_equals_unetloader_and_the_mask_acts(server):
    assert parity(server, graph(), "attn_bias") <= ONE_WORKER_RTOL
    # The same style tokens without a mask (strength_type multiply at strength 1.0 sets none): another image.
    assert parity(server, graph(kind="multiply", styles=((1, 1.0),)), "no mask") <= ONE_WORKER_RTOL
    assert rel_err(REFERENCES["attn_bias"], REFERENCES["no mask"]) > 1e-3


@pytest.mark.parametrize("strat", [comfy_host.strategy(cfg=2, warmup=3), comfy_host.strategy(ulysses=2, warmup=3),
                                   comfy_host.strategy(ring=2, warmup=3), comfy_host.strategy(pp=2, warmup=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_exact_strategies_with_chained_masks_equal_unetloader(server, strat):
    """Two chained StyleModelApply on the positive (strength 0.5, then 0.2: the second grows the first's mask)
    and one on the negative (0.3), so both CFG branches carry their own mask."""
    g = graph("cpu:2", strat, styles=((1, 0.5), (3, 0.2)), negative_style=True)
    assert parity(server, g, f"chained masks, {strat['inputs']}") <= EXACT_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(warmup=3), comfy_host.strategy(ulysses=2, warmup=3)],
                         ids=["serial", "ulysses2"])
def test_a_mask_with_a_controlnet_equals_unetloader(server, strat):
    """ComfyUI runs the ControlNet without the DiT's mask; so do the workers."""
    g = graph("cpu:2" if strat["inputs"]["ulysses_degree"] > 1 else "cpu:1", strat, controlnet=True)
    assert parity(server, g, f"mask + ControlNet, {strat['inputs']}") <= EXACT_RTOL


def test_strength_zero_is_refused_where_comfyui_samples_nan(server):
    """attn_bias at strength 0 is a -inf bias, which extra_conds' bilinear resize of the mask to the latent's
    tokens turns into NaN: UNETLoader samples a NaN latent; the parallel MODEL says so before sampling."""
    g = graph(styles=((1, 0.0),))
    result = server.run({k: v for k, v in g.items() if k not in ("11", "12", "13")})
    assert result["status"] == "success", explain(result)
    assert not torch.isfinite(server.latent(result, "22")).all()
    result = server.run({k: v for k, v in g.items() if k not in ("20", "21", "22")})
    assert result["status"] == "error", explain(result)
    assert "attention mask holds NaN values (StyleModelApply's attn_bias strength 0" in \
        result["error"]["exception_message"]


def test_parallel_sampler_runs_a_style_mask_as_ksampler_does(server):
    """StyleModelApply's attention mask routes Parallel Sampler to ComfyUI's sampler: KSampler's latent."""
    g = comfy_host.with_parallel_sampler(graph())
    same, unet, summary = comfy_host.entrance_parity(server, g, "style mask, Parallel Sampler")
    assert same <= ONE_WORKER_RTOL and unet <= ONE_WORKER_RTOL
    assert "per-call pipeline: the graph has " in summary
