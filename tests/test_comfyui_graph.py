"""The rest of a real graph on the parallel MODEL, in a real ComfyUI host (skipped without COMFYUI_DIR): Flux Fill
and Canny/Depth-shaped files with their concat conditioning, SkipLayerGuidance, ComfyUI's step caches (EasyCache,
LazyCache), and the patches and nodes the workers refuse, each against UNETLoader + the same stock nodes on the same
file.

The files are random Flux models with ComfyUI's detection shape (3072 wide, one double and one single block,
fp32), their input widened as Fill's (96 channels: latent, masked image, 64-channel mask) and Canny/Depth's (32).
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
from comfy_host import explain, latent_parity, serve  # noqa: E402
from conftest import rel_err  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BASE = comfy_host.FLUX_MINI
FILES = {"fill": ("flux-mini-fill.safetensors", 80, True), "canny": ("flux-mini-canny.safetensors", 16, False)}
# fp32 on CPU: UNETLoader's model and the workers' run the same float32 maths in another op order (~1e-7 per op
# over 2 blocks and 3 steps); exact strategies on 2 workers add their own reordering.
ONE_WORKER_RTOL = 1e-5
EXACT_RTOL = 1e-4


def write_models(root: str) -> None:
    folder = os.path.join(root, "models", "diffusion_models")
    for name, (filename, extra, _) in FILES.items():
        config = dataclasses.replace(BASE, in_channels=4 * (16 + extra), out_channels=64)
        write_checkpoint(os.path.join(folder, filename), config, seed=1, prefix="model.diffusion_model.",
                         dtype=torch.float32)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-graph-", write_models)


def strategy(**degrees) -> dict:
    """warmup_steps = the graphs' 3 steps: PipeFusion runs the whole image every step (exact)."""
    return comfy_host.strategy(warmup=3, **degrees)


def graph(kind: str, devices: str = "cpu:1", strat: dict | None = None, patch: dict | None = None,
          parallel_sampler: bool = False, steps: int = 3, images: int = 1) -> dict:
    """Seeded prompts with the file kind's concat conditioning (1, 2 -> 5, 6), a 160x128 latent (4), and the same
    sampling chain on Load Parallel DiT (11 -> 12 -> 13) and on UNETLoader (20 -> 21 -> 22); `patch` (a node
    taking "model") goes between each loader and its sampler."""
    filename, _, mask = FILES[kind]
    g = {"1": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 1, "tokens": 8, "guidance": 3.5}},
         "2": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 2, "tokens": 8, "guidance": 3.5}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 128, "batch_size": images}},
         "10": strat or strategy(),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": filename, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": filename, "weight_dtype": "default"}}}
    for node, src, seed in (("5", "1", 7), ("6", "2", 8)):  # each branch its own concat image
        g[node] = {"class_type": "ParaDiTTestConcat", "inputs": {"conditioning": [src, 0], "seed": seed,
                                                                  "width": 160, "height": 128, "mask": mask}}
    sampling = {"seed": 5, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                "denoise": 1.0, "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["4", 0]}
    for loader, sampler, save, patched in (("11", "12", "13", "14"), ("20", "21", "22", "23")):
        model = [loader, 0]
        if patch is not None:
            g[patched] = {"class_type": patch["class_type"], "inputs": dict(patch["inputs"], model=model)}
            model = [patched, 0]
        cls = "ParaDiTSampler" if parallel_sampler and loader == "11" else "KSampler"
        g[sampler] = {"class_type": cls, "inputs": dict(sampling, model=model)}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"g/{save}"}}
    return g


def parity(server, g: dict, what: str) -> float:
    err, par, _ = latent_parity(server, g, what)
    assert par.shape == (1, 16, 16, 20)
    return err


@pytest.mark.parametrize("kind", sorted(FILES))
def test_concat_model_under_ksampler_equals_unetloader(server, kind):
    assert parity(server, graph(kind), f"{kind}, KSampler, 1 worker") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("kind", sorted(FILES))
def test_concat_model_under_parallel_sampler_equals_ksampler(server, kind):
    assert parity(server, graph(kind, parallel_sampler=True), f"{kind}, Parallel Sampler") <= ONE_WORKER_RTOL


