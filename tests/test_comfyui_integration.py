"""ParaDiT inside a real ComfyUI host: node schemas, parity with KSampler, cancel, error messages, the
headless client script.

Runs only when COMFYUI_DIR names a ComfyUI checkout (the whole module is skipped otherwise, so CI on a
fresh machine passes without one):

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/comfyui-venv/bin/python \\
        python -m pytest tests/test_comfyui_integration.py -q

COMFYUI_PYTHON is the interpreter that runs ComfyUI (default: this one). On a CPU-only machine the
folder ../shared/comfyui-cpu (or COMFYUI_CPU_SHIM) goes on the server's PYTHONPATH; it lets a CUDA-built
torchvision import on CPU torch. The module starts one server with --cpu on a free loopback port, with
its own model, output, input, temp and user folders, and kills its whole process group (ParaDiT's
worker processes included) at the end.

The checkpoint is a random Flux with ComfyUI's detection shape (3072 wide, 24 heads, 4096-wide text,
768-wide pooled vector) and one double and one single block, in fp32. There are no text encoder or VAE
weights, so a test-only node module (written into the temporary custom_nodes folder, never shipped)
makes deterministic CONDITIONING from a seed and turns a latent into a small RGB image.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from comfy_host import PROMPT_TIMEOUT_S, REPO, explain, qw, serve, strategy  # noqa: E402
from conftest import rel_err  # noqa: E402
from parallel_runtime.models.families.chroma import ChromaConfig  # noqa: E402
from parallel_runtime.models.families.flux import FluxConfig  # noqa: E402
from parallel_runtime.models.families.pixart import PixArtConfig  # noqa: E402
from parallel_runtime.models.families.qwen_image import QwenImageConfig  # noqa: E402
from parallel_runtime.models.families.sd3 import SD3Config  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402


pytestmark = pytest.mark.timeout(900)

# ComfyUI's Flux detection fixes the width (3072, 24 heads of 128) and the text width (4096); one double
# and one single block are enough for it to build and run the model.
FLUX_SHAPE = FluxConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=1, num_single_layers=1,
                        context_dim=4096, pooled_dim=768, guidance_embeds=True)
MODEL = "flux-mini.safetensors"
# LoRA files for MODEL in the formats users have, each keyed as its trainer writes it (written before the server
# starts: ComfyUI lists loras once). ComfyUI's loaders map them onto the model's names; the workers apply them.
LORAS = {"bfl": "paradit-lora-bfl.safetensors", "kohya": "paradit-lora-kohya.safetensors",
         "peft": "paradit-lora-peft.safetensors", "lycoris": "paradit-lora-lycoris.safetensors"}


def write_test_loras(folder: str) -> None:
    """Rank-4 LoRAs whose deltas are ~25% of the weights they touch (a visible change)."""
    os.makedirs(folder, exist_ok=True)
    H, M = FLUX_SHAPE.hidden_size, 4 * FLUX_SHAPE.hidden_size
    g = torch.Generator().manual_seed(5)

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    def lora(keys: dict, up: str, down: str, alpha: bool = False) -> dict:
        out = {}
        for name, (rows, cols) in keys.items():
            out[name + up], out[name + down] = rand(rows, 4), rand(4, cols)
            if alpha:
                out[name + ".alpha"] = torch.tensor(2.0)
        return out

    # BFL / ComfyUI's own names (lora_A = down, lora_B = up), with a bias diff.
    bfl = lora({"diffusion_model.double_blocks.0.img_attn.qkv": (3 * H, H),
                "diffusion_model.double_blocks.0.txt_mlp.0": (M, H),
                "diffusion_model.single_blocks.0.linear1": (3 * H + M, H),
                "diffusion_model.single_blocks.0.linear2": (H, H + M),
                "diffusion_model.final_layer.linear": (64, H)}, ".lora_B.weight", ".lora_A.weight")
    bfl["diffusion_model.double_blocks.0.img_attn.proj.diff_b"] = rand(H, scale=0.01)
    # kohya (sd-scripts): lora_unet_ with underscores, lora_up/lora_down and an alpha.
    kohya = lora({"lora_unet_double_blocks_0_img_attn_proj": (H, H), "lora_unet_double_blocks_0_img_mod_lin": (6 * H, H),
                  "lora_unet_single_blocks_0_modulation_lin": (3 * H, H),
                  "lora_unet_double_blocks_0_txt_attn_qkv": (3 * H, H)}, ".lora_up.weight", ".lora_down.weight",
                 alpha=True)
    # diffusers / PEFT: diffusers' names, so q, k, v and the single blocks' MLP land in fused tensors at offsets,
    # and the final norm's (scale, shift) in BFL's (shift, scale) order.
    peft = lora({f"transformer.{k}": v for k, v in {
        "transformer_blocks.0.attn.to_q": (H, H), "transformer_blocks.0.attn.to_k": (H, H),
        "transformer_blocks.0.attn.to_v": (H, H), "transformer_blocks.0.attn.add_v_proj": (H, H),
        "single_transformer_blocks.0.proj_mlp": (M, H), "norm_out.linear": (2 * H, H),
        "x_embedder": (H, 64)}.items()}, ".lora_B.weight", ".lora_A.weight")
    # LyCORIS (SimpleTuner's lycoris_ names): a LoKr on the image MLP, a LoHa on the single block's output.
    lycoris = {"lycoris_transformer_blocks_0_ff_net_0_proj.lokr_w1": rand(4, 4, scale=1.0),
               "lycoris_transformer_blocks_0_ff_net_0_proj.lokr_w2_a": rand(H, 4),
               "lycoris_transformer_blocks_0_ff_net_0_proj.lokr_w2_b": rand(4, H // 4),
               "lycoris_transformer_blocks_0_ff_net_0_proj.alpha": torch.tensor(4.0),
               "lycoris_single_transformer_blocks_0_proj_out.hada_w1_a": rand(H, 4, scale=0.3),
               "lycoris_single_transformer_blocks_0_proj_out.hada_w1_b": rand(4, H + M, scale=0.3),
               "lycoris_single_transformer_blocks_0_proj_out.hada_w2_a": rand(H, 4, scale=0.3),
               "lycoris_single_transformer_blocks_0_proj_out.hada_w2_b": rand(4, H + M, scale=0.3)}
    for kind, tensors in (("bfl", bfl), ("kohya", kohya), ("peft", peft), ("lycoris", lycoris)):
        save_file(tensors, os.path.join(folder, LORAS[kind]))


FP8_MODELS = {"fp8": "flux-mini-fp8.safetensors", "fp8_scaled": "flux-mini-fp8-scaled.safetensors"}


def write_fp8_models(folder: str) -> None:
    """MODEL's matrices in float8_e4m3fn (the rest fp32, as ComfyUI's fp8 releases keep norms and biases), and in
    ComfyUI's scaled-fp8 layout: matrix / scale in fp8, a `scale_weight` per layer, the `scaled_fp8` marker."""
    from safetensors.torch import load_file

    base = load_file(os.path.join(folder, MODEL))
    g = torch.Generator().manual_seed(8)
    plain, scaled = {}, {"model.diffusion_model.scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, t in base.items():
        if key.endswith(".weight") and t.ndim == 2:
            scale = torch.rand((), generator=g) * 0.5 + 0.75
            plain[key] = t.to(torch.float8_e4m3fn)
            scaled[key], scaled[key[:-len("weight")] + "scale_weight"] = (t / scale).to(torch.float8_e4m3fn), scale
        else:
            plain[key] = scaled[key] = t
    save_file(plain, os.path.join(folder, FP8_MODELS["fp8"]))
    save_file(scaled, os.path.join(folder, FP8_MODELS["fp8_scaled"]))


GGUF_MODEL, GGUF_TWIN = "flux-mini-mixed.gguf", "flux-mini-gguf-fp32.safetensors"


def write_gguf_model(folder: str) -> None:
    """MODEL as a GGUF file the way ComfyUI-GGUF's converter writes one (original keys without prefix, shapes
    reversed, 1-D tensors F32), its matrices in a mix of block formats gguf quantizes (Q8_0, Q5_1, Q4_0) and one
    in Q6_K; plus the fp32 twin holding the values ComfyUI-GGUF dequantizes them to (fp16 block arithmetic), for
    UNETLoader."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from parallel_runtime.weights.gguf_file import dequantize_blocks

    prefix = "model.diffusion_model."
    base = load_file(os.path.join(folder, MODEL))
    writer = gguf.GGUFWriter(os.path.join(folder, GGUF_MODEL), arch="flux")
    formats, twin = [T.Q8_0, T.Q5_1, T.Q4_0], {}
    for i, (key, t) in enumerate(sorted(base.items())):
        name, array = key[len(prefix):], t.numpy()
        if key.endswith("single_blocks.0.linear2.weight"):  # gguf cannot quantize K-formats: craft the blocks
            rng = np.random.default_rng(0)
            raw = rng.integers(0, 256, size=(t.numel() // 256, 210), dtype=np.uint8)
            raw[:, 208:210] = (rng.uniform(0.5, 1, (raw.shape[0], 1)) * 2e-5).astype(np.float16).view(np.uint8)
            raw, qtype = raw.reshape(t.shape[0], -1), T.Q6_K
        elif t.ndim == 2 and key.endswith(".weight"):
            qtype = formats[i % len(formats)]
            raw = quantize(array, qtype)
        else:
            writer.add_tensor(name, array)
            twin[key] = t
            continue
        writer.add_tensor(name, raw, raw_dtype=qtype)
        twin[key] = dequantize_blocks(torch.from_numpy(raw), qtype.name, tuple(t.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(twin, os.path.join(folder, GGUF_TWIN))


# ComfyUI's own quantized layouts (comfy_quant), written with comfy-kitchen; this ComfyUI snapshot (late 2025) predates
# them, so each is compared with UNETLoader on the fp32 file of the values comfy-kitchen dequantizes them to.
# "-header" files list their layers in the safetensors header's _quantization_metadata instead.
COMFY_QUANT = {"nvfp4": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}),
               "nvfp4-header": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}),
               "int8_convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256},
                                {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}),
               "int8_tensorwise": ("TensorWiseINT8Layout", {}, {"format": "int8_tensorwise"}),
               "fp8mixed": ("TensorCoreFP8Layout", {}, {"format": "float8_e4m3fn"}),
               "mxfp8": ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"})}


def write_comfy_quant_models(folder: str) -> None:
    """MODEL with every block matrix in a ComfyUI quantized layout (a .comfy_quant JSON tensor per layer; the
    embedders and final layer stay bf16: a "mixed" file), and the fp32 twin of its values, per format."""
    import json

    from safetensors.torch import load_file

    try:
        from comfy_kitchen.tensor import QuantizedTensor
    except ImportError:
        return  # the tests that need these files skip
    base = load_file(os.path.join(folder, MODEL))
    for fmt, (layout, options, conf) in COMFY_QUANT.items():
        quant, twin, layers = {}, {}, {}
        for key, t in base.items():
            if "blocks." in key and key.endswith(".weight") and t.ndim == 2:
                qt = QuantizedTensor.from_float(t, layout, **options)
                quant.update(qt.state_dict(key))
                layers[key[: -len(".weight")]] = conf
                if not fmt.endswith("-header"):
                    quant[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()),
                                                                                dtype=torch.uint8)
                twin[key] = qt.dequantize().float()
            else:
                quant[key] = t.to(torch.bfloat16) if t.ndim == 2 else t
                twin[key] = quant[key].float()
        header = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
        save_file(quant, os.path.join(folder, f"flux-mini-{fmt}.safetensors"),
                  metadata=header if fmt.endswith("-header") else None)
        save_file(twin, os.path.join(folder, f"flux-mini-{fmt}-fp32.safetensors"))


NOT_FLUX = "not-flux-vae.safetensors"

# KSampler vs Parallel Sampler: both run in fp32 on CPU (ComfyUI picks fp32 for Flux on CPU and the file
# is fp32; the workers' "default" dtype is fp32 on CPU), with the same noise, sigmas, guidance and
# sampler updates. What is left is round-off between ComfyUI's Flux implementation and diffusers'
# FluxTransformer2DModel (different op order, fused vs split projections, attention kernels): ~1e-7
# relative per op, measured 1.6e-7 to 5.6e-7 over 4-5 steps. 1e-5 leaves a wide margin while a real
# mismatch (sigma shift, noise, guidance, RoPE, latent scaling) shows up at 1e-2 or more.
KSAMPLER_RTOL = 1e-5
# The same comparison with both sides in bf16 (8 significant bits: one rounding ~ 2^-8 = 3.9e-3 relative).
# The two Flux implementations round at different points (fused vs split q/k/v, where norms and modulation
# return to bf16, attention kernels), so an op's output differs by about one bf16 rounding now and then.
# Measured 2.6e-3 (euler, cfg 1, 4 steps) and 8.5e-3 (dpmpp_2m, cfg 2, 5 steps: CFG and the 2M extrapolation
# amplify differences). 2e-2 leaves over 2x margin; the mismatches this guards against are larger: a timestep
# rounded to bf16 before its x1000 gave 3.7e-2, a guidance kept in fp32 (ComfyUI rounds it) 1.0e-1.
KSAMPLER_BF16_RTOL = 2e-2
# Exact strategies on 2 workers vs 1 worker: the runtime's own fp32 parity bound (tests/test_parallel.py).
EXACT_RTOL = 1e-4



@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-", write_models)


def write_models(root: str) -> None:
    """MODEL and its twins in every file kind, LoRAs, and a VAE-like file that is not a DiT."""
    models = os.path.join(root, "models", "diffusion_models")
    write_checkpoint(os.path.join(models, MODEL), FLUX_SHAPE, seed=0, prefix="model.diffusion_model.",
                     dtype=torch.float32)
    write_test_loras(os.path.join(root, "models", "loras"))
    write_fp8_models(models)
    write_gguf_model(models)
    write_comfy_quant_models(models)
    save_file({"encoder.conv_in.weight": torch.zeros(128, 3, 3, 3),  # a VAE-like file, not a DiT
               "decoder.conv_in.weight": torch.zeros(512, 16, 3, 3)}, os.path.join(models, NOT_FLUX))


# ---------------------------------------------------------------------------------------------------
# Graphs (API format).

def cond(seed: int, tokens: int = 8, guidance: float = 3.5) -> dict:
    return {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": seed, "tokens": tokens, "guidance": guidance}}


def sampling(seed=5, steps=4, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0) -> dict:
    return dict(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler, denoise=denoise)


def parallel_graph(devices="cpu:1", strat=None, size=128, unet=MODEL, tag="p", weight_dtype="default", **kw) -> dict:
    """Conditioning (1: positive, 2: negative) -> Strategy (10) -> Load Parallel DiT (11) -> Parallel Sampler (12) -> Save Latent (13)."""
    return {
        "1": cond(1), "2": cond(2),
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "10": strat or strategy(),
        "11": {"class_type": "ParaDiTLoader",
               "inputs": {"unet_name": unet, "weight_dtype": weight_dtype, "devices": devices, "strategy": ["10", 0]}},
        "12": {"class_type": "ParaDiTSampler",
               "inputs": {"model": ["11", 0], **sampling(**kw), "positive": ["1", 0], "negative": ["2", 0],
                          "latent_image": ["4", 0]}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["12", 0], "filename_prefix": f"latents/{tag}"}},
    }


def with_ksampler(graph: dict, compute_dtype: str | None = None, **kw) -> dict:
    """Adds UNETLoader (20) -> KSampler (21) -> Save Latent (22) on the same file, conditioning and latent.
    `compute_dtype` inserts ComfyUI's ModelComputeDtype node (23) between them."""
    graph = dict(graph)
    graph["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}}
    model = ["20", 0]
    if compute_dtype is not None:
        graph["23"] = {"class_type": "ModelComputeDtype", "inputs": {"model": model, "dtype": compute_dtype}}
        model = ["23", 0]
    graph["21"] = {"class_type": "KSampler",
                   "inputs": {"model": model, **sampling(**kw), "positive": ["1", 0], "negative": ["2", 0],
                              "latent_image": ["4", 0]}}
    graph["22"] = {"class_type": "SaveLatent", "inputs": {"samples": ["21", 0], "filename_prefix": "latents/ksampler"}}
    return graph




def stock_graph(devices="cpu:1", strat=None, size=128, sampler="KSampler", batch=2, **kw) -> dict:
    """Load Parallel DiT's MODEL (11) into ComfyUI's own KSampler (12) beside UNETLoader + KSampler (20-22) on the
    same file, conditioning and latent (non-square, batch 2)."""
    graph = with_ksampler(parallel_graph(devices=devices, strat=strat, size=size, tag="stock", **kw), **kw)
    graph["4"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": size + 32, "height": size,
                                                                  "batch_size": batch}}
    graph["12"] = {"class_type": sampler, "inputs": dict(graph["21"]["inputs"], model=["11", 0])}
    return graph


# ---------------------------------------------------------------------------------------------------
# (a) What ComfyUI sees.

EXPECTED_INPUTS = {
    "ParaDiTStrategy": {"required": ["mode", "cfg_degree", "pipefusion_degree", "ulysses_degree", "ring_degree",
                                     "num_pipeline_patch", "warmup_steps"],
                        "optional": ["tensor_degree", "patch_degree", "device_weights", "shard_weights", "p2p",
                                     "batch_degree", "cache", "cache_threshold", "cache_start", "cache_end"]},
    "ParaDiTLoader": {"required": ["unet_name", "weight_dtype", "devices"],
                      "optional": ["strategy", "quantized_matmul"]},
    "ParaDiTSampler": {"required": ["model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive",
                                    "negative", "latent_image", "denoise"]},
}


def test_object_info_lists_the_three_nodes(server):
    info = server.get("/object_info")
    for name, order in EXPECTED_INPUTS.items():
        assert name in info, f"{name} missing from /object_info; the plugin did not load:\n{server.log_tail()}"
        node = info[name]
        assert {k: v for k, v in node["input_order"].items() if k != "hidden"} == order
        assert node["category"] == "ParaDiT"
    strat, loader, samp = (info[n] for n in EXPECTED_INPUTS)
    assert strat["display_name"] == "Strategy Selector" and strat["output"] == ["PARADIT_STRATEGY"]
    assert strat["input"]["required"]["mode"][1]["options"] == ["auto", "manual"]
    assert loader["display_name"] == "Load Parallel DiT" and loader["output"] == ["MODEL"]
    assert MODEL in loader["input"]["required"]["unet_name"][1]["options"]
    assert loader["input"]["required"]["weight_dtype"][1]["options"] == ["default", "bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2"]
    assert loader["input"]["optional"]["strategy"][0] == "PARADIT_STRATEGY"
    assert samp["display_name"] == "Parallel Sampler" and samp["output"] == ["LATENT"]
    req = samp["input"]["required"]
    assert req["model"][0] == "MODEL" and req["latent_image"][0] == "LATENT"
    assert req["positive"][0] == req["negative"][0] == "CONDITIONING"
    assert req["seed"][1].get("control_after_generate") is True
    # Same widgets as KSampler, with KSampler's own sampler and scheduler lists (those the workers' step loop lacks
    # run through ComfyUI's sampler: nodes/route.py).
    ks = info["KSampler"]["input"]["required"]
    assert req["sampler_name"][1]["options"] == ks["sampler_name"][0]
    assert req["scheduler"][1]["options"] == ks["scheduler"][0]


def test_workflows_are_served_as_templates(server):
    names = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(REPO, "workflows"))
                   if f.endswith(".json"))
    assert names, "no example workflows"
    listed = server.get("/workflow_templates")
    assert sorted(listed.get("ParaDiT", [])) == names  # API twins in api/ are not templates
    served = json.loads(server.get_bytes(f"/api/workflow_templates/ParaDiT/{names[0]}.json"))
    with open(os.path.join(REPO, "workflows", f"{names[0]}.json")) as f:
        assert served == json.load(f)


