"""parallel_runtime.sampling against ComfyUI's KSampler math.

Reference numbers come from formulas written out here (from reading ComfyUI's
comfy/model_sampling.py, comfy/samplers.py, comfy/k_diffusion/sampling.py).
With COMFYUI_DIR pointing at a ComfyUI checkout whose `comfy` imports, the last
group of tests also compares against ComfyUI's own functions.
"""
from __future__ import annotations

import math
import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.special
import torch

from parallel_runtime.errors import ConfigError
from parallel_runtime.sampling import (
    FLUX_LATENT_SCALE,
    FLUX_LATENT_SHIFT,
    SAMPLERS,
    SCHEDULERS,
    StepNoise,
    calculate_sigmas,
    cfg_combine,
    cfg_uses_uncond,
    denoised_from_velocity,
    final_latent,
    flux_shift_for_resolution,
    inverse_noise_scaling,
    ksampler_sigmas,
    make_sampler,
    model_sampling_for,
    noise_scaling,
    prepare_noise,
    process_latent_in,
    process_latent_out,
    start_latent,
)
from parallel_runtime.sampling.flow import FluxModelSampling

B, C, H, W = 2, 16, 16, 12
SHAPE = (B, C, H, W)
L = (H // 2) * (W // 2)


def pack(t):
    """Flux's 2x2 patchify: [B,C,H,W] -> [B, L, C*4]."""
    return t.reshape(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, L, C * 4)


def unpack(t):
    return t.reshape(B, H // 2, W // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# --- independent formulas (float64) -----------------------------------------

def dev_sigma(t, mu=1.15):
    """flux_time_shift(mu, 1, t) = e^mu / (e^mu + 1/t - 1)."""
    return math.exp(mu) / (math.exp(mu) + 1.0 / t - 1.0)


def table(variant):
    if variant == "dev":
        return [dev_sigma((k + 1) / 10000) for k in range(10000)]
    return [(k + 1) / 1000 for k in range(1000)]


def ref_schedule(variant, scheduler, steps):
    tab = table(variant)
    n = len(tab)
    sigma = dev_sigma if variant == "dev" else (lambda t: t)
    smax, smin = tab[-1], tab[0]
    if scheduler == "simple":
        return [tab[n - 1 - int(x * n / steps)] for x in range(steps)] + [0.0]
    if scheduler in ("normal", "sgm_uniform"):
        # timestep(sigma) is sigma for both variants, so sigma() is applied to table values again.
        if scheduler == "sgm_uniform":
            ts = np.linspace(smax, smin, steps + 1)[:-1]
        else:
            ts = np.linspace(smax, smin, steps)
        return [sigma(float(t)) for t in ts] + [0.0]
    if scheduler == "beta":
        q = scipy.special.betaincinv(0.6, 0.6, 1 - np.arange(steps) / steps)
        idx = np.rint(q * (n - 1)).astype(int)
        keep = [int(i) for j, i in enumerate(idx) if j == 0 or i != idx[j - 1]]
        return [tab[i] for i in keep] + [0.0]
    raise AssertionError(scheduler)


# --- tables and schedules -------------------------------------------------------

def test_dev_table_matches_flux_time_shift():
    ms = model_sampling_for("dev")
    assert ms.sigmas.dtype == torch.float32 and ms.sigmas.shape == (10000,)
    ref = torch.tensor(table("dev"), dtype=torch.float64)
    assert rel_err(ms.sigmas, ref) < 1e-6
    assert float(ms.sigma_max) == 1.0
    assert abs(float(ms.sigma_min) - dev_sigma(1e-4)) < 1e-9
    assert float(ms.timestep(torch.tensor(0.5))) == 0.5  # the network scales time itself


def test_schnell_table_is_discrete_flow_shift_1():
    ms = model_sampling_for("schnell")
    assert ms.sigmas.shape == (1000,)
    assert torch.equal(ms.sigmas, torch.arange(1, 1001) / 1000)
    assert float(ms.sigma(torch.tensor(0.25))) == 0.25


def test_discrete_flow_shift_and_resolution_shift():
    ms = FluxModelSampling(3.0, 1.0, kind="discrete_flow")
    t = torch.tensor([0.1, 0.5, 0.9])
    assert rel_err(ms.sigma(t), 3 * t.double() / (1 + 2 * t.double())) < 1e-6
    # ModelSamplingFlux node: 1024x1024 -> 4096 tokens -> max_shift; 256 tokens -> base_shift.
    assert flux_shift_for_resolution(1024, 1024) == pytest.approx(1.15)
    assert flux_shift_for_resolution(512, 512) == pytest.approx(0.5 + 0.65 * (1024 - 256) / 3840)
    assert float(model_sampling_for("dev", shift=0.5).sigmas[4999]) == pytest.approx(dev_sigma(0.5, 0.5), rel=1e-6)


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_schedules_match_formulas(variant, scheduler, steps):
    got = calculate_sigmas(model_sampling_for(variant), scheduler, steps)
    ref = ref_schedule(variant, scheduler, steps)
    assert got.dtype == torch.float32
    assert got.shape == (len(ref),)
    if scheduler != "beta":
        assert len(ref) == steps + 1
    assert float(got[-1]) == 0.0
    assert rel_err(got, torch.tensor(ref, dtype=torch.float64)) < 1e-6


def test_simple_dev_four_steps_values():
    got = calculate_sigmas(model_sampling_for("dev"), "simple", 4)
    ref = [1.0, dev_sigma(0.75), dev_sigma(0.5), dev_sigma(0.25), 0.0]
    assert got.tolist() == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_ksampler_sigmas_denoise_half(scheduler):
    ms = model_sampling_for("dev")
    got = ksampler_sigmas(ms, scheduler, 10, 0.5)
    full = ref_schedule("dev", scheduler, 20)  # int(10 / 0.5) steps, keep the last 11
    assert rel_err(got, torch.tensor(full[-11:], dtype=torch.float64)) < 1e-6
    assert torch.equal(ksampler_sigmas(ms, scheduler, 10, 1.0), calculate_sigmas(ms, scheduler, 10))
    assert ksampler_sigmas(ms, scheduler, 10, 0.0).numel() == 0
    # int() truncation: 7 / 0.3 = 23.33 -> a 23-step schedule.
    assert torch.equal(ksampler_sigmas(ms, scheduler, 7, 0.3), calculate_sigmas(ms, scheduler, 23)[-8:])


def test_unknown_names_raise_config_error():
    ms = model_sampling_for("dev")
    with pytest.raises(ConfigError, match="simple, normal, beta, sgm_uniform"):
        calculate_sigmas(ms, "karras", 10)
    with pytest.raises(ConfigError, match="simple, normal, beta, sgm_uniform"):
        ksampler_sigmas(ms, "karras", 10, 0.5)
    with pytest.raises(ConfigError, match="euler, euler_ancestral, dpmpp_2m"):
        make_sampler("heun", calculate_sigmas(ms, "simple", 4), 0, SHAPE)
    with pytest.raises(ConfigError, match="dev, schnell"):
        model_sampling_for("pro")
    with pytest.raises(ConfigError):
        calculate_sigmas(ms, "simple", 0)


# --- latent/noise parametrisation ---------------------------------------------------

def test_flow_helpers():
    g = torch.Generator().manual_seed(1)
    noise, latent, v = (torch.randn(SHAPE, generator=g) for _ in range(3))
    s = torch.tensor(0.75)
    assert torch.equal(noise_scaling(s, noise, latent), s * noise + (1.0 - s) * latent)
    assert torch.equal(noise_scaling(0.75, noise, latent), noise_scaling(s, noise, latent))
    assert torch.equal(inverse_noise_scaling(torch.tensor(0.0), latent), latent)
    assert torch.equal(inverse_noise_scaling(s, latent), latent / 0.25)
    assert torch.equal(denoised_from_velocity(latent, v, s), latent - v * s)
    per_batch = torch.tensor([0.5, 0.25])
    assert torch.equal(denoised_from_velocity(latent, v, per_batch), latent - v * per_batch.view(B, 1, 1, 1))
    assert (FLUX_LATENT_SCALE, FLUX_LATENT_SHIFT) == (0.3611, 0.1159)
    assert torch.equal(process_latent_in(latent), (latent - 0.1159) * 0.3611)
    assert rel_err(process_latent_out(process_latent_in(latent)), latent) < 1e-6
    # An empty latent is not shifted; a real one is.
    zeros = torch.zeros(SHAPE)
    assert torch.equal(start_latent(zeros, noise, torch.tensor(1.0)), noise)
    assert torch.equal(start_latent(latent, noise, s), noise_scaling(s, noise, process_latent_in(latent)))
    assert torch.equal(final_latent(latent, torch.tensor(0.0)), process_latent_out(latent))


def test_cfg_combine():
    g = torch.Generator().manual_seed(2)
    cond, uncond = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    assert torch.equal(cfg_combine(cond, uncond, 3.5), uncond + (cond - uncond) * 3.5)
    assert torch.equal(cfg_combine(cond, None, 1.0), cond)
    assert not cfg_uses_uncond(1.0) and cfg_uses_uncond(1.5)


def test_prepare_noise_is_seeded_cpu_randn():
    latent = torch.zeros(SHAPE)
    for seed in (0, 42, 2**63 + 5):
        torch.manual_seed(seed)
        expected = torch.randn(SHAPE)
        assert torch.equal(prepare_noise(latent, seed), expected)


def test_step_noise_order_and_which_steps_draw():
    seed = 7
    g = torch.Generator().manual_seed(seed)
    draws = [torch.randn(SHAPE, generator=g) for _ in range(5)]

    sn = StepNoise(seed, SHAPE)
    assert torch.equal(sn.at(3), draws[3])  # earlier draws are made first
    assert torch.equal(sn.at(1), draws[1])
    assert sn.at(3) is sn.at(3)
    sn.drop_before(4)
    assert torch.equal(sn.at(2), draws[2])  # replayed from the seed
    assert torch.equal(sn.at(4), draws[4])

    # Ending in 0: no draw on the last step. Ending above 0 (KSamplerAdvanced last_step): it draws.
    sn = StepNoise(seed, SHAPE, sigmas=torch.tensor([1.0, 0.6, 0.3, 0.0]))
    assert [sn.draws_at(i) for i in range(3)] == [True, True, False]
    with pytest.raises(ValueError):
        sn.at(2)
    sn = StepNoise(seed, SHAPE, sigmas=torch.tensor([1.0, 0.6, 0.3, 0.1]))
    assert torch.equal(sn.at(2), draws[2])


# --- samplers: ComfyUI's loops, written plainly on the whole latent ------------------------

def toy_bias():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(123))


def toy_denoiser(x, sigma):
    """A fixed affine 'model' so both sides see the same denoised for the same x."""
    return 0.7 * x + sigma * toy_bias() - 0.1


def reference_sample(name, x, sigmas, seed):
    """comfy.k_diffusion.sampling sample_euler / sample_euler_ancestral_RF / sample_dpmpp_2m (defaults)."""
    generator = torch.Generator(device=x.device)
    generator.manual_seed(seed)
    noise_sampler = lambda s, sn: torch.randn(x.size(), dtype=x.dtype, device=x.device, generator=generator)
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = toy_denoiser(x, sigmas[i])
        if name == "euler":
            d = (x - denoised) / sigmas[i]
            dt = sigmas[i + 1] - sigmas[i]
            x = x + d * dt
        elif name == "euler_ancestral":
            if sigmas[i + 1] == 0:
                x = denoised
            else:
                eta = 1.0
                downstep_ratio = 1 + (sigmas[i + 1] / sigmas[i] - 1) * eta
                sigma_down = sigmas[i + 1] * downstep_ratio
                alpha_ip1 = 1 - sigmas[i + 1]
                alpha_down = 1 - sigma_down
                renoise_coeff = (sigmas[i + 1]**2 - sigma_down**2 * alpha_ip1**2 / alpha_down**2)**0.5
                ratio = sigma_down / sigmas[i]
                x = ratio * x + (1 - ratio) * denoised
                x = (alpha_ip1 / alpha_down) * x + noise_sampler(sigmas[i], sigmas[i + 1]) * 1.0 * renoise_coeff
        elif name == "dpmpp_2m":
            sigma_fn = lambda t: t.neg().exp()
            t_fn = lambda s: s.log().neg()
            t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
            h = t_next - t
            if old_denoised is None or sigmas[i + 1] == 0:
                x = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised
            else:
                h_last = t - t_fn(sigmas[i - 1])
                r = h_last / h
                denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
                x = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised_d
            old_denoised = denoised
    return x


def region_sample(name, x0, sigmas, seed, regions, shuffle=False, full_inputs=False):
    """Drive our sampler region by region in token layout, as PipeFusion will."""
    sampler = make_sampler(name, sigmas, seed, SHAPE, to_state=pack)
    bias = pack(toy_bias())
    x = pack(x0).clone()
    rng = random.Random(0)
    for i in range(len(sigmas) - 1):
        order = list(regions)
        if shuffle:
            rng.shuffle(order)
        x_next = torch.empty_like(x)
        for region in order:
            xr = x[:, region]
            dr = 0.7 * xr + sigmas[i] * bias[:, region] - 0.1
            if full_inputs:
                d_full = torch.zeros_like(x)
                d_full[:, region] = dr
                x_next[:, region] = sampler.step(i, x, d_full, region)
            else:
                x_next[:, region] = sampler.step(i, xr, dr, region)
        x = x_next
    return unpack(x)


def four_regions():
    cuts = [0, 10, 24, 40, L]  # uneven on purpose
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_region_sampler_matches_reference(name, scheduler):
    ms = model_sampling_for("dev")
    sigmas = calculate_sigmas(ms, scheduler, 8)
    seed = 1234
    x0 = noise_scaling(sigmas[0], prepare_noise(torch.zeros(SHAPE), seed), torch.zeros(SHAPE))
    ref = reference_sample(name, x0, sigmas, seed)
    got = region_sample(name, x0, sigmas, seed, four_regions())
    assert rel_err(got, ref) <= 1e-6
    assert torch.equal(got, ref)  # in practice bit-identical on CPU


@pytest.mark.parametrize("name", SAMPLERS)
def test_region_sampler_any_region_order_and_inputs(name):
    ms = model_sampling_for("schnell")
    sigmas = ksampler_sigmas(ms, "simple", 6, 0.5)
    g = torch.Generator().manual_seed(5)
    latent = process_latent_in(torch.randn(SHAPE, generator=g))
    x0 = noise_scaling(sigmas[0], prepare_noise(latent, 9), latent)
    ref = reference_sample(name, x0, sigmas, 9)
    assert torch.equal(region_sample(name, x0, sigmas, 9, four_regions(), shuffle=True), ref)
    assert torch.equal(region_sample(name, x0, sigmas, 9, four_regions(), full_inputs=True), ref)
    assert torch.equal(region_sample(name, x0, sigmas, 9, [slice(None)]), ref)


def test_region_sampler_owned_slice_and_misuse():
    sigmas = calculate_sigmas(model_sampling_for("dev"), "simple", 4)
    seed = 3
    x0 = prepare_noise(torch.zeros(SHAPE), seed)
    ref = pack(reference_sample("euler_ancestral", x0, sigmas, seed))
    bias = pack(toy_bias())
    # A process owning tokens 20:50 only still draws the full noise and gets its slice right.
    own = slice(20, 50)
    sampler = make_sampler("euler_ancestral", sigmas, seed, SHAPE, to_state=pack)
    x = pack(x0)[:, own]
    for i in range(4):
        x = sampler.step(i, x, 0.7 * x + sigmas[i] * bias[:, own] - 0.1, own)
    assert torch.equal(x, ref[:, own])
    # Tokens must go through the steps in order.
    sampler = make_sampler("dpmpp_2m", sigmas, seed, SHAPE, to_state=pack)
    xs = pack(x0)
    with pytest.raises(RuntimeError):
        sampler.step(1, xs, xs, slice(0, 8))
    sampler.step(0, xs, xs, slice(0, 8))
    with pytest.raises(RuntimeError):
        sampler.step(0, xs, xs, slice(4, 12))
    with pytest.raises(ValueError):
        sampler.step(1, xs[:, :5], xs[:, :5], slice(0, 8))


# --- against ComfyUI itself (only when COMFYUI_DIR is set and importable) ---------------

def _comfy():
    root = os.environ.get("COMFYUI_DIR")
    if not root:
        pytest.skip("COMFYUI_DIR is not set")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        import comfy.cli_args
        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        import comfy.k_diffusion.sampling
        import comfy.latent_formats
        import comfy.model_base
        import comfy.model_sampling
        import comfy.sample
        import comfy.samplers
        import comfy.supported_models
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable ComfyUI"
        pytest.skip(f"comfy is not importable from COMFYUI_DIR: {exc!r}")
    return comfy


def _comfy_model_sampling(comfy, variant):
    # How comfy.model_base builds it: Flux dev is ModelType.FLUX, schnell ModelType.FLOW.
    if variant == "dev":
        cfg = SimpleNamespace(sampling_settings=comfy.supported_models.Flux.sampling_settings)
        return comfy.model_base.model_sampling(cfg, comfy.model_base.ModelType.FLUX)
    cfg = SimpleNamespace(sampling_settings=comfy.supported_models.FluxSchnell.sampling_settings)
    return comfy.model_base.model_sampling(cfg, comfy.model_base.ModelType.FLOW)


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_comfy_tables_and_schedules(variant):
    comfy = _comfy()
    theirs = _comfy_model_sampling(comfy, variant)
    ours = model_sampling_for(variant)
    assert torch.equal(ours.sigmas, theirs.sigmas)
    model = SimpleNamespace(get_model_object=lambda name: theirs)
    for scheduler in SCHEDULERS:
        for steps in (1, 4, 20, 28):
            assert torch.equal(calculate_sigmas(ours, scheduler, steps),
                               comfy.samplers.calculate_sigmas(theirs, scheduler, steps))
            for denoise in (1.0, 0.5, 0.3):
                ks = comfy.samplers.KSampler(model, steps, "cpu", sampler="euler", scheduler=scheduler, denoise=denoise)
                assert torch.equal(ksampler_sigmas(ours, scheduler, steps, denoise), ks.sigmas)


def test_comfy_helpers():
    comfy = _comfy()
    ms = _comfy_model_sampling(comfy, "dev")
    g = torch.Generator().manual_seed(11)
    noise, latent, v = (torch.randn(SHAPE, generator=g) for _ in range(3))
    s = torch.tensor(0.6)
    assert torch.equal(noise_scaling(s, noise, latent), ms.noise_scaling(s, noise, latent))
    assert torch.equal(inverse_noise_scaling(s, latent), ms.inverse_noise_scaling(s, latent))
    assert torch.equal(denoised_from_velocity(latent, v, s), ms.calculate_denoised(s, v, latent))
    fmt = comfy.latent_formats.Flux()
    assert torch.equal(process_latent_in(latent), fmt.process_in(latent))
    assert torch.equal(process_latent_out(latent), fmt.process_out(latent))
    assert torch.equal(prepare_noise(latent, 77), comfy.sample.prepare_noise(latent, 77))
    assert torch.equal(cfg_combine(noise, latent, 3.0), comfy.samplers.cfg_function(None, noise, latent, 3.0, v, s))


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_comfy_samplers(name, scheduler):
    comfy = _comfy()
    theirs = _comfy_model_sampling(comfy, "dev")
    sigmas = comfy.samplers.calculate_sigmas(theirs, scheduler, 8)
    seed = 99

    class Model:  # the wrapper chain k-diffusion inspects: model.inner_model.inner_model.model_sampling
        inner_model = SimpleNamespace(inner_model=SimpleNamespace(model_sampling=theirs))

        def __call__(self, x, sigma, **kwargs):
            return toy_denoiser(x, sigma[0])

    fn = getattr(comfy.k_diffusion.sampling, f"sample_{name}")
    x0 = prepare_noise(torch.zeros(SHAPE), seed)
    ref = fn(Model(), x0.clone(), sigmas, extra_args={"seed": seed}, disable=True)
    got = region_sample(name, x0, sigmas, seed, four_regions())
    assert rel_err(got, ref) <= 1e-6
    assert torch.equal(got, ref)  # bit-identical on CPU