@pytest.mark.parametrize("strat", [strategy(cfg=2), strategy(ulysses=2), strategy(ring=2), strategy(pp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warm"])
def test_fill_on_two_workers_equals_unetloader(server, strat):
    """PipeFusion with warmup_steps = steps: the whole image every step (exact)."""
    assert parity(server, graph("fill", "cpu:2", strat), f"fill, KSampler, {strat['inputs']}") <= EXACT_RTOL


SLG = {"class_type": "SkipLayerGuidanceDiT", "inputs": {"double_layers": "0", "single_layers": "0", "scale": 3.0,
                                                        "start_percent": 0.0, "end_percent": 1.0,
                                                        "rescaling_scale": 0.0}}
SLG_SIMPLE = {"class_type": "SkipLayerGuidanceDiTSimple", "inputs": {"double_layers": "0", "single_layers": "",
                                                                     "start_percent": 0.0, "end_percent": 1.0}}


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", strategy(ulysses=2)),
                                            ("cpu:2", strategy(cfg=2))], ids=["1", "ulysses2", "cfg2"])
@pytest.mark.parametrize("patch", [SLG, SLG_SIMPLE], ids=["slg", "slg_simple"])
def test_skip_layer_guidance_equals_unetloader(server, patch, devices, strat):
    bound = ONE_WORKER_RTOL if devices == "cpu:1" else EXACT_RTOL
    assert parity(server, graph("canny", devices, strat, patch=patch), f"{patch['class_type']} {devices}") <= bound


def failure(server, g: dict) -> str:
    """The prompt's error, with only Load Parallel DiT's chain in the graph."""
    result = server.run({k: v for k, v in g.items() if k not in ("20", "21", "22", "23")})
    assert result["status"] == "error", explain(result)
    return result["error"]["exception_message"]


def test_a_code_block_patch_is_refused_in_one_sentence(server):
    message = failure(server, graph("canny", patch={"class_type": "ParaDiTTestCodePatch", "inputs": {}}))
    assert "patches_replace['dit']: ('double_block', 0)) runs its own code" in message
    assert "load the model with UNETLoader" in message


@pytest.mark.parametrize("strat", [strategy(ulysses=2), strategy(pp=2)], ids=["ulysses2", "pp2_warm"])
def test_skip_layer_guidance_under_parallel_sampler_equals_ksampler(server, strat):
    """SkipLayerGuidanceDiT's post-CFG function and block patches: Parallel Sampler runs ComfyUI's sampler."""
    g = comfy_host.with_parallel_sampler(graph("canny", "cpu:2", strat, patch=SLG))
    same, unet, summary = comfy_host.entrance_parity(server, g, f"SLG, Parallel Sampler {strat['inputs']}")
    assert same <= ONE_WORKER_RTOL and unet <= EXACT_RTOL
    assert "per-call pipeline: the graph has a post-CFG function (sampler_post_cfg_function)" in summary


def test_multigpu_cfg_split_copy_is_refused_in_one_sentence(server):
    message = failure(server, graph("canny", patch={"class_type": "ParaDiTTestDeepClone", "inputs": {}}))
    assert message.startswith("MultiGPU CFG Split (MultiGPU_WorkUnits) copies the model onto other GPUs")


# Regional conditioning and inpainting: ComfyUI crops the latent (and the concat image) per area cond and
# combines the predictions itself; each crop is one model call on the workers.

def mask(g: dict, node: str, x: int, y: int, size: int) -> list:
    """A 160x128 MASK with a size x size square of ones at (x, y)."""
    g[f"{node}a"] = {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 160, "height": 128}}
    g[f"{node}b"] = {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": size, "height": size}}
    g[node] = {"class_type": "MaskComposite", "inputs": {"destination": [f"{node}a", 0], "source": [f"{node}b", 0],
                                                         "x": x, "y": y, "operation": "add"}}
    return [node, 0]


def regional(g: dict, bounds: str) -> dict:
    """positive = combine(prompt 5, area of prompt 30 (64x64 at 64,32), mask of prompt 31, prompt 32 from half way)."""
    g["30"] = {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 30, "tokens": 8, "guidance": 3.5}}
    g["31"] = {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 31, "tokens": 8, "guidance": 3.5}}
    g["32"] = {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 32, "tokens": 8, "guidance": 3.5}}
    for n in ("30", "31", "32"):
        g[f"{n}c"] = {"class_type": "ParaDiTTestConcat", "inputs": {"conditioning": [n, 0], "seed": 7, "width": 160,
                                                                    "height": 128, "mask": False}}
    g["33"] = {"class_type": "ConditioningSetArea", "inputs": {"conditioning": ["30c", 0], "width": 64, "height": 64,
                                                               "x": 64, "y": 32, "strength": 0.8}}
    g["34"] = {"class_type": "ConditioningSetMask", "inputs": {"conditioning": ["31c", 0], "mask": mask(g, "35", 16, 48, 64),
                                                               "strength": 1.0, "set_cond_area": bounds}}
    g["36"] = {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["32c", 0], "start": 0.5,
                                                                        "end": 1.0}}
    g["37"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["5", 0], "conditioning_2": ["33", 0]}}
    g["38"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["37", 0], "conditioning_2": ["34", 0]}}
    g["39"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["38", 0], "conditioning_2": ["36", 0]}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"]["positive"] = ["39", 0]
    return g


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", strategy(ulysses=2)),
                                            ("cpu:2", strategy(cfg=2)), ("cpu:2", strategy(ring=2))],
                         ids=["1", "ulysses2", "cfg2", "ring2"])