def test_example_api_workflow_passes_validation_except_missing_models(server):
    """The shipped API graph is accepted by ComfyUI's validator, apart from model files this host lacks."""
    graph = qw.load_workflow(os.path.join(REPO, "workflows", "api", "flux_dev_ulysses.json"))
    result = server.run(graph)
    assert result["status"] == "rejected"
    errors = result["error"].get("node_errors", {})
    for nid, node_error in errors.items():
        assert node_error["class_type"] in ("DualCLIPLoader", "VAELoader"), (nid, node_error)
        assert all(e["type"] == "value_not_in_list" for e in node_error["errors"]), node_error


# ---------------------------------------------------------------------------------------------------
# (b) Same picture as KSampler.

@pytest.fixture(scope="module")
def reference(server):
    """KSampler and Parallel Sampler (cpu:1) on the same file, conditioning, seed and settings, cfg 1."""
    t0 = time.monotonic()
    result = server.run(with_ksampler(parallel_graph(tag="ref")))
    elapsed = time.monotonic() - t0
    print(f"\nreference prompt (UNETLoader+KSampler and ParaDiT cpu:1, 4 steps, first load): {elapsed:.1f} s")
    return server.latent(result, "22"), server.latent(result, "13")


def test_same_picture_as_ksampler(reference):
    ks, par = reference
    assert ks.shape == par.shape == (1, 16, 16, 16)
    err = rel_err(par, ks)
    print(f"\nKSampler vs Parallel Sampler cpu:1, cfg 1, euler/simple: rel. L2 error {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("kw", [
    dict(cfg=2.5),  # true CFG with a negative prompt (seed 2 conditioning)
    dict(cfg=1.0, sampler_name="euler_ancestral", scheduler="normal", denoise=0.75, steps=4),
    dict(cfg=2.0, sampler_name="dpmpp_2m", scheduler="beta", steps=5, seed=9),
], ids=["cfg2.5-negative", "euler_a-normal-denoise0.75", "dpmpp_2m-beta-cfg2"])
def test_same_picture_as_ksampler_other_settings(server, kw):
    result = server.run(with_ksampler(parallel_graph(tag="kw", **kw), **kw))
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\nKSampler vs Parallel Sampler cpu:1, {kw}: rel. L2 error {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("kw", [
    dict(cfg=1.0),
    dict(cfg=2.0, sampler_name="dpmpp_2m", scheduler="beta", steps=5, seed=9),
], ids=["euler-simple-cfg1", "dpmpp_2m-beta-cfg2"])
def test_same_picture_as_ksampler_in_bf16(server, reference, kw):
    """Both in bf16 on the same fp32 file: ParaDiT with weight_dtype bf16, KSampler behind ComfyUI's own
    ModelComputeDtype node (on CPU ComfyUI otherwise upcasts bf16 weights to fp32; this makes it compute in
    bf16, as it does by default on a bf16 GPU)."""
    result = server.run(with_ksampler(parallel_graph(tag="bf16", weight_dtype="bf16", **kw), compute_dtype="bf16", **kw))
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    err = rel_err(par, ks)
    # For scale: how far bf16 moves KSampler itself from its fp32 result (the reference prompt's settings).
    scale = f" (KSampler bf16 vs fp32: {rel_err(ks, reference[0]):.2e})" if kw == dict(cfg=1.0) else ""
    print(f"\nKSampler bf16 vs Parallel Sampler bf16, {kw}: rel. L2 error {err:.2e}{scale}")
    assert err <= KSAMPLER_BF16_RTOL


@pytest.mark.parametrize("strat,cfg", [
    (strategy(ulysses=2), 1.0),
    (strategy(ring=2), 1.0),
    (strategy(pp=2, warmup=4), 1.0),  # PipeFusion is exact while every step is a warmup step
    (strategy(cfg=2), 2.5),
], ids=["ulysses2", "ring2", "pipefusion2-warmup4", "cfg2"])
def test_two_workers_match_one(server, reference, strat, cfg):
    if cfg == 1.0:
        one = reference[1]
    else:
        one = server.latent(server.run(parallel_graph(tag="one", cfg=cfg)), "13")
    t0 = time.monotonic()
    result = server.run(parallel_graph(devices="cpu:2", strat=strat, tag="two", cfg=cfg))
    elapsed = time.monotonic() - t0
    err = rel_err(server.latent(result, "13"), one)
    print(f"\n{strat['inputs']} cpu:2 vs cpu:1: rel. L2 error {err:.2e} ({elapsed:.1f} s)")
    assert err <= EXACT_RTOL


def test_auto_strategy_runs_and_shows_its_choice(server):
    """mode auto (as in workflows/flux_dev_auto.json): the runtime picks, the Strategy Selector says what."""
    texts = []

    def on_message(msg):
        if msg.get("type") == "progress_text" and msg["data"]["node"] == "10":
            texts.append(msg["data"]["text"])

    t0 = time.monotonic()
    result = server.run(parallel_graph(devices="cpu:2", strat=strategy(mode="auto"), tag="auto", seed=31),
                        on_message=on_message)
    elapsed = time.monotonic() - t0
    assert result["status"] == "success", explain(result)
    chosen = [t for t in texts if t.startswith("auto: ")]
    assert chosen, texts
    print(f"\nauto on cpu:2 ({elapsed:.1f} s): {chosen[-1]!r}")
    label = chosen[-1].split()[1]
    if not label.startswith("pp"):  # an exact strategy: same latent as one worker
        one = server.latent(server.run(parallel_graph(tag="auto1", seed=31)), "13")
        assert rel_err(server.latent(result, "13"), one) <= EXACT_RTOL


# ---------------------------------------------------------------------------------------------------
# (c) Cancel.

def test_interrupt_stops_the_job_and_the_next_prompt_runs(server):
    marks = {}

    def on_message(msg):
        if msg.get("type") == "progress" and msg["data"].get("node") == "12" and "interrupt" not in marks:
            marks["interrupt"] = time.monotonic()
            marks["step"] = msg["data"]["value"]
            qw.http_json(server.url + "/interrupt", {})

    long_graph = parallel_graph(devices="cpu:2", strat=strategy(ulysses=2), tag="long", steps=500, seed=77)
    result = server.run(long_graph, on_message=on_message)
    ended = time.monotonic()
    assert "interrupt" in marks, "no progress message arrived before the prompt ended"
    assert result["status"] == "interrupted", explain(result)
    print(f"\ninterrupt at step {marks['step']}/500 -> prompt ended {ended - marks['interrupt']:.2f} s later")
    assert ended - marks["interrupt"] < 10.0
    assert marks["step"] < 50
    assert server.proc.poll() is None

    # The same server and workers take the next prompt; its result is the one a fresh run gives.
    t0 = time.monotonic()
    after = server.run(parallel_graph(devices="cpu:2", strat=strategy(ulysses=2), tag="after", steps=3, seed=78))
    assert after["status"] == "success", explain(after)
    assert time.monotonic() - t0 < 60
    again = server.run(parallel_graph(devices="cpu:2", strat=strategy(ring=2), tag="again", steps=3, seed=78))
    assert rel_err(server.latent(after, "13"), server.latent(again, "13")) <= EXACT_RTOL


# ---------------------------------------------------------------------------------------------------
# (d) Bad inputs fail the prompt with the runtime's one-sentence message, quickly.

@pytest.mark.parametrize("graph_kw,expect_type,expect_text", [
    (dict(devices="cpu:2", strat=strategy(ulysses=3)), "ConfigError",
     "= 3 ranks, but the loader has 2 device(s); choose degrees whose product is 2"),
    (dict(devices="cpu:2", strat=strategy(ulysses=2), size=16), "ConfigError",
     "are fewer than the 2 ranks splitting them"),
    (dict(devices="cpu:2", strat=strategy(pp=2, patches=16), size=48), "ConfigError",
     "num_pipeline_patch=16 exceeds the latent's 9 image tokens"),
    (dict(devices="cpu:2", strat=strategy(ring=2, weights="3;2")), "ConfigError",
     "device_weights '3;2' is not understood"),
    (dict(devices="cpu:1", strat=strategy(cfg=2)), "ConfigError", "= 2 ranks, but the loader has 1 device(s)"),
    (dict(devices="cpu:1", unet=NOT_FLUX), "ModelFileError", "is not a DiT checkpoint ParaDiT runs"),
    (dict(devices="cpu:two"), "ConfigError", "devices 'cpu:two' is not understood"),
], ids=["ulysses3-on-2", "16px-ulysses2", "48px-pipefusion-patches", "bad-weights", "cfg2-on-1", "not-flux-file",
        "bad-devices"])
def test_bad_inputs_fail_with_one_sentence(server, graph_kw, expect_type, expect_text):
    t0 = time.monotonic()
    result = server.run(parallel_graph(tag="bad", **graph_kw), timeout=120)
    elapsed = time.monotonic() - t0
    assert result["status"] == "error", explain(result)
    err = result["error"]
    message = err["exception_message"].strip()
    assert err["exception_type"].endswith(expect_type), err["exception_type"]
    assert expect_text in message, message
    assert "\n" not in message and message.endswith(".") and "Traceback" not in message, message
    assert elapsed < 30, f"took {elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------------
# (e) The headless client script, as a user would run it.

def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and zlib.crc32(data[12:16 + length]) == struct.unpack(">I", data[16 + length:20 + length])[0]
    return struct.unpack(">II", data[16:24])


def test_queue_workflow_script_runs_an_example_workflow(server, tmp_path):
    """workflows/api/flux_dev_ulysses.json with the text encoders and VAE swapped for test nodes."""
    graph = qw.load_workflow(os.path.join(REPO, "workflows", "api", "flux_dev_ulysses.json"))
    by_type = {n["class_type"]: nid for nid, n in graph.items()}
    sampler = graph[by_type["ParaDiTSampler"]]
    for nid in [nid for nid, n in graph.items()
                if n["class_type"] in ("DualCLIPLoader", "CLIPTextEncode", "FluxGuidance", "ConditioningZeroOut",
                                       "VAELoader", "VAEDecode")]:
        del graph[nid]
    graph["100"], graph["101"] = cond(1), cond(2)
    graph["102"] = {"class_type": "ParaDiTTestLatentToImage", "inputs": {"samples": [by_type["ParaDiTSampler"], 0]}}
    sampler["inputs"]["positive"], sampler["inputs"]["negative"] = ["100", 0], ["101", 0]
    graph[by_type["SaveImage"]]["inputs"]["images"] = ["102", 0]
    workflow = tmp_path / "workflow_api.json"
    workflow.write_text(json.dumps(graph))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "queue_workflow.py"), "--server", server.address,
           "--workflow", str(workflow), "--out", str(out), "--timeout", str(PROMPT_TIMEOUT_S),
           "--set", f"ParaDiTLoader.unet_name={MODEL}", "--set", "ParaDiTLoader.devices=cpu:2",
           "--set", "Strategy Selector.ulysses_degree=2",
           "--set", "EmptySD3LatentImage.width=128", "--set", "EmptySD3LatentImage.height=128",
           "--set", "ParaDiTSampler.steps=3", "--set", "ParaDiTSampler.seed=1234"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROMPT_TIMEOUT_S + 60)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3" in proc.stdout and "ParaDiT done, ulysses2 on 2 worker(s)" in proc.stdout
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 1 and _png_size(str(pngs[0])) == (128, 128)

    # A bad override is refused before anything is queued, with the fix.
    bad = subprocess.run(cmd[:-2] + ["--set", "ParaDiTSampler.sed=1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "has no input 'sed'" in bad.stderr
    # A UI-format file is converted with the server's /object_info and queued; this server rejects it only for
    # the model files it lacks (the conversion itself is tests/test_ui_workflow.py's).
    ui = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "queue_workflow.py"), "--server",
                         server.address, "--workflow", os.path.join(REPO, "workflows", "flux_dev_ulysses.json")],
                        capture_output=True, text=True, timeout=60)
    said = ui.stdout + ui.stderr
    # The text encoders' and the VAE's files (this snapshot does not check V3 combos such as unet_name).
    assert ui.returncode == 2 and "UI-format" in ui.stderr and "clip_l.safetensors" in said and "ae.safetensors" in said


