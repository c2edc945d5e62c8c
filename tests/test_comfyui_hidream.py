"""HiDream I1 / E1 on the parallel MODEL in a real ComfyUI host (skipped without COMFYUI_DIR): the same KSampler on
Load Parallel DiT and on UNETLoader, where ComfyUI runs its own HiDreamImageTransformer2DModel on the same file.

ComfyUI's detection builds every HiDream at the released size (model_detection hard-codes 20 heads, 16 + 32 blocks,
4096-wide encoders); the tiny file (tests/test_hidream.py's) needs the config read off its shapes, which the
test-only node module written here patches into that one branch (ComfyUI's own classes and code run otherwise). Its
conditioning node stands in for CLIPTextEncodeHiDream: T5 tokens, a pooled vector and conditioning_llama3 [1, 32, N,
24]; E1's image is ParaDiTTestConcat's concat_latent_image (what InstructPixToPixConditioning sets).
"""
from __future__ import annotations

import os

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import latent_parity, serve  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from test_hidream import TINY  # noqa: E402

pytestmark = pytest.mark.timeout(900)

DIT = "hidream_i1_mini.safetensors"
ONE_WORKER_RTOL = 1e-5  # the same fp32 maths in another op order, over 3 steps
EXACT_RTOL = 1e-4

HIDREAM_NODES = '''"""Test-only: ComfyUI's HiDream detection on a small file's shapes, and a CLIPTextEncodeHiDream stand-in."""
import torch
import comfy.model_detection

_detect = comfy.model_detection.detect_unet_config


def detect_unet_config(state_dict, key_prefix, *args, **kwargs):
    config = _detect(state_dict, key_prefix, *args, **kwargs)
    if config is None or config.get("image_model") != "hidream":
        return config
    keys = list(state_dict.keys())

    def count(name):
        return len({k[len(key_prefix + name):].split(".")[0] for k in keys if k.startswith(key_prefix + name)})

    dim, patch_in = state_dict[key_prefix + "x_embedder.proj.weight"].shape
    double, single = count("double_stream_blocks."), count("single_stream_blocks.")
    projection = lambda i: state_dict[key_prefix + f"caption_projection.{i}.linear.weight"].shape[1]
    config.update(num_attention_heads=dim // 128, num_layers=double, num_single_layers=single,
                  in_channels=patch_in // 4, out_channels=patch_in // 4,
                  caption_channels=[projection(double + single), projection(0)],
                  text_emb_dim=state_dict[key_prefix + "p_embedder.pooled_embedder.linear_1.weight"].shape[1],
                  llama_layers=[min(k, 31) for k in range(double + single)])
    return config


comfy.model_detection.detect_unet_config = detect_unet_config


class ParaDiTTestHiDreamConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 7}),
                             "llama_tokens": ("INT", {"default": 5})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, tokens, llama_tokens):
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, tokens, 32, generator=g)
        extra = {"pooled_output": torch.randn(1, 16, generator=g),
                 "conditioning_llama3": torch.randn(1, 32, llama_tokens, 24, generator=g)}
        return ([[cond, extra]],)


NODE_CLASS_MAPPINGS = {"ParaDiTTestHiDreamConditioning": ParaDiTTestHiDreamConditioning}
'''


def write_models(root: str) -> None:
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), TINY, seed=1,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    os.makedirs(os.path.join(root, "custom_nodes", "paradit_test_hidream"))
    with open(os.path.join(root, "custom_nodes", "paradit_test_hidream", "__init__.py"), "w") as f:
        f.write(HIDREAM_NODES)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-hidream-", write_models)


def graph(devices: str = "cpu:1", strat: dict | None = None, e1: bool = False) -> dict:
    """Seeded prompts (7 T5 + 5 Llama tokens, 9 + 4), a 64 x 64 px latent, the same KSampler (3 euler steps, cfg 5)
    on Load Parallel DiT (11 -> 12 -> 13) and on UNETLoader (20 -> 21 -> 22); `e1`: an edit image on both prompts."""
    g = {"1": {"class_type": "ParaDiTTestHiDreamConditioning", "inputs": {"seed": 1, "tokens": 7, "llama_tokens": 5}},
         "2": {"class_type": "ParaDiTTestHiDreamConditioning", "inputs": {"seed": 2, "tokens": 9, "llama_tokens": 4}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "10": strat or comfy_host.strategy(warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}}}
    positive, negative = ["1", 0], ["2", 0]
    if e1:
        for node, source in (("5", "1"), ("6", "2")):
            g[node] = {"class_type": "ParaDiTTestConcat", "inputs": {"conditioning": [source, 0], "seed": 9,
                                                                     "width": 64, "height": 64, "mask": False}}
        positive, negative = ["5", 0], ["6", 0]
    sampling = {"seed": 5, "steps": 3, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": positive, "negative": negative, "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        g[sampler] = {"class_type": "KSampler", "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"h/{save}"}}
    return g


@pytest.mark.parametrize("e1", [False, True], ids=["i1", "e1"])
def test_hidream_one_worker_equals_unetloader(server, e1):
    err, par, _ = latent_parity(server, graph(e1=e1), f"HiDream {'E1' if e1 else 'I1'}, 1 worker")
    assert par.shape == (1, 16, 8, 8)
    assert err <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(ulysses=2, warmup=3), comfy_host.strategy(tensor=2, warmup=3)],
                         ids=["ulysses2", "tp2"])
def test_hidream_exact_strategies_equal_unetloader(server, strat):
    err, _, _ = latent_parity(server, graph("cpu:2", strat, e1=True), "HiDream E1, 2 workers")
    assert err <= EXACT_RTOL


def test_hidream_e1_parallel_sampler_runs_the_worker_loop(server):
    """Parallel Sampler on the same MODEL and inputs: conditioning_llama3 and E1's concat_latent_image read by the
    worker loop (not routed to ComfyUI's sampler), equal to KSampler's calls and to UNETLoader."""
    g = comfy_host.with_parallel_sampler(graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3), e1=True))
    same_model, unet, summary = comfy_host.entrance_parity(server, g, "HiDream E1, Ulysses-2")
    assert "per model call" not in summary, summary
    assert same_model <= ONE_WORKER_RTOL and unet <= EXACT_RTOL