@pytest.mark.parametrize("bounds", ["default", "mask bounds"])
def test_regional_conditioning_equals_unetloader(server, bounds, devices, strat):
    """Several latent shapes within one step (the full latent, a 64x64 area, a mask's bounds)."""
    bound = ONE_WORKER_RTOL if devices == "cpu:1" else EXACT_RTOL
    assert parity(server, regional(graph("canny", devices, strat), bounds), f"regional {bounds} {devices}") <= bound


@pytest.mark.parametrize("strat", [strategy(ulysses=2), strategy(pp=2)], ids=["ulysses2", "pp2"])
def test_an_area_too_small_for_the_degrees_runs_and_equals_unetloader(server, strat):
    """A 16x16 px mask with "mask bounds" crops the latent to one token: fewer than Ulysses' two ranks, and one row
    PipeFusion's two patches cannot split. Stock KSampler raises nothing there; its calls run as whole-image
    stages (exact). (ConditioningSetArea's own minimum, 64 px, is 16 tokens.)"""
    g = regional(graph("canny", "cpu:2", strat), "mask bounds")
    g["35b"]["inputs"].update(width=16, height=16)
    assert parity(server, g, f"16x16 area, {strat['inputs']}") <= EXACT_RTOL


def inpainting(g: dict, differential: bool, denoise: float) -> dict:
    """SetLatentNoiseMask on the latent (KSampler's inpainting on the host), DifferentialDiffusion, denoise."""
    g["40"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["4", 0], "mask": mask(g, "41", 32, 32, 64)}}
    for sampler in ("12", "21"):
        g[sampler]["inputs"].update(latent_image=["40", 0], denoise=denoise)
    if differential:
        for loader, sampler, node in (("11", "12", "42"), ("20", "21", "43")):
            g[node] = {"class_type": "DifferentialDiffusion", "inputs": {"model": [loader, 0]}}
            g[sampler]["inputs"]["model"] = [node, 0]
    return g


@pytest.mark.parametrize("devices, strat", [("cpu:1", None), ("cpu:2", strategy(ulysses=2)),
                                            ("cpu:2", strategy(pp=2))], ids=["1", "ulysses2", "pp2_warm"])
@pytest.mark.parametrize("differential, denoise", [(False, 1.0), (True, 0.7)], ids=["noise_mask", "differential"])
def test_inpainting_equals_unetloader(server, differential, denoise, devices, strat):
    bound = ONE_WORKER_RTOL if devices == "cpu:1" else EXACT_RTOL
    g = inpainting(graph("fill", devices, strat), differential, denoise)
    assert parity(server, g, f"inpainting differential={differential} {devices}") <= bound


MODEL_SAMPLING = {"class_type": "ModelSamplingFlux", "inputs": {"max_shift": 2.0, "base_shift": 0.3, "width": 160,
                                                                  "height": 128}}


@pytest.mark.parametrize("case", ["regional", "inpainting_differential", "model_sampling", "canny_plain"])
def test_parallel_sampler_runs_what_ksampler_runs(server, case):
    """Area + mask + timestep-range conditioning, a Fill inpaint with SetLatentNoiseMask + DifferentialDiffusion at
    denoise 0.7, and a ModelSamplingFlux shift, under Parallel Sampler on 2 workers: KSampler's latent on the same
    MODEL (routed to ComfyUI's sampler); a plain concat graph stays in the workers' own loop (round-off against
    KSampler's per-call run)."""
    if case == "regional":
        g = regional(graph("canny", "cpu:2", strategy(ulysses=2)), "mask bounds")
    elif case == "inpainting_differential":
        g = inpainting(graph("fill", "cpu:2", strategy(pp=2)), True, 0.7)
    elif case == "model_sampling":
        g = graph("canny", "cpu:2", strategy(ring=2), patch=MODEL_SAMPLING)
    else:
        g = graph("canny", "cpu:2", strategy(ring=2))
    same, unet, summary = comfy_host.entrance_parity(server, comfy_host.with_parallel_sampler(g), case)
    assert same <= ONE_WORKER_RTOL and unet <= EXACT_RTOL
    routed = {"regional": "per-call pipeline: the graph has 4 combined positive conditionings",
              "inpainting_differential": "per-call pipeline: the graph has a denoise mask function",
              "model_sampling": "per-call pipeline: the graph has a patched model (model_sampling"}.get(case)
    assert (routed in summary) if routed else ("per model call" not in summary)