# ---------------------------------------------------------------------------------------------------
# (g) The other families: Parallel Sampler at one worker = UNETLoader + KSampler on the same file, at a
# non-square size and batch 2. Each file has the widths ComfyUI's detection fixes for its family (only the
# block counts are small), so ComfyUI builds its own model class from it.

FAMILY_FILES = {
    # ComfyUI hard-codes Chroma's widths: 3072 (24 heads of 128), T5 4096, approximator 5120 x 5 layers.
    "chroma": (ChromaConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=1, num_single_layers=1),
               dict(width=4096, pooled=0)),
    # ComfyUI reads SD3's widths from shapes but builds hidden/64 joint blocks: 128 wide = 2 blocks of 2 heads.
    "sd3": (SD3Config(hidden_size=128, num_layers=2, pos_embed_max_size=16), dict(width=4096, pooled=2048)),
    # SD3.5 Medium-like: the image-only second attention in blocks 0 and 1 of 3.
    "sd35_medium": (SD3Config(hidden_size=192, num_layers=3, pos_embed_max_size=16, dual_attention_layers=(0, 1)),
                    dict(width=4096, pooled=2048)),
    # ComfyUI hard-codes Qwen-Image's widths too: 3072 (24 heads of 128), Qwen2.5-VL text 3584; one block.
    "qwen_image": (QwenImageConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=1),
                   dict(width=3584, pooled=0)),
    # ComfyUI hard-codes PixArt's 1152 width (16 heads of 72); α has the size/aspect embedders, and its stored
    # position table (64 x 64 rows) pins pe_interpolation 2; Σ has neither, so both follow the image size.
    "pixart_alpha": (PixArtConfig(hidden_size=1152, num_layers=1, micro_condition=True, pe_interpolation=2),
                     dict(width=4096, pooled=0)),
    "pixart_sigma": (PixArtConfig(hidden_size=1152, num_layers=1, micro_condition=False), dict(width=4096, pooled=0)),
}
# Families whose latent format is a video VAE's: KSampler returns their image latents as [B, C, 1, H, W].
FRAME_AXIS = {"qwen_image"}
# SD1.5/SDXL-latent families take Empty Latent Image's 4 channels, at 320 x 256 px: PixArt's position grid
# scales to a base of (h + w) / 2 latent px rounded to 64, which is 0 (all rows alike) below 256 px.
FOUR_CHANNELS = {"pixart_alpha", "pixart_sigma"}


