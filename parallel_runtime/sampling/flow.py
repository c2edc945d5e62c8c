"""Flux noise/time parametrisation, mirroring ComfyUI's model_sampling for Flux.

ComfyUI builds Flux dev as ModelType.FLUX (ModelSamplingFlux + CONST) and Flux
schnell as ModelType.FLOW (ModelSamplingDiscreteFlow + CONST, shift=1,
multiplier=1). Both are rectified flow: x_sigma = sigma*noise + (1-sigma)*x0 and
the network predicts the velocity v, with denoised = x - sigma*v.

Every expression below keeps ComfyUI's operand order and float32 tensors, so the
round-off matches theirs and tables/schedules agree bit for bit on CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# comfy.latent_formats.Flux: process_in = (x - shift) * scale.
FLUX_LATENT_SCALE = 0.3611
FLUX_LATENT_SHIFT = 0.1159


@dataclass(frozen=True)
class LatentFormat:
    """comfy.latent_formats.*: the affine map between a VAE's latent and the model's latent space."""

    name: str
    scale: float
    shift: float
    dimensions = 2  # comfy's latent_dimensions: 3 for video VAEs, whose latents are [B, C, T, H, W]

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        return (latent - self.shift) * self.scale

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        return (latent / self.scale) + self.shift


@dataclass(frozen=True)
class ChannelLatentFormat:
    """comfy.latent_formats.Wan21 and kin: per-channel mean and std, (x - mean) * scale_factor / std, with
    ComfyUI's operand order. Latents of these formats are 5D in ComfyUI ([B, C, 1, H, W] for an image)."""

    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale_factor: float = 1.0
    dimensions = 3

    def _stats(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, len(self.mean)) + (1,) * (latent.ndim - 2)
        return (torch.tensor(self.mean).view(shape).to(latent.device, latent.dtype),
                torch.tensor(self.std).view(shape).to(latent.device, latent.dtype))

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latent)
        return (latent - mean) * self.scale_factor / std

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latent)
        return latent * std / self.scale_factor + mean


@dataclass(frozen=True)
class VideoLatentFormat(LatentFormat):
    """A scale/shift format of a video VAE: its latents are 5D in ComfyUI ([B, C, T, H, W])."""

    dimensions = 3


FLUX_LATENT = LatentFormat("flux", FLUX_LATENT_SCALE, FLUX_LATENT_SHIFT)
SD3_LATENT = LatentFormat("sd3", 1.5305, 0.0609)
# comfy.latent_formats.HunyuanVideo15: 32 channels, scale_factor 1.03682, no shift.
HUNYUAN_VIDEO15_LATENT = VideoLatentFormat("hunyuan_video15", 1.03682, 0.0)
# comfy.latent_formats.Flux2: the 128-channel latent (the FLUX.2 VAE's 32 channels in 2x2 patches) as the VAE
# gives it: scale 1, no shift.
FLUX2_LATENT = LatentFormat("flux2", 1.0, 0.0)
WAN21_LATENT = ChannelLatentFormat(
    "wan21",
    mean=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160))
# comfy.latent_formats.Wan22: the 48-channel latent of Wan 2.2's 16x-compressing VAE (TI2V 5B).
WAN22_LATENT = ChannelLatentFormat(
    "wan22",
    mean=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
          -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
          -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
          -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
          -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
          0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
    std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
         0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
         0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
         0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
         0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
         0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744))

VARIANTS = ("dev", "schnell")
KINDS = ("flux", "discrete_flow")


def flux_time_shift(mu: float, sigma: float, t):
    """comfy.model_sampling.flux_time_shift (sigma is the exponent, always 1.0 here)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def time_snr_shift(alpha: float, t):
    """comfy.model_sampling.time_snr_shift, used by ModelSamplingDiscreteFlow."""
    if alpha == 1.0:
        return t
    return alpha * t / (1 + (alpha - 1) * t)


class FluxModelSampling:
    """The sigma table and sigma<->timestep maps ComfyUI uses for a Flux model.

    kind="flux" is ModelSamplingFlux (Flux dev): 10000-entry table of
    flux_time_shift(shift, t), timestep(sigma) = sigma (the Flux network applies
    its own x1000 time factor). kind="discrete_flow" is ModelSamplingDiscreteFlow
    (Flux schnell): 1000-entry table of time_snr_shift(shift, t), and
    timestep(sigma) = sigma * multiplier.
    """

    def __init__(self, shift: float, multiplier: float = 1.0, kind: str = "flux"):
        if kind not in KINDS:
            raise ConfigError(f"Model sampling kind {kind!r} is unknown; choose one of {', '.join(KINDS)}.")
        self.shift = shift
        self.multiplier = multiplier
        self.kind = kind
        if kind == "flux":
            timesteps = 10000
            self.sigmas = self.sigma(torch.arange(1, timesteps + 1, 1) / timesteps)
        else:
            timesteps = 1000
            self.sigmas = self.sigma((torch.arange(1, timesteps + 1, 1) / timesteps) * multiplier)

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def sigma(self, timestep):
        if self.kind == "flux":
            return flux_time_shift(self.shift, 1.0, timestep)
        return time_snr_shift(self.shift, timestep / self.multiplier)

    def timestep(self, sigma):
        # ModelSamplingFlux returns sigma unchanged; multiplier is 1.0 there.
        if self.kind == "flux" and self.multiplier == 1.0:
            return sigma
        return sigma * self.multiplier

    # -- CONST (rectified flow): the network predicts the velocity ------------------------------------

    prediction = "const"

    def calculate_input(self, sigma, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_denoised(self, sigma, model_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return denoised_from_velocity(x, model_output, sigma)

    def noise_scaling(self, sigma, noise: torch.Tensor, latent: torch.Tensor, max_denoise: bool = False):
        return noise_scaling(sigma, noise, latent)

    def inverse_noise_scaling(self, sigma, latent: torch.Tensor) -> torch.Tensor:
        return inverse_noise_scaling(sigma, latent)

    def is_max_denoise(self, sigma0) -> bool:
        return False  # CONST's noise_scaling ignores it

    def __repr__(self) -> str:
        return f"FluxModelSampling(shift={self.shift}, multiplier={self.multiplier}, kind={self.kind!r})"


def flux_shift_for_resolution(width: int, height: int, max_shift: float = 1.15, base_shift: float = 0.5) -> float:
    """The shift ComfyUI's ModelSamplingFlux node sets for an image size (linear in token count)."""
    x1, x2 = 256, 4096
    mm = (max_shift - base_shift) / (x2 - x1)
    b = base_shift - mm * x1
    return (width * height / (8 * 8 * 2 * 2)) * mm + b


