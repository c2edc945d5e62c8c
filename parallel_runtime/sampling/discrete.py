"""ComfyUI's ModelSamplingDiscrete with EPS prediction (PixArt-α/Σ; SD1.x-style noise schedules).

The network predicts the noise: its input is x / sqrt(sigma^2 + 1), denoised = x - eps * sigma, and the first
x of a full denoise is noise * sqrt(1 + sigma_max^2). Sigmas come from a 1000-step beta schedule, stored in
float32; timestep(sigma) is the index of the nearest log-sigma, sigma(t) interpolates log-sigmas. Operand
order follows comfy/model_sampling.py so tables and steps agree with ComfyUI bit for bit on CPU.
"""
from __future__ import annotations

import math

import torch

from .flow import _as_sigma

BETA_SCHEDULES = ("linear", "sqrt_linear")


def make_betas(schedule: str, timesteps: int = 1000, linear_start: float = 1e-4, linear_end: float = 2e-2):
    """comfy.ldm.modules.diffusionmodules.util.make_beta_schedule for its two linear kinds, in float64."""
    if schedule == "linear":
        return torch.linspace(linear_start ** 0.5, linear_end ** 0.5, timesteps, dtype=torch.float64) ** 2
    if schedule == "sqrt_linear":
        return torch.linspace(linear_start, linear_end, timesteps, dtype=torch.float64)
    raise ValueError(f"beta schedule {schedule!r} is not one of {BETA_SCHEDULES}")


class DiscreteEPSSampling:
    """model_sampling of an EPS model on a discrete schedule (ModelSamplingDiscrete + EPS)."""

    prediction = "eps"
    sigma_data = 1.0

    def __init__(self, beta_schedule: str = "linear", linear_start: float = 1e-4, linear_end: float = 2e-2,
                 timesteps: int = 1000):
        self.beta_schedule = beta_schedule
        betas = make_betas(beta_schedule, timesteps, linear_start, linear_end)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
        self.sigmas = sigmas.float()
        self.log_sigmas = sigmas.log().float()

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        log_sigma = sigma.log()
        dists = log_sigma.to(self.log_sigmas.device) - self.log_sigmas[:, None]
        return dists.abs().argmin(dim=0).view(sigma.shape).to(sigma.device)

    def sigma(self, timestep) -> torch.Tensor:
        t = torch.clamp(torch.as_tensor(timestep).float().to(self.log_sigmas.device), min=0,
                        max=len(self.sigmas) - 1)
        low_idx, high_idx, w = t.floor().long(), t.ceil().long(), t.frac()
        log_sigma = (1 - w) * self.log_sigmas[low_idx] + w * self.log_sigmas[high_idx]
        return log_sigma.exp()

    # -- EPS ---------------------------------------------------------------------------------------------

    def calculate_input(self, sigma, x: torch.Tensor) -> torch.Tensor:
        sigma = _as_sigma(sigma, x.ndim)
        return x / (sigma ** 2 + self.sigma_data ** 2) ** 0.5

    def calculate_denoised(self, sigma, model_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        sigma = _as_sigma(sigma, model_output.ndim)
        return x - model_output.float() * sigma

    def noise_scaling(self, sigma, noise: torch.Tensor, latent: torch.Tensor, max_denoise: bool = False):
        sigma = _as_sigma(sigma, noise.ndim)
        noise = noise * torch.sqrt(1.0 + sigma ** 2.0) if max_denoise else noise * sigma
        return noise + latent

    def inverse_noise_scaling(self, sigma, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def is_max_denoise(self, sigma0) -> bool:
        """KSAMPLER.max_denoise: the schedule starts at (or above) the table's largest sigma."""
        top, first = float(self.sigma_max), float(sigma0)
        return math.isclose(top, first, rel_tol=1e-05) or first > top

    def __repr__(self) -> str:
        return f"DiscreteEPSSampling({self.beta_schedule!r})"