@pytest.mark.parametrize("images", [2, 3], ids=["batch2", "batch3-uneven"])
def test_batch_degree_2_under_ksampler_and_parallel_sampler_equals_unetloader(server, images):
    """A batch of images split over two workers (batch_degree 2): KSampler hands each model call the whole batch's
    cond and uncond chunks, which the workers cut per group; Parallel Sampler's own loop cuts the job. Both give
    UNETLoader's latent, image for image."""
    g = comfy_host.with_parallel_sampler(graph("canny", "cpu:2", strategy(batch=2), images=images))
    same, unet, summary = comfy_host.entrance_parity(server, g, f"canny, batch {images}, batch_degree 2")
    assert same <= EXACT_RTOL and unet <= EXACT_RTOL
    assert "batch2" in summary
    err, par, ref = latent_parity(server, graph("canny", "cpu:2", strategy(batch=2), images=images),
                                  f"canny, batch {images}, KSampler, batch_degree 2")
    assert par.shape == (images, 16, 16, 20) and err <= EXACT_RTOL


# ComfyUI's step caches (EasyCache: a DIFFUSION_MODEL wrapper; LazyCache: a PREDICT_NOISE wrapper) decide on the
# host whether a step reuses its cached residual; a skipped step never reaches the workers. 6 steps at threshold
# 1.0 from the first step on: on this file EasyCache computes steps 0, 1, 3, 5 and skips 2, 4 (a computed step after
# each skip), LazyCache computes 0, 1, 3 and skips 2, 4, 5; the cumulative change rates clear or miss 1.0 by >= 0.1,
# far beyond the strategies' round-off, so every chain takes the same decisions.
CACHE_STEPS = 6
CACHE_SETTINGS = {"reuse_threshold": 1.0, "start_percent": 0.0, "end_percent": 1.0, "verbose": False}
CACHES = {"easycache": {"class_type": "EasyCache", "inputs": CACHE_SETTINGS},
          "lazycache": {"class_type": "LazyCache", "inputs": CACHE_SETTINGS}}
CACHE_SKIPS = {"easycache": ("EasyCache", 2, CACHE_STEPS), "lazycache": ("LazyCache", 3, CACHE_STEPS)}
CACHE_STRATEGIES = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "cfg2": dict(cfg=2), "pp2_warm": dict(pp=2)}


def cached_run(server, g: dict) -> tuple[dict, list[tuple[str, int, int]]]:
    """Run `g`: (its result, the (cache, skipped, steps) each of its sampling runs logged, as in "EasyCache -
    skipped 2/6 steps": the cache node's own count of the model calls it answered instead of the model). A chain
    whose inputs an earlier prompt ran is ComfyUI's cached output and logs nothing."""
    import re

    start = os.path.getsize(server.log)
    result = server.run(g)
    assert result["status"] == "success", explain(result)
    with open(server.log, errors="replace") as f:
        f.seek(start)
        lines = f.read()
    return result, [(name, int(n), int(m)) for name, n, m in
                    re.findall(r"(EasyCache|LazyCache) - skipped (\d+)/(\d+) steps", lines)]


def cache_graph(cache: str, degrees: dict, warmup: int = CACHE_STEPS) -> dict:
    return graph("canny", "cpu:2", comfy_host.strategy(warmup=warmup, **degrees), patch=CACHES[cache],
                 steps=CACHE_STEPS)


@pytest.mark.parametrize("degrees", list(CACHE_STRATEGIES.values()), ids=list(CACHE_STRATEGIES))
@pytest.mark.parametrize("cache", list(CACHES))
def test_step_cache_on_the_parallel_model_equals_unetloader(server, cache, degrees):
    """EasyCache / LazyCache between each loader and KSampler: the same steps skipped, the same latent (PipeFusion
    with warmup_steps = steps: every computed step runs the whole image, exact)."""
    result, skips = cached_run(server, cache_graph(cache, degrees))
    par, ref = server.latent(result, "13"), server.latent(result, "22")
    err = rel_err(par, ref)
    print(f"\n{cache} {degrees}: rel. L2 {err:.2e} vs UNETLoader; skipped {skips}")
    # The parallel chain always runs (its strategy is new), UNETLoader's the first time only: each run skipped the
    # steps this file's cache skips (a cache whose wrapper never ran would log 0 skipped).
    assert 1 <= len(skips) <= 2 and set(skips) == {CACHE_SKIPS[cache]}, skips
    assert err <= ONE_WORKER_RTOL