def model_sampling_for(variant: str, shift: float | None = None) -> FluxModelSampling:
    """ComfyUI's default model_sampling for a Flux checkpoint (no ModelSamplingFlux node).

    dev: ModelSamplingFlux with shift 1.15 (sampling_settings is empty, so the
    class default applies). schnell: ModelSamplingDiscreteFlow with shift 1.0,
    multiplier 1.0. `shift` overrides the default, as the ModelSamplingFlux node
    does for dev.
    """
    if variant == "dev":
        return FluxModelSampling(1.15 if shift is None else shift, 1.0, kind="flux")
    if variant == "schnell":
        return FluxModelSampling(1.0 if shift is None else shift, 1.0, kind="discrete_flow")
    raise ConfigError(f"Flux variant {variant!r} is unknown; choose one of {', '.join(VARIANTS)}.")


def _as_sigma(sigma, ndim: int) -> torch.Tensor:
    """comfy.model_sampling.reshape_sigma, accepting python floats as float32 like ComfyUI's sigma tensors."""
    if not isinstance(sigma, torch.Tensor):
        sigma = torch.tensor(sigma, dtype=torch.float32)
    if sigma.nelement() == 1:
        return sigma.view(())
    return sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


def noise_scaling(sigma, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """CONST.noise_scaling: the sampler's starting x for sigma = sigmas[0]."""
    sigma = _as_sigma(sigma, noise.ndim)
    return sigma * noise + (1.0 - sigma) * latent


def inverse_noise_scaling(sigma, latent: torch.Tensor) -> torch.Tensor:
    """CONST.inverse_noise_scaling, applied with sigmas[-1] (a no-op when it is 0)."""
    sigma = _as_sigma(sigma, latent.ndim)
    return latent / (1.0 - sigma)


def denoised_from_velocity(x: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
    """CONST.calculate_denoised: x - v*sigma; ComfyUI casts v to float32 first."""
    sigma = _as_sigma(sigma, v.ndim)
    return x - v.float() * sigma


def process_latent_in(latent: torch.Tensor) -> torch.Tensor:
    return (latent - FLUX_LATENT_SHIFT) * FLUX_LATENT_SCALE


def process_latent_out(latent: torch.Tensor) -> torch.Tensor:
    return (latent / FLUX_LATENT_SCALE) + FLUX_LATENT_SHIFT


def start_latent(latent_image: torch.Tensor, noise: torch.Tensor, sigma0,
                 latent_format: LatentFormat = FLUX_LATENT, model_sampling=None) -> torch.Tensor:
    """x at the first step, as CFGGuider.inner_sample + KSAMPLER.sample build it (CONST unless a
    `model_sampling` says otherwise).

    ComfyUI leaves an all-zero (empty) latent unshifted; any other latent goes
    through process_latent_in before the noise is mixed in.
    """
    if torch.count_nonzero(latent_image) > 0:
        latent_image = latent_format.process_in(latent_image)
    if model_sampling is None:
        return noise_scaling(sigma0, noise, latent_image)
    return model_sampling.noise_scaling(sigma0, noise, latent_image, model_sampling.is_max_denoise(sigma0))


def final_latent(samples: torch.Tensor, sigma_last, latent_format: LatentFormat = FLUX_LATENT,
                 model_sampling=None) -> torch.Tensor:
    """The LATENT ComfyUI returns: inverse_noise_scaling, then float32 process_latent_out."""
    inverse = inverse_noise_scaling if model_sampling is None else model_sampling.inverse_noise_scaling
    return latent_format.process_out(inverse(sigma_last, samples).to(torch.float32))


def cfg_uses_uncond(scale: float) -> bool:
    """ComfyUI skips the negative branch when cfg is 1 (its cfg1 optimisation)."""
    return not math.isclose(scale, 1.0)


def cfg_combine(cond_denoised: torch.Tensor, uncond_denoised: torch.Tensor | None, scale: float) -> torch.Tensor:
    """comfy.samplers.cfg_function without model patches, on denoised predictions.

    With the cfg1 optimisation ComfyUI's uncond is all zeros, so uncond=None
    gives cond * scale (== cond for scale 1).
    """
    if uncond_denoised is None:
        return cond_denoised * scale
    return uncond_denoised + (cond_denoised - uncond_denoised) * scale
