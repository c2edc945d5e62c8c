"""One model call per sampler evaluation (a stock ComfyUI sampler's way in): the sampling loop runs here, in the
test, as KSampler runs it on the host, and every evaluation is a runtime job carrying ComfyUI's model inputs
(input-scaled x, the model's timestep, cond and uncond chunks batched). The loop's result must equal Parallel
Sampler's own job on the same file, per family (flow and EPS models, t in each family's own units) and under
every exact strategy.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_err
from test_families import FAMILIES, LATENT_SIZE, conditioning
from parallel_runtime.models.registry import read_model
from parallel_runtime.weights.checkpoint import CheckpointReader
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.sampling import cfg_combine, final_latent, ksampler_sigmas, prepare_noise, start_latent
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.attention.processor import AttentionContext

pytestmark = pytest.mark.timeout(600)

# Exact strategies split sums differently (~1e-7 per op); the host loop redoes the sampler's float32 maths in
# another order (~1e-7). A wrong timestep unit, chunk order or input scaling is off by 1e-2 or more.
CALL_RTOL = 1e-4
STEPS, CFG, SEED = 4, 2.5, 5
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]  # kontext: a Flux.1 dev file


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    name = request.param
    path = str(tmp_path_factory.mktemp(name) / f"{name}.safetensors")
    write_checkpoint(path, FAMILIES[name], seed=11, prefix="model.diffusion_model.")
    with CheckpointReader(path) as reader:
        fam, match, config = read_model(reader)
        model = fam.build(config, reader, match, owned=lambda n: True, dtype=torch.float32, device="cpu")
    adapter = fam.adapter(config, model, fam.pipeline_stages(config, 1)[0], AttentionContext())
    return name, path, adapter


def latent_of(name: str) -> torch.Tensor:
    h, w = LATENT_SIZE.get(name, (16, 24))
    return torch.zeros(2, FAMILIES[name].latent_channels, h, w)


def prompts(name: str):
    config = FAMILIES[name]
    return conditioning(config, 1), conditioning(config, 2)


def host_loop(client: RuntimeClient, name: str, path: str, adapter, strategy: S) -> torch.Tensor:
    """KSampler with euler/simple on the host: one runtime call per step, [cond chunk; uncond chunk] batched."""
    ms, lf = adapter.model_sampling, adapter.latent_format
    latent = latent_of(name)
    sigmas = ksampler_sigmas(ms, "simple", STEPS)
    x = start_latent(latent, prepare_noise(latent, SEED), sigmas[0], lf, ms)
    positive, negative = prompts(name)
    b = latent.shape[0]
    for i in range(STEPS):
        sigma = sigmas[i]
        x_in = ms.calculate_input(sigma, x).repeat(2, 1, 1, 1)
        t = ms.timestep(sigma.expand(2 * b)).float()
        call = Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x_in, positive, negative, timestep=t,
                   call_step=i)
        out = client.run(call).latent
        cond, uncond = (ms.calculate_denoised(sigma, o, x) for o in out.chunk(2))
        denoised = cfg_combine(cond, uncond, CFG)
        x = x + (x - denoised) / sigma * (sigmas[i + 1] - sigma)  # k-diffusion's euler step
    return final_latent(x, sigmas[-1], lf, ms)


@pytest.fixture(scope="module")
def parallel_sampler(client1, family):
    """Parallel Sampler's own loop (the whole denoise on the workers) at one worker: the reference."""
    name, path, _ = family
    positive, negative = prompts(name)
    job = Job(ModelSpec(path), S(), SamplingSpec(seed=SEED, steps=STEPS, cfg=CFG), latent_of(name), positive,
              negative)
    out = client1.run(job).latent
    return out.squeeze(2) if out.ndim == 5 else out


def test_host_loop_of_calls_equals_parallel_sampler_at_one_worker(client1, family, parallel_sampler):
    name, path, adapter = family
    got = host_loop(client1, name, path, adapter, S())
    assert rel_err(got, parallel_sampler) <= CALL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(patch_degree=2, warmup_steps=STEPS)],  # displaced patch, all warm-up
                         ids=lambda s: s.label())
def test_calls_under_exact_strategies_equal_parallel_sampler(family, parallel_sampler, client2, strategy):
    name, path, adapter = family
    assert rel_err(host_loop(client2, name, path, adapter, strategy), parallel_sampler) <= CALL_RTOL


def test_calls_under_pipefusion_warmed_up_throughout_equal_parallel_sampler(family, parallel_sampler, client2):
    """PipeFusion within each call, every step a warm-up step: the whole image through both stages, exact."""
    name, path, adapter = family
    strategy = S(pipefusion_degree=2, warmup_steps=STEPS)
    assert rel_err(host_loop(client2, name, path, adapter, strategy), parallel_sampler) <= CALL_RTOL


