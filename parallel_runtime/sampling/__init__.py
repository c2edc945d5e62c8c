"""KSampler-compatible sampling math for Flux, usable on patches of tokens."""
from .flow import (
    FLUX_LATENT_SCALE,
    FLUX_LATENT,
    FLUX_LATENT_SHIFT,
    FLUX2_LATENT,
    HUNYUAN_VIDEO15_LATENT,
    SD3_LATENT,
    WAN21_LATENT,
    WAN22_LATENT,
    ChannelLatentFormat,
    LatentFormat,
    FluxModelSampling,
    cfg_combine,
    cfg_uses_uncond,
    denoised_from_velocity,
    final_latent,
    flux_shift_for_resolution,
    inverse_noise_scaling,
    model_sampling_for,
    noise_scaling,
    process_latent_in,
    process_latent_out,
    start_latent,
)
from .discrete import DiscreteEPSSampling
from .noise import StepNoise, prepare_noise
from .samplers import SAMPLERS, RegionSampler, make_sampler
from .schedules import SCHEDULERS, calculate_sigmas, ksampler_sigmas

__all__ = [
    "FLUX_LATENT", "FLUX2_LATENT", "FLUX_LATENT_SCALE", "FLUX_LATENT_SHIFT", "HUNYUAN_VIDEO15_LATENT", "SD3_LATENT", "WAN21_LATENT", "WAN22_LATENT", "ChannelLatentFormat", "LatentFormat", "FluxModelSampling", "cfg_combine", "cfg_uses_uncond",
    "denoised_from_velocity", "final_latent", "flux_shift_for_resolution", "inverse_noise_scaling",
    "model_sampling_for", "noise_scaling", "process_latent_in", "process_latent_out", "start_latent",
    "DiscreteEPSSampling", "StepNoise", "prepare_noise", "SAMPLERS", "RegionSampler", "make_sampler",
    "SCHEDULERS", "calculate_sigmas", "ksampler_sigmas",
]