@pytest.fixture(scope="module")
def family_file(server, request):
    name = request.param
    config, cond_kw = FAMILY_FILES[name]
    filename = f"{name}-mini.safetensors"
    write_checkpoint(os.path.join(server.root, "models", "diffusion_models", filename), config, seed=0,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    return name, filename, cond_kw


def family_graph(filename: str, cond_kw: dict, guidance: float = -1.0, **kw) -> dict:
    """parallel_graph + with_ksampler for another family's file: 160 x 128 px (20 x 16 latent), batch 2."""
    graph = with_ksampler(parallel_graph(unet=filename, tag=f"fam-{filename}", **kw), **kw)
    graph["20"]["inputs"]["unet_name"] = filename
    graph["1"] = {"class_type": "ParaDiTTestConditioning",
                  "inputs": {"seed": 1, "tokens": 7, "guidance": guidance, **cond_kw}}
    graph["2"] = {"class_type": "ParaDiTTestConditioning",
                  "inputs": {"seed": 2, "tokens": 5, "guidance": -1.0, **cond_kw}}
    graph["4"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 2}}
    return graph


def expected_shape(name: str) -> tuple[int, ...]:
    if name in FOUR_CHANNELS:
        return (2, 4, 32, 40)
    return (2, 16, 1, 16, 20) if name in FRAME_AXIS else (2, 16, 16, 20)


