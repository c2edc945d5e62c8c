"""PipeFusion without CFG parallel when the positive and negative differ in token layout, on CPU/gloo workers.

Prompts of different lengths (T5-only encoders do not pad them) and a ReferenceLatent on one side only (a Kontext
negative often has none) cannot share one batch: serial runs them as two forward passes, as ComfyUI does. PipeFusion
runs one pipeline lane per layout through the same stages, each with its own stale K/V buffers, and the last stage
applies CFG and the sampler step once it has both lanes' prediction of a patch. Warm-up steps are exact, so a run
that is all warm-up equals serial; after warm-up it must stay closer to serial than naive patch parallelism. The
stock-sampler way in (one runtime job per model call) runs the same lanes call by call.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_conditioning, make_job, rel_err
from parallel_runtime.models.registry import read_model
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.sampling import cfg_combine, final_latent, ksampler_sigmas, prepare_noise, start_latent
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.weights.checkpoint import CheckpointReader

pytestmark = pytest.mark.timeout(600)

# As tests/test_parallel.py: exact strategies change only summation order (~3e-7 measured); a lane reading the
# other's rows, prompt or buffers is off by 1e-2 or more.
EXACT_RTOL = 1e-4
STEPS = 6


def unequal_prompts(path: str, strategy: S | None = None, warmup: int | None = None) -> Job:
    """A 7-token positive and an 11-token negative prompt."""
    return dataclasses.replace(_job(path, strategy, warmup), negative=make_conditioning(2, text_len=11))


def reference_on_one_side(path: str, strategy: S | None = None, warmup: int | None = None) -> Job:
    """A Kontext positive with one reference latent (30 tokens beside the 64 image tokens), a negative without."""
    j = _job(path, strategy, warmup)
    reference = torch.randn(1, 16, 12, 10, generator=torch.Generator().manual_seed(4))
    return dataclasses.replace(j, positive=dataclasses.replace(j.positive, references=(reference,)))


def _job(path: str, strategy: S | None, warmup: int | None) -> Job:
    if strategy is not None and warmup is not None:
        strategy = dataclasses.replace(strategy, warmup_steps=warmup)
    return make_job(path, strategy, steps=STEPS)


CASES = {"prompts_7_11": unequal_prompts, "reference_on_positive_only": reference_on_one_side}


@pytest.fixture(scope="module")
def serial(client1, tiny_path):
    return {name: client1.run(case(tiny_path)).latent for name, case in CASES.items()} | {
        "same_layout": client1.run(make_job(tiny_path, steps=STEPS)).latent}


def test_the_cases_really_differ_in_layout(serial):
    for name in CASES:
        assert rel_err(serial[name], serial["same_layout"]) > 1e-3, name  # another input, not the same run


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", [S(pipefusion_degree=2), S(pipefusion_degree=2, num_pipeline_patch=4)],
                         ids=lambda s: s.label())
def test_all_warmup_equals_serial_on_two(client2, tiny_path, serial, case, strategy):
    job = CASES[case](tiny_path, strategy, warmup=STEPS)
    err = rel_err(client2.run(job).latent, serial[case])
    print(f"\n{case}, {job.strategy.label()} (all warm-up): {err:.2e}")
    assert err <= EXACT_RTOL


@pytest.mark.parametrize("case", list(CASES))
def test_all_warmup_equals_serial_under_pipefusion_times_ulysses(client4, tiny_path, serial, case):
    job = CASES[case](tiny_path, S(pipefusion_degree=2, ulysses_degree=2), warmup=STEPS)
    err = rel_err(client4.run(job).latent, serial[case])
    print(f"\n{case}, {job.strategy.label()} (all warm-up): {err:.2e}")
    assert err <= EXACT_RTOL


@pytest.mark.parametrize("case", list(CASES))
def test_stale_lanes_are_closer_than_naive_patch(client2, client4, tiny_path, serial, case):
    for client, stale, naive in ((client2, S(pipefusion_degree=2), S(naive_patch_degree=2)),
                                 (client4, S(pipefusion_degree=2, ulysses_degree=2), S(naive_patch_degree=4))):
        e_stale = rel_err(client.run(CASES[case](tiny_path, stale, warmup=1)).latent, serial[case])
        e_naive = rel_err(client.run(CASES[case](tiny_path, naive)).latent, serial[case])
        print(f"\n{case}, {stale.label()} (1 warm-up step of {STEPS}): {e_stale:.2e}; {naive.label()}: {e_naive:.2e}")
        assert e_stale > EXACT_RTOL  # the stale K/V really was read
        assert e_stale < e_naive / 2  # one step of staleness costs far less than never seeing the other patch


# -- the stock-sampler way in: one runtime job per model call ------------------------------------------------

@pytest.fixture(scope="module")
def adapter(tiny_path):
    with CheckpointReader(tiny_path) as reader:
        fam, match, config = read_model(reader)
        model = fam.build(config, reader, match, owned=lambda n: True, dtype=torch.float32, device="cpu")
    return fam.adapter(config, model, fam.pipeline_stages(config, 1)[0], AttentionContext())


def host_loop(client: RuntimeClient, adapter, job: Job, strategy: S) -> torch.Tensor:
    """KSampler with euler on the host: one runtime call per step, [cond chunk; uncond chunk] in one call."""
    ms, lf, sp = adapter.model_sampling, adapter.latent_format, job.sampling
    sigmas = ksampler_sigmas(ms, sp.scheduler, sp.steps)
    x = start_latent(job.latent, prepare_noise(job.latent, sp.seed), sigmas[0], lf, ms)
    for i in range(sp.steps):
        sigma = sigmas[i]
        x_in = ms.calculate_input(sigma, x).repeat(2, 1, 1, 1)
        call = Job(ModelSpec(job.model.path), strategy, SamplingSpec(steps=1), x_in, job.positive, job.negative,
                   timestep=ms.timestep(sigma.expand(2)).float(), call_step=i)
        cond, uncond = (ms.calculate_denoised(sigma, o, x) for o in client.run(call).latent.chunk(2))
        x = x + (x - cfg_combine(cond, uncond, sp.cfg)) / sigma * (sigmas[i + 1] - sigma)  # k-diffusion's euler
    return final_latent(x, sigmas[-1], lf, ms)


@pytest.mark.parametrize("case", list(CASES))
def test_model_calls_run_each_layout_in_its_own_lane(client1, client2, adapter, tiny_path, case):
    job = CASES[case](tiny_path)
    serial = host_loop(client1, adapter, job, S())
    warm = rel_err(host_loop(client2, adapter, job, S(pipefusion_degree=2, warmup_steps=STEPS)), serial)
    stale = rel_err(host_loop(client2, adapter, job, S(pipefusion_degree=2, warmup_steps=1)), serial)
    naive = rel_err(host_loop(client2, adapter, job, S(naive_patch_degree=2)), serial)
    print(f"\n{case}, per call: pp2 all warm-up {warm:.2e}, 1 warm-up call {stale:.2e}, naive patch {naive:.2e}")
    assert warm <= EXACT_RTOL
    assert EXACT_RTOL < stale < naive
