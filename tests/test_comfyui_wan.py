"""Wan 2.1 text-to-video on the parallel MODEL in a real ComfyUI host (skipped without COMFYUI_DIR): Load Parallel
DiT + KSampler against UNETLoader + KSampler on the same file, where ComfyUI runs its own WanModel.

The file: a random Wan with ComfyUI's detection shape (256 wide = 2 heads of 128, 2 blocks, umT5's 4096-wide
prompt), fp32; the prompt a seeded stand-in for the umT5 encode (no text encoder weights here); the latent
ComfyUI's own EmptyHunyuanLatentVideo, 64x48 px x 17 frames = 5 latent frames, non-square.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import latent_parity, serve  # noqa: E402
from parallel_runtime.models.families.wan import WanConfig  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(900)

WAN = WanConfig(hidden_size=256, num_layers=2, ffn_dim=512, text_dim=4096)
DIT = "wan2.1_t2v_mini.safetensors"
# fp32 on CPU: ComfyUI's WanModel and the workers run the same float32 maths in another op order (~1e-7 per op
# over 2 blocks and 3 steps); exact strategies on 2 workers add their own reordering.
ONE_WORKER_RTOL = 1e-5
EXACT_RTOL = 1e-4


# Image-to-video: 2.1 (36 input channels, CLIP vision through img_emb and k_img / v_img) and 2.2 (36, no CLIP).
WAN21_I2V, WAN22_I2V = (dataclasses.replace(WAN, in_channels=36, image_to_video=clip) for clip in (True, False))
DIT21_I2V, DIT22_I2V = "wan2.1_i2v_mini.safetensors", "wan2.2_i2v_mini.safetensors"
# Wan 2.1 FLF2V 14B's shape: 2.1 I2V's plus img_emb.emb_pos (a position per CLIP token of the start and end images).
WAN21_FLF2V, DIT21_FLF2V = dataclasses.replace(WAN21_I2V, clip_positions=514), "wan2.1_flf2v_mini.safetensors"
# Wan 2.2 14B T2V's two experts: one shape, two files (high noise first, then low noise).
EXPERTS = ("wan2.2_t2v_high_noise_mini.safetensors", "wan2.2_t2v_low_noise_mini.safetensors")
# Wan 2.2 TI2V 5B's shape: 48 latent channels in and out (ComfyUI detects out_dim 48 as WAN22_T2V).
WAN22_TI2V, DIT22_TI2V = dataclasses.replace(WAN, in_channels=48, out_channels=48), "wan2.2_ti2v_mini.safetensors"


# Step-distillation LoRAs as LightX2V ships them for each expert (ComfyUI key names: lora_up / lora_down with an
# alpha, diff_b for biases), on the self- and cross-attention, the MLP and the head.
EXPERT_LORAS = ("wan2.2_lightx2v_high_noise_mini.safetensors", "wan2.2_lightx2v_low_noise_mini.safetensors")


def write_expert_loras(folder: str) -> None:
    from safetensors.torch import save_file

    h, f = WAN.hidden_size, WAN.ffn_dim
    targets = {"blocks.0.self_attn.q": (h, h), "blocks.0.self_attn.o": (h, h), "blocks.1.self_attn.v": (h, h),
               "blocks.0.cross_attn.k": (h, WAN.hidden_size), "blocks.1.ffn.0": (f, h), "blocks.1.ffn.2": (h, f),
               "head.head": (4 * 16, h)}
    os.makedirs(folder, exist_ok=True)
    for seed, name in enumerate(EXPERT_LORAS):
        g = torch.Generator().manual_seed(40 + seed)
        tensors = {}
        for key, (rows, cols) in targets.items():
            tensors[f"diffusion_model.{key}.lora_up.weight"] = torch.randn(rows, 8, generator=g) * 0.05
            tensors[f"diffusion_model.{key}.lora_down.weight"] = torch.randn(8, cols, generator=g) * 0.05
            tensors[f"diffusion_model.{key}.alpha"] = torch.tensor(8.0)
        tensors["diffusion_model.blocks.0.ffn.2.diff_b"] = torch.randn(h, generator=g) * 0.01
        save_file(tensors, os.path.join(folder, name))


def write_models(root: str) -> None:
    write_expert_loras(os.path.join(root, "models", "loras"))
    for name, config, seed in ((DIT, WAN, 1), (DIT21_I2V, WAN21_I2V, 2), (DIT22_I2V, WAN22_I2V, 3),
                               (DIT22_TI2V, WAN22_TI2V, 4), (EXPERTS[0], WAN, 5), (EXPERTS[1], WAN, 6),
                               (DIT21_FLF2V, WAN21_FLF2V, 7)):
        write_checkpoint(os.path.join(root, "models", "diffusion_models", name), config, seed=seed,
                         prefix="model.diffusion_model.", dtype=torch.float32)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-wan-", write_models)


def i2v_graph(dit: str, devices: str = "cpu:1", strat: dict | None = None, clip: bool = True) -> dict:
    """graph() with ComfyUI's own WanImageToVideo (5) between the prompts and the samplers: a grey 64x48 start
    image (EmptyImage), a seeded stand-in for its Wan VAE encode and (clip) for CLIPVisionEncode's tokens."""
    g = graph(devices, strat, dit=dit)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 11}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["5"] = {"class_type": "WanImageToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "start_image": ["31", 0],
                         **({"clip_vision_output": ["30", 1]} if clip else {})}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