@pytest.mark.parametrize("family_file", list(FAMILY_FILES), indirect=True)
@pytest.mark.parametrize("kw", [
    dict(cfg=1.0),
    dict(cfg=2.0, sampler_name="dpmpp_2m", scheduler="beta", steps=5, seed=9, guidance=2.5),
    dict(cfg=1.5, sampler_name="euler_ancestral", scheduler="normal", steps=4, seed=4),
], ids=["euler-simple-cfg1", "dpmpp_2m-beta-cfg2-guidance", "euler_a-normal-cfg1.5"])
def test_family_same_latent_as_ksampler(server, family_file, kw):
    name, filename, cond_kw = family_file
    kw = dict(kw)
    guidance = kw.pop("guidance", -1.0)
    t0 = time.monotonic()
    graph = family_graph(filename, cond_kw, guidance, **kw)
    if name in FOUR_CHANNELS:
        graph["4"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 320, "height": 256, "batch_size": 2}}
    result = server.run(graph)
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    err = rel_err(par, ks)
    print(f"\n{name}: KSampler vs Parallel Sampler cpu:1, {kw}, guidance {guidance}: rel. L2 error {err:.2e} "
          f"({time.monotonic() - t0:.1f} s)")
    assert ks.shape == par.shape == expected_shape(name)
    assert rel_err(ks[0], ks[1]) > 0.05  # the batch items really differ
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("family_file", ["pixart_alpha"], indirect=True)
def test_pixart_alpha_size_conditioning_same_latent_as_ksampler(server, family_file):
    """CLIPTextEncodePixArtAlpha's width and height (here on the helper node, as its add_dict sets them) feed
    PixArt-α's size and aspect embeddings instead of the latent's size: 1024 x 768 on the positive, 512 x 512 on
    the negative, for a 320 x 256 image. The result must equal KSampler's, and differ from the latent-size run."""
    name, filename, cond_kw = family_file
    latent = {"class_type": "EmptyLatentImage", "inputs": {"width": 320, "height": 256, "batch_size": 2}}
    graph = family_graph(filename, cond_kw, cfg=2.0, steps=3)
    graph["4"] = latent
    graph["1"]["inputs"].update(image_width=1024, image_height=768)
    graph["2"]["inputs"].update(image_width=512, image_height=512)
    result = server.run(graph)
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    plain = family_graph(filename, cond_kw, cfg=2.0, steps=3)
    plain["4"] = latent
    base = server.latent(server.run(plain), "13")
    err = rel_err(par, ks)
    print(f"\n{name} with size conditioning: KSampler vs Parallel Sampler rel. L2 {err:.2e}; vs the latent's "
          f"size {rel_err(par, base):.2e}")
    assert err <= KSAMPLER_RTOL
    assert rel_err(par, base) > 1e-3  # the sizes really reach the model


# ---------------------------------------------------------------------------------------------------
# (h) Flux Kontext: ComfyUI's ReferenceLatent (chained for two references) and
# FluxKontextMultiReferenceLatentMethod on the Flux file; the negative carries no reference, as in
# ComfyUI's Kontext template (ConditioningZeroOut before ReferenceLatent).

def kontext_graph(method: str | None, family: tuple | None = None, devices: str = "cpu:1", strat=None,
                  **kw) -> dict:
    """parallel_graph + with_ksampler at 160 x 128, batch 2, the positive with a 96 x 80 and a 72 x 112
    reference (the second has odd latent sides: ComfyUI pads it circularly). `family`: another family's
    (name, file, conditioning widths) from family_file, else the Flux file (Kontext)."""
    if family is None:
        graph = with_ksampler(parallel_graph(devices=devices, strat=strat, tag=f"kontext-{method}", **kw), **kw)
        graph["4"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 2}}
    else:
        graph = family_graph(family[1], family[2], **kw)
    video = family is not None and family[0] in FRAME_AXIS
    graph["30"] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 31, "width": 80, "height": 96, "video": video}}
    graph["31"] = {"class_type": "ParaDiTTestLatent", "inputs": {"seed": 32, "width": 112, "height": 72, "video": video}}
    graph["32"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["1", 0], "latent": ["30", 0]}}
    graph["33"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["32", 0], "latent": ["31", 0]}}
    positive = ["33", 0]
    if method is not None:
        graph["34"] = {"class_type": "FluxKontextMultiReferenceLatentMethod",
                       "inputs": {"conditioning": positive, "reference_latents_method": method}}
        positive = ["34", 0]
    graph["12"]["inputs"]["positive"] = graph["21"]["inputs"]["positive"] = positive
    return graph


@pytest.mark.parametrize("method, kw", [
    (None, dict(cfg=1.0)),
    ("index", dict(cfg=2.0, sampler_name="dpmpp_2m", scheduler="beta", steps=5, seed=9)),
    ("uxo/uno", dict(cfg=1.5, sampler_name="euler_ancestral", scheduler="normal", steps=4, seed=4)),
], ids=["offset-euler-cfg1", "index-dpmpp_2m-cfg2", "uxo-euler_a-cfg1.5"])
def test_kontext_same_latent_as_ksampler(server, method, kw):
    result = server.run(kontext_graph(method, **kw))
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    err = rel_err(par, ks)
    print(f"\nkontext ({method or 'offset'}): KSampler vs Parallel Sampler cpu:1, {kw}: rel. L2 error {err:.2e}")
    assert ks.shape == par.shape == (2, 16, 16, 20)
    assert err <= KSAMPLER_RTOL


def test_kontext_two_workers_match_one(server):
    one = server.latent(server.run(kontext_graph(None, cfg=2.0)), "13")
    two = server.latent(server.run(kontext_graph(None, devices="cpu:2", strat=strategy(ulysses=2), cfg=2.0)), "13")
    err = rel_err(two, one)
    print(f"\nkontext ulysses2 cpu:2 vs cpu:1: rel. L2 error {err:.2e}")
    assert err <= EXACT_RTOL


@pytest.mark.parametrize("family_file", ["qwen_image"], indirect=True)
@pytest.mark.parametrize("method, kw", [
    (None, dict(cfg=2.0, sampler_name="dpmpp_2m", scheduler="beta", steps=4, seed=9)),
    ("offset", dict(cfg=1.0)),
], ids=["index-dpmpp_2m-cfg2", "offset-euler-cfg1"])
def test_qwen_image_edit_same_latent_as_ksampler(server, family_file, method, kw):
    """Qwen-Image Edit's references (one-frame Wan latents), by index (its default) and tiled."""
    result = server.run(kontext_graph(method, family_file, **kw))
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    err = rel_err(par, ks)
    print(f"\nqwen_image edit ({method or 'index'}): KSampler vs Parallel Sampler cpu:1, {kw}: rel. L2 error {err:.2e}")
    assert ks.shape == par.shape == (2, 16, 1, 16, 20)
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("method, devices, strat", [
    ("index", "cpu:1", None), (None, "cpu:2", strategy(ulysses=2)), ("uxo/uno", "cpu:2", strategy(cfg=2)),
], ids=["index-cpu1", "offset-ulysses2", "uxo-cfg2"])
def test_kontext_under_stock_ksampler_equals_unetloader(server, method, devices, strat):
    """ComfyUI's Kontext template samples with KSampler: the references reach the workers from the model call
    (ComfyUI's process_latent_in undone on the host, one float32 rounding), the negative without them runs as
    its own call, as ComfyUI calls it."""
    graph = kontext_graph(method, devices=devices, strat=strat, cfg=2.0, sampler_name="dpmpp_2m_sde",
                          scheduler="karras", steps=4, seed=12)
    graph["12"]["class_type"] = "KSampler"  # same inputs as Parallel Sampler, on the parallel MODEL
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\nkontext ({method or 'offset'}) under KSampler on {devices}: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("family_file", ["qwen_image"], indirect=True)
def test_qwen_image_edit_under_stock_ksampler_equals_unetloader(server, family_file):
    graph = kontext_graph(None, family_file, cfg=2.0, sampler_name="res_multistep", scheduler="beta", steps=4)
    graph["12"]["class_type"] = "KSampler"
    graph["10"], graph["11"]["inputs"]["devices"] = strategy(ulysses=2), "cpu:2"
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\nqwen_image edit under KSampler, ulysses2: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


# ---------------------------------------------------------------------------------------------------
# (i) ComfyUI's own KSampler on Load Parallel DiT's MODEL: every model call of the host's sampling loop runs on
# the workers (the cond and uncond chunks split over the CFG group, the sequence over Ulysses/Ring); the latent
# equals UNETLoader + KSampler's on the same file. Samplers and schedulers beyond Parallel Sampler's own: SDE and
# ancestral ones draw their noise on the host, multistep ones keep their history there.

STOCK_PAIRS = [("euler", "simple"), ("dpmpp_2m_sde", "karras"), ("uni_pc", "exponential"), ("heun", "beta"),
               ("lcm", "kl_optimal"), ("res_multistep", "normal"), ("ddim", "ddim_uniform"),
               ("dpmpp_2m", "sgm_uniform"), ("euler_ancestral", "karras"), ("dpmpp_sde", "exponential"),
               ("deis", "beta"), ("ipndm", "simple")]