def test_step_cache_under_parallel_sampler_equals_ksampler(server):
    """Parallel Sampler on the EasyCache'd MODEL routes the graph to ComfyUI's sampler (the cache's wrappers are
    the host's): KSampler's latent on the same MODEL and UNETLoader's, the same steps skipped."""
    g = comfy_host.with_parallel_sampler(cache_graph("easycache", dict(ulysses=2)))
    result, skips = cached_run(server, g)
    same, unet = (rel_err(server.latent(result, "99"), server.latent(result, other)) for other in ("13", "22"))
    summary = " ".join(result["outputs"]["98"].get("text", []))
    print(f"\nEasyCache, Parallel Sampler, Ulysses 2: vs KSampler on the same MODEL {same:.2e}, vs UNETLoader "
          f"{unet:.2e}; skipped {skips} [{summary}]")
    assert same <= ONE_WORKER_RTOL and unet <= ONE_WORKER_RTOL
    assert "per-call pipeline: the graph has a model wrapper (easycache)" in summary
    # Parallel Sampler's run logs (KSampler's and UNETLoader's chains ran in an earlier prompt when the module runs
    # whole: ComfyUI's cache).
    assert 1 <= len(skips) <= 3 and set(skips) == {CACHE_SKIPS["easycache"]}, skips


def test_pipefusion_beyond_warmup_with_a_step_cache_next_to_naive_patch(server):
    """PipeFusion 2 with one warm-up step under EasyCache: each computed step after the first reads the other
    patch's K/V as the last computed step left them (two schedule steps old after a skip; the skipped step
    reaches no worker and leaves them as they were). Its error against UNETLoader + EasyCache, next to naive patch 2
    + EasyCache's and next to both without the cache (same file, steps and seed), printed for the docs."""
    g = cache_graph("easycache", dict(pp=2), warmup=1)
    chains = {"naive_cached": ("50", True), "pp_plain": ("11", False), "naive_plain": ("50", False),
              "unet_plain": ("20", False)}
    g["50"] = {"class_type": "ParaDiTTestNaivePatch", "inputs": {"model": ["11", 0], "degree": 2}}
    for n, (name, (model, cached)) in enumerate(chains.items()):
        sampler, save, patched = (str(60 + 3 * n + k) for k in range(3))
        if cached:
            g[patched] = {"class_type": "EasyCache", "inputs": dict(CACHE_SETTINGS, model=[model, 0])}
            model = patched
        g[sampler] = {"class_type": "KSampler", "inputs": dict(g["12"]["inputs"], model=[model, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"c/{save}"}}
    result, skips = cached_run(server, g)
    latent = {name: server.latent(result, str(61 + 3 * n)) for n, name in enumerate(chains)}
    latent.update(pp_cached=server.latent(result, "13"), unet_cached=server.latent(result, "22"))
    errors = {"pipefusion2 + EasyCache": rel_err(latent["pp_cached"], latent["unet_cached"]),
              "naive patch2 + EasyCache": rel_err(latent["naive_cached"], latent["unet_cached"]),
              "pipefusion2": rel_err(latent["pp_plain"], latent["unet_plain"]),
              "naive patch2": rel_err(latent["naive_plain"], latent["unet_plain"]),
              "EasyCache itself (serial)": rel_err(latent["unet_cached"], latent["unet_plain"])}
    print("\n" + "; ".join(f"{k} {v:.2e}" for k, v in errors.items()) + f"; skipped {skips}")
    # The cached chains skip the same steps (2 and 4): PipeFusion's and naive patch's differences from UNETLoader's
    # outputs (~1e-2) move the change rates far less than their 0.1 margin to the threshold. (Both parallel chains
    # are new to this prompt; UNETLoader's logs only when no earlier prompt ran it.)
    assert 2 <= len(skips) <= 3 and set(skips) == {CACHE_SKIPS["easycache"]}, skips
    # The skip leaves the stale K/V as the last computed step left them, two steps old: PipeFusion's error grows a
    # little (measured 1.14e-2 with EasyCache vs 9.62e-3 without), far from a corrupted buffer's (zero or another
    # step's layout), and stays well below naive patch's with the same cache (4.47e-2).
    assert errors["pipefusion2 + EasyCache"] <= 2 * errors["pipefusion2"]
    assert errors["pipefusion2 + EasyCache"] <= 0.5 * errors["naive patch2 + EasyCache"]
