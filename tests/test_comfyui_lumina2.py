"""Lumina Image 2.0 against the host's own NextDiT (skipped without COMFYUI_DIR), two ways:

- the model: ComfyUI's comfy/ldm/lumina/model.py, built on the tiny file's shapes and loaded with its tensors in
  the host's Python, runs the same model calls as the workers;
- the nodes: Load Parallel DiT + KSampler against UNETLoader + KSampler in a ComfyUI server, on a file ComfyUI's
  own detection takes for Lumina 2. That detection fixes the width (2304 = 24 heads of 96 over 8 key/value heads),
  so the file has the released width and one main layer (ComfyUI counts those) beside NextDiT's two refiner blocks
  per stream: 1.7 GB in fp32, written once per module. The prompt is a seeded stand-in for the Gemma 2 encode with
  its attention mask, from which ComfyUI's Lumina2 model passes `num_tokens`.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from comfy_host import COMFYUI_DIR, COMFYUI_PYTHON, CPU_SHIM, latent_parity, serve

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from conftest import rel_err  # noqa: E402
from parallel_runtime.spec import StrategySpec as S  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from test_lumina2 import TINY, call_job  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# NextDiT sizes its MLP itself: 4 x width rounded up to a multiple of 256 (384 -> 512 at this width).
HOST = dataclasses.replace(TINY, ffn_dim=512)
# fp32 on CPU: the same maths in another op order (~1e-7 per op); exact strategies add their own reordering.
ONE_WORKER_RTOL, EXACT_RTOL = 1e-5, 1e-4

HOST_SCRIPT = """
import sys
import comfy.options
comfy.options.enable_args_parsing()
sys.argv = [sys.argv[0], "--cpu"]
import torch
import comfy.ops
from comfy.ldm.lumina.model import NextDiT
from safetensors.torch import load_file

path, inputs, out = {path!r}, {inputs!r}, {out!r}
c = torch.load(inputs)
m = NextDiT(patch_size=2, in_channels=16, dim=c["dim"], n_layers=c["layers"], n_refiner_layers=c["refiners"],
            n_heads=c["heads"], n_kv_heads=c["kv_heads"], qk_norm=True, cap_feat_dim=c["cap_dim"],
            axes_dims=c["axes"], axes_lens=[300, 512, 512], operations=comfy.ops.disable_weight_init)
sd = {{k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()}}
m.load_state_dict(sd, strict=True)
with torch.no_grad():
    rows = [m(x, t, context=cond, num_tokens=cond.shape[1]) for x, t, cond in c["calls"]]
torch.save(torch.cat(rows), out)
"""


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """(path, job) -> ComfyUI's NextDiT output for the job's rows, one call per branch (ComfyUI's batch of one)."""
    folder = tmp_path_factory.mktemp("lumina2_host")

    def run(path: str, job) -> torch.Tensor:
        branches = [b for b in (job.positive, job.negative) if b is not None]
        calls = [(job.latent[i:i + 1], job.timestep[i:i + 1], b.cond) for i, b in enumerate(branches)]
        inputs, out = str(folder / "inputs.pt"), str(folder / "out.pt")
        torch.save({"dim": HOST.hidden_size, "layers": HOST.num_layers, "refiners": HOST.num_refiner_layers,
                    "heads": HOST.num_heads, "kv_heads": HOST.num_kv_heads, "cap_dim": HOST.cap_feat_dim,
                    "axes": list(HOST.rope_axes), "calls": calls}, inputs)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (CPU_SHIM, COMFYUI_DIR) if p))
        proc = subprocess.run([COMFYUI_PYTHON, "-c", HOST_SCRIPT.format(path=path, inputs=inputs, out=out)],
                              cwd=COMFYUI_DIR, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(out)

    return run


@pytest.fixture(scope="module")
def lumina_file(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("lumina2") / "lumina2_tiny.safetensors"), HOST, seed=7,
                            prefix="model.diffusion_model.", dtype=torch.float32)


def test_lumina2_one_worker_equals_comfyui_nextdit(lumina_file, host_run, client1):
    job = call_job(lumina_file, S())
    err = rel_err(client1.run(job).latent, host_run(lumina_file, job))
    print(f"\nLumina 2, 1 worker vs ComfyUI's NextDiT: rel. L2 {err:.2e}")
    assert err < ONE_WORKER_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_lumina2_exact_strategies_equal_comfyui_nextdit(lumina_file, host_run, client2, strategy):
    job = call_job(lumina_file, strategy)
    err = rel_err(client2.run(job).latent, host_run(lumina_file, job))
    print(f"\nLumina 2, {strategy} vs ComfyUI's NextDiT: rel. L2 {err:.2e}")
    assert err < EXACT_RTOL


# -- the nodes ---------------------------------------------------------------------------------------------