@pytest.mark.parametrize("sampler_name,scheduler", STOCK_PAIRS, ids=[f"{a}-{b}" for a, b in STOCK_PAIRS])
def test_ksampler_on_the_parallel_model_equals_unetloader(server, sampler_name, scheduler):
    t0 = time.monotonic()
    result = server.run(stock_graph(cfg=2.0, steps=4, seed=11, sampler_name=sampler_name, scheduler=scheduler))
    assert result["status"] == "success", explain(result)
    ks, par = server.latent(result, "22"), server.latent(result, "13")
    err = rel_err(par, ks)
    print(f"\nKSampler {sampler_name}/{scheduler} cfg 2: Load Parallel DiT vs UNETLoader rel. L2 {err:.2e} "
          f"({time.monotonic() - t0:.1f} s)")
    assert ks.shape == par.shape and rel_err(ks[0], ks[1]) > 0.05
    assert err <= KSAMPLER_RTOL


def _two_worker_ksampler(server, strat, what: str, steps=3, sampler_name="dpmpp_2m", **graph) -> float:
    """KSampler (cfg 2, karras) on Load Parallel DiT's MODEL over cpu:2 beside UNETLoader's: their rel. L2."""
    g = stock_graph(devices="cpu:2", strat=strat, cfg=2.0, steps=steps, seed=4, sampler_name=sampler_name,
                    scheduler="karras")
    for node, inputs in graph.items():
        g[node]["inputs"].update(inputs)
    result = server.run(g)
    assert result["status"] == "success", explain(result)
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\nKSampler {sampler_name} on cpu:2, {what}: rel. L2 {err:.2e} vs UNETLoader")
    return err


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2)],
                         ids=["cfg2", "ulysses2", "ring2"])
def test_ksampler_on_two_workers_equals_unetloader(server, strat):
    assert _two_worker_ksampler(server, strat, str(strat["inputs"])) <= KSAMPLER_RTOL


def test_ksampler_with_pipefusion_warm_throughout_equals_unetloader(server):
    """PipeFusion inside each model call; every step a warm-up step (the whole image through both stages): exact."""
    assert _two_worker_ksampler(server, strategy(pp=2, warmup=4), "pp2 warm-up 4 of 4", steps=4) <= KSAMPLER_RTOL


def test_ksampler_with_pipefusion_stale_kv_stays_close_to_unetloader(server):
    """After one warm-up step each call pipelines 2 patches over the previous call's K/V (heun: two calls a step,
    the second counted as the next step). Approximate like Parallel Sampler's PipeFusion: within a few percent of
    the exact latent, but measurably off it (the stale rows were read)."""
    for sampler_name in ("dpmpp_2m", "heun"):
        err = _two_worker_ksampler(server, strategy(pp=2, patches=2, warmup=1), "pp2 M2 warm-up 1 of 6", steps=6,
                                   sampler_name=sampler_name)
        assert KSAMPLER_RTOL < err < 5e-2


def test_ksampler_with_displaced_patch_equals_unetloader_in_warmup_and_stays_close_after(server):
    """Displaced patch parallelism per model call: every call a warm-up call is exact; after one warm-up call the
    patches read each other's K/V from the previous call, measurably off the exact latent but within a few
    percent (naive patch, which never exchanges, is ~0.1 off at this size: tests/test_parallel.py)."""
    assert _two_worker_ksampler(server, strategy(patch=2, warmup=4), "patch2 warm-up 4 of 4", steps=4) <= KSAMPLER_RTOL
    err = _two_worker_ksampler(server, strategy(patch=2, warmup=1), "patch2 warm-up 1 of 6", steps=6)
    assert KSAMPLER_RTOL < err < 5e-2


def test_ksampler_with_tensor_parallel_equals_unetloader(server):
    """Tensor parallel per model call: each worker holds half of every block's heads, MLP units and modulation and
    the row-wise layers all-reduce: exact."""
    assert _two_worker_ksampler(server, strategy(tensor=2), "tp2") <= KSAMPLER_RTOL


def test_ksampler_with_weighted_shares_and_any_patch_count_equals_unetloader(server):
    """Relative device weights (Ring with shares 3:1) and a PipeFusion patch count that divides no token row count
    (7 patches of the 8 x 10 token latent, every call warm) move rows, not terms: exact."""
    assert _two_worker_ksampler(server, strategy(ring=2, weights="3,1"), "ring2 3:1") <= KSAMPLER_RTOL
    assert _two_worker_ksampler(server, strategy(pp=2, patches=7, warmup=3), "pp2 M7 warm") <= KSAMPLER_RTOL


@pytest.mark.parametrize("kind,weight_dtype", [("fp8", "default"), ("fp8_scaled", "default"),
                                               ("fp32", "fp8_e4m3fn")], ids=["fp8", "fp8_scaled", "cast_fp8"])
def test_fp8_model_under_ksampler_equals_unetloader(server, kind, weight_dtype):
    """The same fp8 file (or the fp32 file with weight_dtype fp8_e4m3fn on both loaders) through UNETLoader and
    Load Parallel DiT on 2 workers (Ulysses): the workers keep the matrices in fp8 and upcast each per layer, as
    ComfyUI's manual cast does; the latents match to fp32 round-off."""
    unet = FP8_MODELS.get(kind, MODEL)
    loader = {"unet_name": unet, "weight_dtype": weight_dtype}
    err = _two_worker_ksampler(server, strategy(ulysses=2), f"{unet} weight_dtype {weight_dtype}, ulysses2",
                               **{"11": loader, "20": loader})
    assert err <= KSAMPLER_RTOL


def test_parallel_sampler_refuses_an_ordinary_model_in_one_sentence(server):
    graph = parallel_graph(tag="ordinary")
    graph["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}}
    graph["12"]["inputs"]["model"] = ["20", 0]
    result = server.run(graph)
    assert result["status"] == "error"
    message = result["error"]["exception_message"].strip()
    assert "Parallel Sampler needs the MODEL of a Load Parallel DiT node" in message and "KSampler" in message


def _both_models(graph: dict, build) -> dict:
    """`build(model_ref, base)` returns (output node id, nodes) of one sampling chain with node ids from `base`
    on; it is added once on Load Parallel DiT's MODEL (11) and once on UNETLoader's (20), saved as 13 and 22."""
    graph = {k: v for k, v in graph.items() if k not in ("12", "21")}
    graph["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": graph["11"]["inputs"]["unet_name"],
                                                          "weight_dtype": "default"}}
    for model, save, base in ((["11", 0], "13", 40), (["20", 0], "22", 50)):
        out, nodes = build(model, base)
        graph.update(nodes)
        graph[save] = {"class_type": "SaveLatent", "inputs": {"samples": [out, 0], "filename_prefix": f"latents/{base}"}}
    return graph


def _stock_run(server, graph) -> float:
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    par, ref = server.latent(result, "13"), server.latent(result, "22")
    assert par.shape == ref.shape
    return rel_err(par, ref)


def test_ksampler_advanced_two_pass_on_the_parallel_model(server):
    """KSamplerAdvanced steps 0-3 with leftover noise, then 3-6 without adding noise (a two-pass graph)."""
    def build(model, base):
        common = {"model": model, "noise_seed": 21, "steps": 6, "cfg": 2.0, "sampler_name": "dpmpp_2m_sde",
                  "scheduler": "karras", "positive": ["1", 0], "negative": ["2", 0]}
        first, second = str(base), str(base + 1)
        return second, {
            first: {"class_type": "KSamplerAdvanced", "inputs": dict(common, add_noise="enable", latent_image=["4", 0],
                                                                     start_at_step=0, end_at_step=3,
                                                                     return_with_leftover_noise="enable")},
            second: {"class_type": "KSamplerAdvanced", "inputs": dict(common, add_noise="disable",
                                                                      latent_image=[first, 0], start_at_step=3,
                                                                      end_at_step=10000,
                                                                      return_with_leftover_noise="disable")}}
    err = _stock_run(server, _both_models(stock_graph(devices="cpu:2", strat=strategy(ulysses=2)), build))
    print(f"\nKSamplerAdvanced two-pass, ulysses2: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


def custom_sampling(guider: dict, sampler_name: str, scheduler: str, steps: int, seed: int):
    """A `_both_models` builder: `guider` (its node without the model) -> SamplerCustomAdvanced with KSamplerSelect,
    BasicScheduler and RandomNoise."""
    def build(model, base):
        g, k, q, n, out = (str(base + i) for i in range(5))
        return out, {
            g: {"class_type": guider["class_type"], "inputs": dict(guider["inputs"], model=model)},
            k: {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler_name}},
            q: {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": scheduler, "steps": steps,
                                                           "denoise": 1.0}},
            n: {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
            out: {"class_type": "SamplerCustomAdvanced",
                  "inputs": {"noise": [n, 0], "guider": [g, 0], "sampler": [k, 0], "sigmas": [q, 0],
                             "latent_image": ["4", 0]}}}
    return build