def flf2v_graph(devices: str = "cpu:1", strat: dict | None = None) -> dict:
    """graph() on the FLF2V file with ComfyUI's own WanFirstLastFrameToVideo (5): a grey start and a dark end image,
    seeded stand-ins for the VAE encode and for each image's CLIPVisionEncode (the node concatenates the two)."""
    g = graph(devices, strat, dit=DIT21_FLF2V)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 11}}
    g["32"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 13}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 8421504}}
    g["33"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 2105376}}
    g["5"] = {"class_type": "WanFirstLastFrameToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "width": 64, "height": 48,
                         "length": 17, "batch_size": 1, "start_image": ["31", 0], "end_image": ["33", 0],
                         "clip_vision_start_image": ["30", 1], "clip_vision_end_image": ["32", 1]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(positive=["5", 0], negative=["5", 1], latent_image=["5", 2])
    return g


# Two point tracks over the 17 frames of a 64x48 video, as ATI's template draws them (x, y in pixels per frame).
ATI_TRACKS = json.dumps([[{"x": 8 + 2 * i, "y": 10 + i} for i in range(17)],
                         [{"x": 56 - 2 * i, "y": 40 - i // 2} for i in range(17)]])


def ati_graph(devices: str = "cpu:1", strat: dict | None = None) -> dict:
    """i2v_graph() with ComfyUI's own WanTrackToVideo (Wan 2.1 ATI's template) in place of WanImageToVideo: the start
    frame's latent moved along the tracks (patch_motion), under a soft mask, as the model's concat channels."""
    g = i2v_graph(DIT21_I2V, devices, strat)
    g["5"] = {"class_type": "WanTrackToVideo",
              "inputs": {"positive": ["1", 0], "negative": ["2", 0], "vae": ["30", 0], "tracks": ATI_TRACKS,
                         "width": 64, "height": 48, "length": 17, "batch_size": 1, "temperature": 220.0, "topk": 2,
                         "start_image": ["31", 0], "clip_vision_output": ["30", 1]}}
    return g


def graph(devices: str = "cpu:1", strat: dict | None = None, cfg: float = 5.0, dit: str = DIT) -> dict:
    """Seeded prompts (1, 2; 12 and 9 tokens, no pooled vector), EmptyHunyuanLatentVideo (4), the same KSampler
    on Load Parallel DiT (11 -> 12 -> 13) and on UNETLoader (20 -> 21 -> 22)."""
    g = {"1": {"class_type": "ParaDiTTestConditioning",
               "inputs": {"seed": 1, "tokens": 12, "guidance": -1, "width": 4096, "pooled": 0}},
         "2": {"class_type": "ParaDiTTestConditioning",
               "inputs": {"seed": 2, "tokens": 9, "guidance": -1, "width": 4096, "pooled": 0}},
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 48, "length": 17,
                                                                  "batch_size": 1}},
         "10": strat or comfy_host.strategy(warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": dit, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": dit, "weight_dtype": "default"}}}
    sampling = {"seed": 5, "steps": 3, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": ["1", 0], "negative": ["2", 0], "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        g[sampler] = {"class_type": "KSampler", "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"w/{save}"}}
    return g


def ti2v_graph(devices: str = "cpu:1", strat: dict | None = None, start_image: bool = True) -> dict:
    """graph() on the 5B file with ComfyUI's own Wan22ImageToVideoLatent (5) as the latent: 128x96 px x 17 frames =
    5 x 6 x 8 latent; with a start image, its first frame encoded (a seeded stand-in VAE) under a noise mask, so
    KSampler's calls carry per-frame timesteps (WAN22.process_timestep)."""
    g = graph(devices, strat, dit=DIT22_TI2V)
    g["30"] = {"class_type": "ParaDiTTestImageToVideoInputs", "inputs": {"seed": 12, "channels": 48}}
    g["31"] = {"class_type": "EmptyImage", "inputs": {"width": 128, "height": 96, "batch_size": 1, "color": 8421504}}
    g["5"] = {"class_type": "Wan22ImageToVideoLatent",
              "inputs": {"vae": ["30", 0], "width": 128, "height": 96, "length": 17, "batch_size": 1,
                         **({"start_image": ["31", 0]} if start_image else {})}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"]["latent_image"] = ["5", 0]
    return g


def parity(server, g: dict, what: str, channels: int = 16) -> float:
    err, par, _ = latent_parity(server, g, what)
    assert par.shape == (1, channels, 5, 6, 8)
    return err


@pytest.mark.parametrize("cfg", [5.0, 1.0], ids=["cfg5", "cfg1"])
def test_wan_one_worker_equals_unetloader(server, cfg):
    assert parity(server, graph(cfg=cfg), f"Wan T2V, 1 worker, cfg {cfg}") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(cfg=2, warmup=3), comfy_host.strategy(ulysses=2, warmup=3),
                                   comfy_host.strategy(ring=2, warmup=3),
                                   comfy_host.strategy(pp=2, patches=5, warmup=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_wan_exact_strategies_on_two_workers_equal_unetloader(server, strat):
    assert parity(server, graph("cpu:2", strat), f"Wan T2V, {strat['inputs']}") <= EXACT_RTOL


@pytest.mark.parametrize("dit, clip", [(DIT21_I2V, True), (DIT21_I2V, False), (DIT22_I2V, False)],
                         ids=["wan21_clip_vision", "wan21_no_clip", "wan22"])
def test_wan_image_to_video_one_worker_equals_unetloader(server, dit, clip):
    """WanImageToVideo's concat (mask over the first latent frame, start-frame latent) and CLIP-vision tokens,
    built by ComfyUI's own WAN21.concat_cond / extra_conds, ride the model call to the workers."""
    assert parity(server, i2v_graph(dit, clip=clip), f"{dit}, 1 worker, clip {clip}") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(cfg=2, warmup=3), comfy_host.strategy(ulysses=2, warmup=3),
                                   comfy_host.strategy(ring=2, warmup=3),
                                   comfy_host.strategy(pp=2, patches=5, warmup=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_wan_image_to_video_exact_strategies_on_two_workers(server, strat):
    assert parity(server, i2v_graph(DIT21_I2V, "cpu:2", strat), f"Wan 2.1 I2V, {strat['inputs']}") <= EXACT_RTOL


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", comfy_host.strategy(ulysses=2, warmup=3))],
                         ids=["one_worker", "ulysses2"])
def test_wan_first_last_frame_equals_unetloader(server, devices, strat):
    """Wan 2.1 FLF2V: WanFirstLastFrameToVideo's concat (mask over the first and last frames) and both images' CLIP
    tokens (514), each plus the file's learned position, as ComfyUI's WanModel adds them."""
    tolerance = ONE_WORKER_RTOL if strat is None else EXACT_RTOL
    assert parity(server, flf2v_graph(devices, strat), f"Wan 2.1 FLF2V on {devices}") <= tolerance


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", comfy_host.strategy(ulysses=2, warmup=3)),
                                            ("cpu:2", comfy_host.strategy(ring=2, warmup=3))],
                         ids=["one_worker", "ulysses2", "ring2"])
def test_wan_ati_tracks_equal_unetloader(server, devices, strat):
    """Wan 2.1 ATI (an image-to-video file): WanTrackToVideo's motion-patched start latent and soft mask reach the
    workers as the concat channels, split with the video tokens."""
    tolerance = ONE_WORKER_RTOL if strat is None else EXACT_RTOL
    assert parity(server, ati_graph(devices, strat), f"Wan 2.1 ATI on {devices}") <= tolerance


@pytest.mark.parametrize("start_image", [True, False], ids=["ti2v", "t2v"])
def test_wan22_ti2v_one_worker_equals_unetloader(server, start_image):
    """Wan 2.2 5B's own 48-channel latent; image-to-video's per-frame timesteps (the start frame at t = 0)."""
    err = parity(server, ti2v_graph(start_image=start_image), f"Wan 2.2 TI2V, start image {start_image}", 48)
    assert err <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(cfg=2, warmup=3), comfy_host.strategy(ulysses=2, warmup=3),
                                   comfy_host.strategy(ring=2, warmup=3),
                                   comfy_host.strategy(pp=2, patches=5, warmup=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_wan22_ti2v_exact_strategies_on_two_workers(server, strat):
    assert parity(server, ti2v_graph("cpu:2", strat), f"Wan 2.2 TI2V, {strat['inputs']}", 48) <= EXACT_RTOL


def two_experts_graph(devices: str = "cpu:1", strat: dict | None = None, seed: int = 5, loras: bool = False,
                      cfg: float = 3.5) -> dict:
    """ComfyUI's Wan 2.2 14B template shape: each expert through ModelSamplingSD3 (shift 8), two KSamplerAdvanced
    over one 4-step schedule, the high-noise expert on steps 0-2 returning its leftover noise, the low-noise one on
    2-4 adding none; on two Load Parallel DiT (11, 14) and on two UNETLoaders (20, 23)."""
    g = graph(devices, strat)
    for loader in ("11", "20"):
        del g[loader]
    for sampler in ("12", "21"):
        del g[sampler]
    for base, cls in (("11", "ParaDiTLoader"), ("20", "UNETLoader")):
        for k, name in enumerate(EXPERTS):
            node, shifted = str(int(base) + 3 * k), str(int(base) + 3 * k + 1)
            inputs = {"unet_name": name, "weight_dtype": "default"}
            if cls == "ParaDiTLoader":
                inputs.update(devices=devices, strategy=["10", 0])
            g[node] = {"class_type": cls, "inputs": inputs}
            model = [node, 0]
            if loras:  # LoraLoaderModelOnly between the loader and the shift, as the distilled templates chain it
                g[node + "l"] = {"class_type": "LoraLoaderModelOnly",
                                 "inputs": {"model": model, "lora_name": EXPERT_LORAS[k], "strength_model": 1.0}}
                model = [node + "l", 0]
            g[shifted] = {"class_type": "ModelSamplingSD3", "inputs": {"model": model, "shift": 8.0}}
    common = {"noise_seed": seed, "steps": 4, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["1", 0], "negative": ["2", 0]}
    for high, low, first, second, save in (("12", "15", "40", "41", "13"), ("21", "24", "42", "43", "22")):
        g[first] = {"class_type": "KSamplerAdvanced",
                    "inputs": dict(common, model=[high, 0], add_noise="enable", start_at_step=0, end_at_step=2,
                                   return_with_leftover_noise="enable", latent_image=["4", 0])}
        g[second] = {"class_type": "KSamplerAdvanced",
                     "inputs": dict(common, model=[low, 0], add_noise="disable", start_at_step=2, end_at_step=10000,
                                    return_with_leftover_noise="disable", latent_image=[first, 0])}
        g[save]["inputs"]["samples"] = [second, 0]
    return g


def test_wan22_two_experts_equal_unetloader_and_stay_resident(server):
    """The pair at 1 worker, then at 2 workers under Ulysses for two prompts: each expert's file is read once per
    worker set (the second prompt loads nothing) and both stay resident, as the status reports."""
    assert parity(server, two_experts_graph(), "Wan 2.2 two experts, 1 worker") <= ONE_WORKER_RTOL
    strat = comfy_host.strategy(ulysses=2, warmup=3)
    for seed in (5, 6):  # a second prompt: the high-noise expert comes back after the low-noise one
        err = parity(server, two_experts_graph("cpu:2", strat, seed), f"Wan 2.2 two experts, Ulysses-2, seed {seed}")
        assert err <= EXACT_RTOL
    two = [c for c in server.get("/paradit/status")["clients"] if len(c["devices"]) == 2]
    assert len(two) == 1 and two[0]["resident_models"] == [EXPERTS[0], EXPERTS[1]]
    assert two[0]["model_loads"] == 2 and two[0]["residency_note"] is None


@pytest.mark.parametrize("strat", [comfy_host.strategy(ulysses=2, warmup=3), comfy_host.strategy(ring=2, warmup=3)],
                         ids=["ulysses2", "ring2"])
def test_wan22_distilled_two_experts_at_cfg1_equal_unetloader(server, strat):
    """The 4-step distilled graph: a LightX2V-style LoRA on each expert (LoraLoaderModelOnly), cfg 1, so CFG
    parallel has nothing to split and the sequence split carries both workers."""
    from conftest import rel_err

    err, with_loras, _ = latent_parity(server, two_experts_graph("cpu:2", strat, loras=True, cfg=1.0),
                                       f"Wan 2.2 distilled experts at cfg 1, {strat['inputs']}")
    assert err <= EXACT_RTOL
    err, plain, _ = latent_parity(server, two_experts_graph("cpu:2", strat, cfg=1.0), "the same without the LoRAs")
    assert err <= EXACT_RTOL
    assert rel_err(with_loras, plain) > 1e-2  # the LoRAs change the video (deltas ~5% of the weights they touch)


# Parallel Sampler on the same MODEL as KSampler. The workers' own loop (plain text-to-video, a start image's
# concat without CLIP vision) differs from KSampler's per-call run only by where the sampler's float32 update is
# computed (the workers vs the host): round-off, ~1e-7 per step; the graphs routed to ComfyUI's sampler (a noise
# mask, CLIP-vision tokens) run KSampler's own code on the same workers.
ENTRANCE_RTOL = 1e-5
TWO_WORKERS = [("cpu:1", None), ("cpu:2", comfy_host.strategy(cfg=2, warmup=3)),
               ("cpu:2", comfy_host.strategy(ulysses=2, warmup=3)), ("cpu:2", comfy_host.strategy(ring=2, warmup=3)),
               ("cpu:2", comfy_host.strategy(pp=2, patches=5, warmup=3))]
TWO_WORKER_IDS = ["serial", "cfg2", "ulysses2", "ring2", "pp2_warm"]


@pytest.mark.parametrize("devices, strat", TWO_WORKERS, ids=TWO_WORKER_IDS)
def test_wan_t2v_parallel_sampler_equals_ksampler(server, devices, strat):
    g = comfy_host.with_parallel_sampler(graph(devices, strat))
    same, unet, summary = comfy_host.entrance_parity(server, g, f"Wan T2V Parallel Sampler {devices} {strat}")
    assert same <= ENTRANCE_RTOL and unet <= (ONE_WORKER_RTOL if devices == "cpu:1" else EXACT_RTOL)
    assert "per model call" not in summary  # the workers' own step loop: PipeFusion pipelines across steps


@pytest.mark.parametrize("what, g, routed", [
    ("Wan 2.2 TI2V start image (noise mask)", lambda: ti2v_graph("cpu:2", comfy_host.strategy(pp=2, patches=5, warmup=3)),
     "a noise mask"),
    ("Wan 2.2 TI2V text only", lambda: ti2v_graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3),
                                                   start_image=False), None),
    ("Wan 2.1 I2V with CLIP vision", lambda: i2v_graph(DIT21_I2V, "cpu:2", comfy_host.strategy(ring=2, warmup=3)),
     None),
    ("Wan 2.1 I2V with CLIP vision, PipeFusion across steps",
     lambda: i2v_graph(DIT21_I2V, "cpu:2", comfy_host.strategy(pp=2, patches=5, warmup=3)), None),
    ("Wan 2.1 FLF2V (two images' CLIP vision)", lambda: flf2v_graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3)),
     None),
    ("Wan 2.1 I2V without CLIP vision", lambda: i2v_graph(DIT21_I2V, "cpu:2", comfy_host.strategy(cfg=2, warmup=3),
                                                          clip=False), None),
], ids=["ti2v_mask", "ti2v_text", "i2v_clip", "i2v_clip_pp2", "flf2v", "i2v_concat"])
def test_wan_image_to_video_parallel_sampler_equals_ksampler(server, what, g, routed):
    same, unet, summary = comfy_host.entrance_parity(server, comfy_host.with_parallel_sampler(g()), what)
    assert same <= ENTRANCE_RTOL and unet <= EXACT_RTOL
    if routed:
        assert f"per-call pipeline: the graph has {routed}" in summary
    else:
        assert "per model call" not in summary