# ComfyUI's Lumina 2 detection shape (2304 wide, 24 heads over 8 key/value heads, NextDiT's own 4 x 2304-wide MLP),
# one main layer, a 64-wide prompt (Gemma 2 2B's 2304 in real files: the width is read from the file).
RELEASED = dataclasses.replace(HOST, hidden_size=2304, num_heads=24, num_kv_heads=8, num_layers=1, ffn_dim=9216,
                               cap_feat_dim=64)
DIT = "lumina2_mini.safetensors"


def write_models(root: str) -> None:
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), RELEASED, seed=8,
                     prefix="model.diffusion_model.", dtype=torch.float32)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-lumina2-", write_models)


def graph(devices: str = "cpu:1", strat: dict | None = None, cfg: float = 4.0, padding: int = 0) -> dict:
    """Seeded prompts with Gemma's attention mask (1, 2; 12 and 9 tokens), EmptySD3LatentImage (64x48 px), the same
    KSampler (res_multistep, as ComfyUI's Lumina 2 template) on Load Parallel DiT (11 -> 12 -> 13) and on
    UNETLoader (20 -> 21 -> 22)."""
    def prompt(seed, tokens):
        return {"class_type": "ParaDiTTestConditioning",
                "inputs": {"seed": seed, "tokens": tokens, "guidance": -1, "width": RELEASED.cap_feat_dim,
                           "pooled": 0, "mask_padding": padding}}

    g = {"1": prompt(1, 12), "2": prompt(2, 9),
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 1}},
         "10": strat or comfy_host.strategy(warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}}}
    sampling = {"seed": 5, "steps": 3, "cfg": cfg, "sampler_name": "res_multistep", "scheduler": "simple",
                "denoise": 1.0, "positive": ["1", 0], "negative": ["2", 0], "latent_image": ["4", 0]}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22")):
        g[sampler] = {"class_type": "KSampler", "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"l/{save}"}}
    return g


def test_lumina2_load_parallel_dit_one_worker_equals_unetloader(server):
    err, par, _ = latent_parity(server, graph(), "Lumina 2 (released width), 1 worker, KSampler cfg 4")
    assert par.shape == (1, 16, 6, 8)
    assert err < ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [comfy_host.strategy(cfg=2, warmup=3), comfy_host.strategy(ulysses=2, warmup=3),
                                   comfy_host.strategy(ring=2, warmup=3),
                                   comfy_host.strategy(pp=2, patches=3, warmup=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_lumina2_load_parallel_dit_exact_strategies_equal_unetloader(server, strat):
    degrees = {k: v for k, v in strat["inputs"].items() if k.endswith("degree") and v > 1}
    err, _, _ = latent_parity(server, graph("cpu:2", strat), f"Lumina 2, {degrees}, KSampler cfg 4")
    assert err < EXACT_RTOL


def test_lumina2_padded_prompt_is_refused_in_one_sentence(server):
    """A prompt whose mask pads tokens (ComfyUI then passes the [B, L] mask) is refused, not read as Flux's bias."""
    g = graph(padding=3)
    for node in ("20", "21", "22"):  # only the parallel chain
        g.pop(node)
    result = server.run(g)
    assert result["status"] == "error", comfy_host.explain(result)
    message = comfy_host.explain(result)
    assert "attention mask hides 3 padding token(s)" in message, message


@pytest.mark.parametrize("sampler, routed", [("euler", None), ("res_multistep", "the sampler res_multistep")],
                         ids=["worker_loop", "per_call"])
def test_lumina2_parallel_sampler_equals_ksampler(server, sampler, routed):
    """Parallel Sampler on the same MODEL as KSampler. Gemma's all-ones prompt mask keeps the workers' own loop
    (euler); the template's res_multistep, which that loop lacks, runs ComfyUI's sampler. The worker loop's float32
    sampler update differs from the host's by round-off at most."""
    g = graph("cpu:2", comfy_host.strategy(ulysses=2, warmup=3))
    for node in ("12", "21"):
        g[node]["inputs"]["sampler_name"] = sampler
    same, unet, summary = comfy_host.entrance_parity(server, comfy_host.with_parallel_sampler(g),
                                                     f"Lumina 2, Parallel Sampler, {sampler}")
    assert same <= ONE_WORKER_RTOL and unet < EXACT_RTOL
    assert (f"per-call pipeline: the graph has {routed}" in summary) if routed else ("per model call" not in summary)


def test_lumina2_padded_prompt_gets_the_same_sentence_from_parallel_sampler(server):
    g = graph(padding=3)
    for node in ("20", "21", "22"):
        g.pop(node)
    g["12"]["class_type"] = "ParaDiTSampler"
    result = server.run(g)
    assert result["status"] == "error", comfy_host.explain(result)
    assert "attention mask hides 3 padding token(s)" in comfy_host.explain(result)