def test_sampler_custom_advanced_with_cfg_guider_on_the_parallel_model(server):
    guider = {"class_type": "CFGGuider", "inputs": {"positive": ["1", 0], "negative": ["2", 0], "cfg": 3.0}}
    build = custom_sampling(guider, "uni_pc_bh2", "kl_optimal", steps=5, seed=8)
    err = _stock_run(server, _both_models(stock_graph(devices="cpu:2", strat=strategy(cfg=2)), build))
    print(f"\nSamplerCustomAdvanced + CFGGuider, cfg2: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("style", ["regular", "nested"])
def test_dual_cfg_guider_three_prompts_on_the_parallel_model(server, style):
    """DualCFGGuider evaluates three prompts per step; ComfyUI batches them into one call of three chunks, which
    the parallel MODEL runs as a two-chunk job (split over the CFG group) and a one-chunk job."""
    guider = {"class_type": "DualCFGGuider", "inputs": {"cond1": ["1", 0], "cond2": ["3", 0], "negative": ["2", 0],
                                                        "cfg_conds": 3.0, "cfg_cond2_negative": 1.5, "style": style}}
    build = custom_sampling(guider, "euler_ancestral", "beta", steps=4, seed=9)
    graph = stock_graph(devices="cpu:2", strat=strategy(cfg=2))
    graph["3"] = cond(3)
    err = _stock_run(server, _both_models(graph, build))
    print(f"\nDualCFGGuider ({style}), three prompts, cfg2: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


def test_model_sampling_flux_shift_reaches_the_parallel_model(server):
    """ModelSamplingFlux patches model_sampling on the host: the shifted schedule and timesteps reach the workers."""
    def build(model, base):
        m, k = str(base), str(base + 1)
        return k, {
            m: {"class_type": "ModelSamplingFlux", "inputs": {"model": model, "max_shift": 2.0, "base_shift": 0.3,
                                                              "width": 160, "height": 128}},
            k: {"class_type": "KSampler", "inputs": dict(sampling(seed=3, steps=4, cfg=2.0), model=[m, 0],
                                                         positive=["1", 0], negative=["2", 0],
                                                         latent_image=["4", 0])}}
    err = _stock_run(server, _both_models(stock_graph(), build))
    print(f"\nModelSamplingFlux shift on the parallel model: rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("family_file", list(FAMILY_FILES), indirect=True)
def test_family_ksampler_on_the_parallel_model_equals_unetloader(server, family_file):
    """Every family's MODEL under stock KSampler (SD3's x1000 timesteps, PixArt's discrete eps model, Qwen-Image's
    5D latents) with dpmpp_2m_sde/karras at cfg 2 on ulysses2 and on CFG parallel."""
    name, filename, cond_kw = family_file
    split = strategy(ulysses=2) if FAMILY_FILES[name][0].num_heads % 2 == 0 else strategy(ring=2)  # 3-head file
    for strat in (split, strategy(cfg=2)):
        graph = family_graph(filename, cond_kw, cfg=2.0, steps=3, seed=6, sampler_name="dpmpp_2m_sde",
                             scheduler="karras")
        graph["10"], graph["11"]["inputs"]["devices"] = strat, "cpu:2"
        if name in FOUR_CHANNELS:
            graph["4"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 320, "height": 256, "batch_size": 2}}
        graph["12"] = {"class_type": "KSampler", "inputs": dict(graph["21"]["inputs"], model=["11", 0])}
        result = server.run(graph)
        assert result["status"] == "success", explain(result)
        ks, par = server.latent(result, "22"), server.latent(result, "13")
        err = rel_err(par, ks)
        degrees = {k: v for k, v in strat["inputs"].items() if k.endswith("_degree") and v > 1}
        print(f"\n{name}: KSampler on Load Parallel DiT {degrees} vs UNETLoader: rel. L2 {err:.2e}")
        assert ks.shape == par.shape == expected_shape(name)
        assert err <= KSAMPLER_RTOL


def test_interrupt_under_ksampler_on_the_parallel_model_stops_and_the_next_prompt_runs(server):
    """ComfyUI's own progress bar advances per step of its sampler; Interrupt stops the workers' current call
    within about a step, and the next prompt runs on the same workers."""
    marks = {}

    def on_message(msg):
        if msg.get("type") == "progress" and msg["data"].get("node") == "12" and "interrupt" not in marks:
            marks["interrupt"] = time.monotonic()
            marks["step"], marks["max"] = msg["data"]["value"], msg["data"]["max"]
            qw.http_json(server.url + "/interrupt", {})

    graph = stock_graph(devices="cpu:2", strat=strategy(ulysses=2), cfg=2.0, steps=500, seed=78)
    graph.pop("21"), graph.pop("22"), graph.pop("20")  # only the parallel chain
    result = server.run(graph, on_message=on_message)
    ended = time.monotonic()
    assert "interrupt" in marks, "KSampler's progress bar never advanced"
    assert result["status"] == "interrupted", explain(result)
    print(f"\nKSampler interrupt at step {marks['step']}/{marks['max']} -> prompt ended "
          f"{ended - marks['interrupt']:.2f} s later")
    assert marks["max"] == 500 and marks["step"] < 50 and ended - marks["interrupt"] < 10.0
    after = server.run(stock_graph(devices="cpu:2", strat=strategy(ulysses=2), cfg=2.0, steps=3, seed=79))
    assert after["status"] == "success", explain(after)
    assert rel_err(server.latent(after, "13"), server.latent(after, "22")) <= KSAMPLER_RTOL


# ---------------------------------------------------------------------------------------------------
# (j) LoRA on the parallel MODEL: ComfyUI's loaders map each file's keys onto the model's names, and every rank
# applies the patches to the weights it holds; the latent equals UNETLoader + the same LoRA nodes.

def lora_chain(loras: list[tuple[str, float]], parallel_sampler: bool = False):
    """A `_both_models` builder: LoraLoaderModelOnly per (file, strength), then KSampler (Parallel Sampler on Load
    Parallel DiT's MODEL when `parallel_sampler`)."""
    def build(model, base):
        sampler = "ParaDiTSampler" if parallel_sampler and model == ["11", 0] else "KSampler"
        nodes = {}
        for i, (name, strength) in enumerate(loras):
            nodes[str(base + i)] = {"class_type": "LoraLoaderModelOnly",
                                    "inputs": {"model": model, "lora_name": name, "strength_model": strength}}
            model = [str(base + i), 0]
        out = str(base + len(loras))
        nodes[out] = {"class_type": sampler, "inputs": dict(LORA_SAMPLING, model=model, positive=["1", 0],
                                                           negative=["2", 0], latent_image=["4", 0])}
        return out, nodes
    return build


LORA_SAMPLING = sampling(seed=3, steps=3, cfg=2.0, sampler_name="dpmpp_2m")


def _lora_graph(loras, devices="cpu:1", strat=None, parallel_sampler=False) -> dict:
    graph = _both_models(stock_graph(devices=devices, strat=strat), lora_chain(loras, parallel_sampler))
    # A third chain, UNETLoader without the LoRAs (saved as 32), proves the LoRAs change the picture.
    graph["30"] = {"class_type": "KSampler", "inputs": dict(LORA_SAMPLING, model=["20", 0], positive=["1", 0],
                                                           negative=["2", 0], latent_image=["4", 0])}
    graph["32"] = {"class_type": "SaveLatent", "inputs": {"samples": ["30", 0], "filename_prefix": "latents/nolora"}}
    return graph


def _lora_run(server, graph, what: str) -> float:
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    par, ref, plain = (server.latent(result, n) for n in ("13", "22", "32"))
    err, change = rel_err(par, ref), rel_err(ref, plain)
    print(f"\n{what}: Load Parallel DiT vs UNETLoader rel. L2 {err:.2e} (the LoRAs change the latent by {change:.2e})")
    assert change > 1e-2  # a LoRA the workers ignored would be caught here
    return err


@pytest.mark.parametrize("kind", list(LORAS))
def test_lora_file_format_on_the_parallel_model_equals_unetloader(server, kind):
    """BFL/ComfyUI names (with a bias diff), kohya (alpha), diffusers/PEFT (q/k/v and MLP at offsets in fused
    tensors, the final norm's halves swapped) and LyCORIS (LoKr, LoHa), each at strength 1."""
    assert _lora_run(server, _lora_graph([(LORAS[kind], 1.0)]), f"LoRA {kind}") <= KSAMPLER_RTOL


@pytest.mark.parametrize("strat", [strategy(ulysses=2), strategy(cfg=2), strategy(pp=2, warmup=3)],
                         ids=["ulysses2", "cfg2", "pp2-warm"])
def test_two_stacked_loras_on_two_workers_equal_unetloader(server, strat):
    """Under PipeFusion each stage patches only the blocks it holds; warm-up over all 3 steps keeps it exact."""
    loras = [(LORAS["kohya"], 0.8), (LORAS["peft"], -0.5)]
    err = _lora_run(server, _lora_graph(loras, "cpu:2", strat), f"kohya 0.8 + peft -0.5 on cpu:2 {strat['inputs']}")
    assert err <= KSAMPLER_RTOL


def test_two_stacked_loras_under_parallel_sampler_pipefusion_equal_unetloader(server):
    """Parallel Sampler takes the LoRA'd MODEL too: each PipeFusion stage patches only the blocks it holds. Warm-up
    over every step keeps PipeFusion exact, so the bound is KSampler's."""
    loras = [(LORAS["bfl"], 0.8), (LORAS["lycoris"], -0.5)]
    graph = _lora_graph(loras, "cpu:2", strategy(pp=2, warmup=LORA_SAMPLING["steps"]), parallel_sampler=True)
    err = _lora_run(server, graph, "bfl 0.8 + lycoris -0.5 under Parallel Sampler pp2")
    assert err <= KSAMPLER_RTOL


def _model_loads(server) -> int:
    return sum(c.get("model_loads", 0) for c in server.get("/paradit/status")["clients"])


def test_swapping_loras_between_prompts_repatches_without_reloading(server):
    """A, then B, then none, then A again on the same workers: each prompt equals UNETLoader with the same LoRA,
    and the model is loaded once (a swap re-reads only the tensors the LoRAs touch, from the file)."""
    runs = [[(LORAS["kohya"], 0.8)], [(LORAS["peft"], 1.0)], [], [(LORAS["kohya"], 0.8)]]
    loads = None
    for i, loras in enumerate(runs):
        graph = _lora_graph(loras, "cpu:2", strategy(ulysses=2))
        for node in [n for n, v in graph.items() if v["class_type"] == "KSampler"]:
            graph[node]["inputs"]["seed"] = 40 + i  # a new seed per prompt: ComfyUI would reuse cached results
        result = server.run(graph)
        assert result["status"] == "success", explain(result)
        err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
        print(f"\nprompt {i} with {[n for n, _ in loras] or 'no LoRA'}: rel. L2 {err:.2e}, "
              f"model loads so far {_model_loads(server)}")
        assert err <= KSAMPLER_RTOL
        if loads is None:
            loads = _model_loads(server)
    assert _model_loads(server) == loads


# ---------------------------------------------------------------------------------------------------
# (k) Quantized files: fp8 with LoRAs as ComfyUI bakes them, and GGUF as ComfyUI-GGUF runs it (that node is
# compared against where it is installed in the host, e.g. in ComfyUI's custom_nodes; else the GGUF file is
# compared with UNETLoader on the fp32 file of its dequantized values, which is what ComfyUI-GGUF computes).

def _with_files(graph: dict, parallel: str, stock: str | None = None, gguf_node: bool = False) -> dict:
    graph["11"]["inputs"]["unet_name"] = parallel
    if gguf_node:
        graph["20"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": parallel}}
    else:
        graph["20"]["inputs"]["unet_name"] = stock or parallel
    return graph


def _comfyui_gguf(server) -> None:
    if "UnetLoaderGGUF" not in server.get("/object_info/UnetLoaderGGUF"):
        pytest.skip("ComfyUI-GGUF is not installed in this ComfyUI host (its custom_nodes)")


@pytest.mark.parametrize("kind", list(FP8_MODELS))
def test_lora_on_an_fp8_model_equals_unetloader(server, kind):
    """BFL (with a bias diff) + kohya LoRAs on an fp8 file, 2 workers (Ulysses). ComfyUI holds a scaled-fp8 model
    in fp8: each rank rebuilds the patched tensors whole, adds the patches in float32 and bakes them back into fp8
    with ComfyUI's seeded stochastic rounding (weights divided by their scale, the fp8 biases rounded too), as
    ComfyUI's ModelPatcher does. A plain fp8 file ComfyUI upcasts at load on a CPU (no fp8 compute): the ranks keep
    fp8 and add the patches per call. fp32 round-off either way (a wrong rounding or seed moves it 1e-3 to 5e-2)."""
    loras = [(LORAS["bfl"], 0.8), (LORAS["kohya"], -0.5)]
    graph = _with_files(_lora_graph(loras, "cpu:2", strategy(ulysses=2)), FP8_MODELS[kind])
    assert _lora_run(server, graph, f"bfl 0.8 + kohya -0.5 on {FP8_MODELS[kind]}, ulysses2") <= KSAMPLER_RTOL


def test_gguf_model_is_listed_and_equals_unetloader_on_its_dequantized_twin(server):
    """Load Parallel DiT lists .gguf files of models/diffusion_models (ComfyUI lists them only through
    ComfyUI-GGUF's loader); 2 workers keep the blocks and dequantize per layer: the same latent as UNETLoader on
    an fp32 file holding the dequantized values."""
    choices = server.get("/object_info/ParaDiTLoader")["ParaDiTLoader"]["input"]["required"]["unet_name"][1]["options"]
    assert GGUF_MODEL in choices
    err = _two_worker_ksampler(server, strategy(ulysses=2), f"{GGUF_MODEL} vs its fp32 twin, ulysses2",
                               **{"11": {"unet_name": GGUF_MODEL}, "20": {"unet_name": GGUF_TWIN}})
    assert err <= KSAMPLER_RTOL


def test_gguf_model_equals_comfyui_gguf(server):
    _comfyui_gguf(server)
    graph = _with_files(stock_graph(devices="cpu:2", strat=strategy(pp=2, warmup=3), cfg=2.0, steps=3, seed=4,
                                    sampler_name="dpmpp_2m", scheduler="karras"), GGUF_MODEL, gguf_node=True)
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\n{GGUF_MODEL}: Load Parallel DiT (pp2, warm) vs ComfyUI-GGUF's UnetLoaderGGUF rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


@pytest.mark.parametrize("reference", ["fp32_twin", "comfyui_gguf"])
def test_lora_on_a_gguf_model_equals_comfyui(server, reference):
    """BFL + PEFT LoRAs (fused q/k/v at offsets) on the GGUF file, patched per layer at each call as ComfyUI-GGUF
    patches them: against ComfyUI-GGUF where installed, and against UNETLoader + the same LoRAs on the fp32
    twin (ComfyUI bakes them into those fp32 numbers: the same arithmetic)."""
    if reference == "comfyui_gguf":
        _comfyui_gguf(server)
    loras = [(LORAS["bfl"], 0.8), (LORAS["peft"], -0.5)]
    graph = _with_files(_lora_graph(loras, "cpu:2", strategy(ulysses=2)), GGUF_MODEL, GGUF_TWIN,
                        gguf_node=reference == "comfyui_gguf")
    assert _lora_run(server, graph, f"bfl 0.8 + peft -0.5 on {GGUF_MODEL} vs {reference}") <= KSAMPLER_RTOL


@pytest.mark.parametrize("strat", [None, strategy(ulysses=2), strategy(pp=2, warmup=3)],
                         ids=["world1", "ulysses2", "pp2-warm"])
@pytest.mark.parametrize("fmt", list(COMFY_QUANT), ids=lambda f: f"comfy_quant-{f}")
def test_comfy_quant_model_equals_unetloader_on_its_dequantized_twin(server, fmt, strat):
    """A ComfyUI quantized file through Load Parallel DiT (each rank keeps its rows in the layout and dequantizes
    per layer with comfy-kitchen) against UNETLoader + KSampler on the fp32 file of the same values."""
    if not os.path.exists(os.path.join(server.root, "models", "diffusion_models", f"flux-mini-{fmt}.safetensors")):
        pytest.skip("comfy-kitchen is not installed in the test's Python")
    devices = "cpu:1" if strat is None else "cpu:2"
    graph = _with_files(stock_graph(devices=devices, strat=strat or strategy(), cfg=2.0, steps=3, seed=4,
                                    sampler_name="dpmpp_2m", scheduler="karras"),
                        f"flux-mini-{fmt}.safetensors", f"flux-mini-{fmt}-fp32.safetensors")
    result = server.run(graph)
    assert result["status"] == "success", explain(result)
    err = rel_err(server.latent(result, "13"), server.latent(result, "22"))
    print(f"\nflux-mini-{fmt} ({devices} {strat and strat['inputs']}): vs UNETLoader on its fp32 twin rel. L2 {err:.2e}")
    assert err <= KSAMPLER_RTOL


def test_lora_on_a_comfy_quant_nvfp4_model_equals_unetloader_on_its_twin(server):
    """BFL + kohya LoRAs on the nvfp4 file, 2 workers (Ulysses): each layer adds the patches to its dequantized
    rows when it runs (ComfyUI's dynamic-VRAM path for quantized layers), the same numbers as UNETLoader + the
    same LoRA nodes on the fp32 twin."""
    unet = "flux-mini-nvfp4.safetensors"
    if not os.path.exists(os.path.join(server.root, "models", "diffusion_models", unet)):
        pytest.skip("comfy-kitchen is not installed in the test's Python")
    loras = [(LORAS["bfl"], 0.8), (LORAS["kohya"], -0.5)]
    graph = _with_files(_lora_graph(loras, "cpu:2", strategy(ulysses=2)), unet, "flux-mini-nvfp4-fp32.safetensors")
    assert _lora_run(server, graph, f"bfl 0.8 + kohya -0.5 on {unet}, ulysses2") <= KSAMPLER_RTOL