def test_calls_under_pipefusion_with_stale_kv_equal_parallel_samplers_pipefusion(family, parallel_sampler, client2):
    """After one warm-up step each call pipelines its patches over stale K/V from the previous call. The staleness
    is the same as in Parallel Sampler's cross-step pipeline (patches before this one fresh, after it one
    evaluation old), so the two agree to round-off while both differ from the exact result."""
    _calls_equal_parallel_samplers_own(family, parallel_sampler, client2,
                                       S(pipefusion_degree=2, warmup_steps=1, num_pipeline_patch=2), "PipeFusion")


def _calls_equal_parallel_samplers_own(family, parallel_sampler, client2, strategy: S, what: str) -> None:
    """A stale-K/V strategy per call equals Parallel Sampler's own run of it (same staleness) to round-off, while
    both differ from the exact result."""
    name, path, adapter = family
    positive, negative = prompts(name)
    own = client2.run(Job(ModelSpec(path), strategy, SamplingSpec(seed=SEED, steps=STEPS, cfg=CFG), latent_of(name),
                          positive, negative)).latent
    own = own.squeeze(2) if own.ndim == 5 else own
    calls = host_loop(client2, name, path, adapter, strategy)
    print(f"\n{name}: per-call {what} vs Parallel Sampler's {rel_err(calls, own):.2e}, "
          f"vs exact {rel_err(calls, parallel_sampler):.2e}")
    assert rel_err(calls, own) <= CALL_RTOL
    assert rel_err(calls, parallel_sampler) > CALL_RTOL  # stale K/V really was read


def test_calls_under_displaced_patch_equal_parallel_samplers_displaced_patch(family, parallel_sampler, client2):
    """After one warm-up call each call's patches attend to the other patch's K/V of the slot's previous call: the
    staleness of Parallel Sampler's displaced patch loop (one evaluation), so the two agree to round-off while both
    differ from the exact result."""
    _calls_equal_parallel_samplers_own(family, parallel_sampler, client2, S(patch_degree=2, warmup_steps=1),
                                       "displaced patch")


def test_a_call_returns_the_raw_model_output_of_each_chunk_in_order(family, client2):
    """Swapping the chunks swaps the output halves (cond/uncond order is ComfyUI's, not ours), and a one-chunk
    call (cfg 1) under CFG parallel gives the same rows as the first half of a two-chunk call."""
    name, path, adapter = family
    positive, negative = prompts(name)
    x = torch.randn(latent_of(name).shape, generator=torch.Generator().manual_seed(3)).repeat(2, 1, 1, 1)
    t = adapter.model_sampling.timestep(torch.full((x.shape[0],), 0.7)).float()
    job = Job(ModelSpec(path), S(cfg_degree=2), SamplingSpec(steps=1), x, positive, negative, timestep=t)
    both = client2.run(job).latent
    swapped = client2.run(dataclasses.replace(job, positive=negative, negative=positive)).latent
    one = client2.run(dataclasses.replace(job, latent=x[:2], negative=None, timestep=t[:2])).latent
    assert torch.allclose(both[:2], swapped[2:], rtol=0, atol=1e-6) and torch.allclose(both[2:], swapped[:2],
                                                                                        rtol=0, atol=1e-6)
    assert rel_err(one, both[:2]) <= CALL_RTOL
    assert rel_err(both[:2], both[2:]) > 1e-3  # the two prompts really differ


def test_pipefusion_jobs_of_one_call_keep_their_own_stale_kv(family, client2):
    """A call of four chunks (two prompt pairs, as ConditioningCombine makes) is two jobs per step. Each keeps its
    own stale K/V, so pair A's result with pair B beside it equals pair A's alone; shared buffers would let one
    pair's patches attend to the other's keys."""
    name, path, adapter = family
    ms, lf = adapter.model_sampling, adapter.latent_format
    strategy = S(pipefusion_degree=2, warmup_steps=1, num_pipeline_patch=2)
    config = FAMILIES[name]
    pairs = [(conditioning(config, 1), conditioning(config, 2)), (conditioning(config, 3), conditioning(config, 4))]

    def run(pairs_used):
        latent = latent_of(name)
        sigmas = ksampler_sigmas(ms, "simple", STEPS)
        x = start_latent(latent, prepare_noise(latent, SEED), sigmas[0], lf, ms)
        b = latent.shape[0]
        for i in range(STEPS):
            sigma = sigmas[i]
            x_in = ms.calculate_input(sigma, x).repeat(2, 1, 1, 1)
            t = ms.timestep(sigma.expand(2 * b)).float()
            outs = [client2.run(Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x_in, pos, neg, timestep=t,
                                    call_step=i, call_slot=slot, call_last=i == STEPS - 1)).latent
                    for slot, (pos, neg) in enumerate(pairs_used)]
            cond, uncond = (ms.calculate_denoised(sigma, o, x) for o in outs[0].chunk(2))  # pair A drives x
            x = x + (x - cfg_combine(cond, uncond, CFG)) / sigma * (sigmas[i + 1] - sigma)
        return x

    assert rel_err(run(pairs), run(pairs[:1])) <= CALL_RTOL


