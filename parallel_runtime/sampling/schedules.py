"""Sigma schedules, re-implemented from comfy.samplers so they match KSampler exactly.

They accept any object with ComfyUI's model_sampling interface (.sigmas,
.sigma(t), .timestep(sigma), .sigma_min, .sigma_max), ours or ComfyUI's own.
Values go through python floats and back to float32 as ComfyUI does.
"""
from __future__ import annotations

import math

import numpy
import torch

from ..errors import ConfigError

SCHEDULERS = ("simple", "normal", "beta", "sgm_uniform")


def simple_scheduler(model_sampling, steps: int) -> torch.Tensor:
    # Evenly strided picks from the top of the sigma table, then a final 0.
    s = model_sampling
    sigs = []
    ss = len(s.sigmas) / steps
    for x in range(steps):
        sigs += [float(s.sigmas[-(1 + int(x * ss))])]
    sigs += [0.0]
    return torch.tensor(sigs, dtype=torch.float32)


def normal_scheduler(model_sampling, steps: int, sgm: bool = False) -> torch.Tensor:
    # Linear in timestep between sigma_max and sigma_min. For Flux dev timestep()
    # is the identity, so sigma() shifts the already-shifted table values again;
    # that is ComfyUI's behaviour and we keep it.
    s = model_sampling
    start = s.timestep(s.sigma_max)
    end = s.timestep(s.sigma_min)

    append_zero = True
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(s.sigma(end)), 0, abs_tol=0.00001):
            steps += 1
            append_zero = False
        timesteps = torch.linspace(start, end, steps)

    sigs = [float(s.sigma(ts)) for ts in timesteps]
    if append_zero:
        sigs += [0.0]
    return torch.tensor(sigs, dtype=torch.float32)


def beta_scheduler(model_sampling, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    # Table indices at beta-distribution quantiles (arXiv 2407.12173). Repeated
    # indices are dropped, so a schedule may come out shorter than `steps`.
    import scipy.stats  # here, not at the top: it costs every worker 1.5 s of start-up, and only beta needs it

    total_timesteps = len(model_sampling.sigmas) - 1
    ts = 1 - numpy.linspace(0, 1, steps, endpoint=False)
    ts = numpy.rint(scipy.stats.beta.ppf(ts, alpha, beta) * total_timesteps)

    sigs = []
    last_t = -1
    for t in ts:
        if t != last_t:
            sigs += [float(model_sampling.sigmas[int(t)])]
        last_t = t
    sigs += [0.0]
    return torch.tensor(sigs, dtype=torch.float32)


def _check(scheduler: str, steps: int) -> None:
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"Scheduler {scheduler!r} is not supported; choose one of {', '.join(SCHEDULERS)}.")
    if int(steps) != steps or steps < 1:
        raise ConfigError(f"Steps must be a positive whole number, got {steps!r}.")


def calculate_sigmas(model_sampling, scheduler: str, steps: int) -> torch.Tensor:
    """comfy.samplers.calculate_sigmas: steps + 1 float32 sigmas ending in 0 (beta may give fewer)."""
    _check(scheduler, steps)
    if scheduler == "simple":
        return simple_scheduler(model_sampling, steps)
    if scheduler == "normal":
        return normal_scheduler(model_sampling, steps)
    if scheduler == "sgm_uniform":
        return normal_scheduler(model_sampling, steps, sgm=True)
    return beta_scheduler(model_sampling, steps)


def ksampler_sigmas(model_sampling, scheduler: str, steps: int, denoise: float = 1.0) -> torch.Tensor:
    """KSampler.set_steps: for denoise < 1 build a longer schedule and keep its last steps + 1 sigmas.

    denoise <= 0 gives an empty schedule (ComfyUI then returns the latent untouched).
    None of our samplers are in KSampler's discard-penultimate-sigma set.
    """
    _check(scheduler, steps)
    if denoise is None or denoise > 0.9999:
        return calculate_sigmas(model_sampling, scheduler, steps)
    if denoise <= 0.0:
        return torch.tensor([], dtype=torch.float32)
    new_steps = int(steps / denoise)
    sigmas = calculate_sigmas(model_sampling, scheduler, new_steps)
    return sigmas[-(steps + 1):]