def test_pipefusion_cond_and_uncond_in_separate_calls_equal_one_call_of_both(family, client2):
    """Where ComfyUI runs cond and uncond as separate calls, each job's slot (nodes/remote_model.py: 0 for the cond,
    1 for the uncond) keeps its own stale K/V: the run equals the one that batches both into one call. Sharing a
    slot, the uncond's patches would attend to the cond's keys of the step before (3e-2 off on most families)."""
    name, path, adapter = family
    ms, lf = adapter.model_sampling, adapter.latent_format
    strategy = S(pipefusion_degree=2, warmup_steps=1, num_pipeline_patch=2)
    pos, neg = conditioning(FAMILIES[name], 1), conditioning(FAMILIES[name], 2)

    def run(slots):
        latent = latent_of(name)
        sigmas = ksampler_sigmas(ms, "simple", STEPS)
        x = start_latent(latent, prepare_noise(latent, SEED), sigmas[0], lf, ms)
        for i in range(STEPS):
            sigma = sigmas[i]
            x_in, t = ms.calculate_input(sigma, x), ms.timestep(sigma.expand(latent.shape[0])).float()
            last = i == STEPS - 1  # the step's last job ends the run (the workers then drop their stale K/V)
            if slots is None:  # one call of both chunks
                both = client2.run(Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x_in.repeat(2, 1, 1, 1), pos,
                                       neg, timestep=t.repeat(2), call_step=i, call_last=last)).latent.chunk(2)
            else:
                both = [client2.run(Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x_in, c, None, timestep=t,
                                        call_step=i, call_slot=slot, call_last=last and c is neg)).latent
                        for c, slot in zip((pos, neg), slots)]
            cond, uncond = (ms.calculate_denoised(sigma, o, x) for o in both)
            x = x + (x - cfg_combine(cond, uncond, CFG)) / sigma * (sigmas[i + 1] - sigma)
        return x

    together = run(None)
    apart, shared = run((0, 1)), run((0, 0))
    print(f"\n{name}: separate calls {rel_err(apart, together):.1e}, sharing one slot {rel_err(shared, together):.1e}")
    assert rel_err(apart, together) <= CALL_RTOL
    assert rel_err(shared, together) > 10 * CALL_RTOL


def test_pipefusion_call_after_a_cache_skipped_step_reads_the_last_computed_calls_kv(family, client2):
    """A step cache (ComfyUI's EasyCache) answers step 2 on the host: the workers get calls for steps 0, 1 and 3
    only, each job keyed by its schedule step. Step 3 then attends to the other patch's K/V as step 1's call left
    them: where step 1 ran the same input exactly (its warm-up), step 3 is exact too, and after a step 1 of
    another input it is not (the stale K/V really are step 1's). Where step 3 is itself below warmup_steps it runs
    the whole image (exact) whatever came before."""
    name, path, adapter = family
    positive, negative = prompts(name)
    g = torch.Generator().manual_seed(4)
    x_a, x_b = (torch.randn(latent_of(name).shape, generator=g).repeat(2, 1, 1, 1) for _ in range(2))
    t = adapter.model_sampling.timestep(torch.full((x_a.shape[0],), 0.6)).float()

    def calls(warmup: int, inputs: dict) -> torch.Tensor:
        """The calls of `inputs` (schedule step -> latent) in order; the last call's output."""
        strategy = S(pipefusion_degree=2, warmup_steps=warmup, num_pipeline_patch=2)
        for step, x in inputs.items():
            out = client2.run(Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x, positive, negative,
                                  timestep=t, call_step=step, call_last=False)).latent
        return out

    exact = calls(warmup=1, inputs={0: x_b})  # a warm-up call: the whole image at once
    fresh = calls(warmup=2, inputs={0: x_a, 1: x_b, 3: x_b})
    stale = calls(warmup=2, inputs={0: x_a, 1: x_a, 3: x_b})
    warm = calls(warmup=4, inputs={0: x_a, 1: x_a, 3: x_b})
    print(f"\n{name}: after a skipped step {rel_err(fresh, exact):.1e} (step 1 same input), "
          f"{rel_err(stale, exact):.1e} (another), {rel_err(warm, exact):.1e} (warm-up)")
    assert rel_err(fresh, exact) <= CALL_RTOL
    assert rel_err(stale, exact) > 10 * CALL_RTOL
    assert rel_err(warm, exact) <= CALL_RTOL
