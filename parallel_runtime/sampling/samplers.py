"""KSampler's euler / euler_ancestral / dpmpp_2m steps for Flux (CONST), one region at a time.

ComfyUI's k-diffusion loops update the whole latent per step. PipeFusion updates
it patch by patch, so each sampler here exposes a single step,
`step(i, x, denoised, region)`, that computes x_{i+1} for a slice of tokens.
The math is elementwise, so doing it per region gives the same numbers as
ComfyUI doing it at once, provided the scalar coefficients are formed the same
way: they are computed from the float32 sigma tensor on x's device, in
ComfyUI's operand order. Branches (is the next sigma 0?) read the host copy
instead: comparing a CUDA tensor in an `if` waits for the GPU every step.

Tensors live in a "state layout" [B, L, C'] (Flux tokens); `region` slices L.
`to_state` maps latent-shaped [B, C, H, W] tensors (the ancestral noise) into
that layout.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import ConfigError
from .noise import StepNoise

SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class RegionSampler:
    """Shared bookkeeping: regions, per-token progress and sigmas on x's device.

    x and denoised passed to step() may be either the full state [B, L, C'] or
    just the region's rows [B, len(region), C']; the result is always the
    region's rows of x_{i+1}. Every token must go through steps 0, 1, 2, ... in
    order, once each; regions of one step may come in any order.
    """

    name = ""

    def __init__(self, sigmas: torch.Tensor, seed: int, latent_shape: Sequence[int],
                 to_state: Callable[[torch.Tensor], torch.Tensor] = _identity,
                 noise_device: torch.device | str | None = None, batch_rows: slice | None = None):
        self.sigmas = torch.as_tensor(sigmas, dtype=torch.float32).detach().cpu()
        # Batch parallel: x holds these rows of a latent_shape batch. Noise ComfyUI draws for the whole batch (an
        # ancestral step's) is drawn whole and cut, so each image gets what it gets in the whole batch.
        self.batch_rows = batch_rows
        self.num_steps = len(self.sigmas) - 1
        self.seed = seed
        self.latent_shape = tuple(int(n) for n in latent_shape)
        self.to_state = to_state
        self.noise_device = noise_device
        self._state_len: int | None = None
        self._done: torch.Tensor | None = None  # [L] last completed step per token, -1 before any
        self._sigmas_by_device: dict[torch.device, torch.Tensor] = {}

    # -- bookkeeping -------------------------------------------------------
    def state_len(self) -> int:
        """L, the length of the token dimension of to_state(latent)."""
        if self._state_len is None:
            try:
                probe = self.to_state(torch.empty(self.latent_shape, device="meta"))
            except Exception:  # a to_state that cannot run on meta tensors
                probe = self.to_state(torch.zeros(self.latent_shape))
            self._state_len = int(probe.shape[1])
        return self._state_len

    def _span(self, region: slice) -> tuple[int, int]:
        a, b, stride = region.indices(self.state_len())
        if stride != 1 or b <= a:
            raise ValueError(f"Region {region} must be a non-empty contiguous slice of 0..{self.state_len()}.")
        return a, b

    def _rows(self, t: torch.Tensor, a: int, b: int, what: str) -> torch.Tensor:
        if t.shape[1] == b - a:
            return t
        if t.shape[1] == self.state_len():
            return t[:, a:b]
        raise ValueError(f"{what} has {t.shape[1]} tokens; expected the region's {b - a} or the full {self.state_len()}.")

    def _sigmas_on(self, device: torch.device) -> torch.Tensor:
        # ComfyUI moves sigmas to the model's device; scalar math there matches its round-off.
        if device not in self._sigmas_by_device:
            self._sigmas_by_device[device] = self.sigmas.to(device)
        return self._sigmas_by_device[device]

    def steps_done(self) -> torch.Tensor:
        """Last completed step per token (-1 = none), for callers that want to check progress."""
        if self._done is None:
            self._done = torch.full((self.state_len(),), -1, dtype=torch.long)
        return self._done

    # -- the step ------------------------------------------------------------
    def step(self, i: int, x: torch.Tensor, denoised: torch.Tensor, region: slice = slice(None)) -> torch.Tensor:
        if not 0 <= i < self.num_steps:
            raise IndexError(f"Step {i} is outside 0..{self.num_steps - 1}.")
        a, b = self._span(region)
        done = self.steps_done()
        if not bool((done[a:b] == i - 1).all()):
            raise RuntimeError(f"Tokens {a}:{b} are not all ready for step {i}; each token must take the steps in order, once.")
        x = self._rows(x, a, b, "x")
        denoised = self._rows(denoised, a, b, "denoised")
        out = self._update(i, x, denoised, a, b, self._sigmas_on(x.device))
        done[a:b] = i
        self._release()
        return out

    def _update(self, i, x, denoised, a, b, sigmas):  # pragma: no cover - abstract
        raise NotImplementedError

    def _release(self) -> None:
        """Hook to free per-step caches once no token can still need them."""


class EulerSampler(RegionSampler):
    """sample_euler with s_churn=0 (KSampler's defaults)."""

    name = "euler"

    def _update(self, i, x, denoised, a, b, sigmas):
        sigma_hat = sigmas[i]
        d = (x - denoised) / sigma_hat  # to_d
        dt = sigmas[i + 1] - sigma_hat
        return x + d * dt


class EulerAncestralRFSampler(RegionSampler):
    """sample_euler_ancestral_RF, which ComfyUI uses for CONST models, eta=1, s_noise=1.

    It renoises on every step whose next sigma is non-zero, drawing one full
    latent of noise from the default noise sampler each time (see StepNoise).
    """

    name = "euler_ancestral"
    eta = 1.0
    s_noise = 1.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._noise: StepNoise | None = None
        self._noise_state: dict[int, torch.Tensor] = {}  # step -> to_state(noise) on x's device

    def _step_noise(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if i not in self._noise_state:
            if self._noise is None:
                # default_noise_sampler seeds its generator on x's device.
                device = like.device if self.noise_device is None else self.noise_device
                self._noise = StepNoise(self.seed, self.latent_shape, sigmas=self.sigmas, device=device, dtype=like.dtype)
            noise = self._noise.at(i)
            noise = noise if self.batch_rows is None else noise[self.batch_rows]
            self._noise_state[i] = self.to_state(noise).to(device=like.device, dtype=like.dtype)
        return self._noise_state[i]

    def _update(self, i, x, denoised, a, b, sigmas):
        s, s_next = sigmas[i], sigmas[i + 1]
        if self.sigmas[i + 1] == 0:  # host copy: no device sync
            return denoised
        eta = self.eta
        downstep_ratio = 1 + (s_next / s - 1) * eta
        sigma_down = s_next * downstep_ratio
        alpha_ip1 = 1 - s_next
        alpha_down = 1 - sigma_down
        renoise_coeff = (s_next**2 - sigma_down**2 * alpha_ip1**2 / alpha_down**2)**0.5
        sigma_down_i_ratio = sigma_down / s
        x = sigma_down_i_ratio * x + (1 - sigma_down_i_ratio) * denoised
        if eta > 0:
            noise = self._step_noise(i, x)[:, a:b]
            x = (alpha_ip1 / alpha_down) * x + noise * self.s_noise * renoise_coeff
        return x

    def _release(self) -> None:
        # Every token that has started is past step `lo`; when some token is
        # already further, no late-starting token is expected either.
        done = self._done
        started = done >= 0
        if not bool(started.any()):
            return
        lo, hi = int(done[started].min()), int(done.max())
        keep_from = lo + 1 if hi > lo else lo
        for step in [s for s in self._noise_state if s < keep_from]:
            del self._noise_state[step]
        if self._noise is not None:
            self._noise.drop_before(keep_from)


class EulerAncestralSampler(EulerAncestralRFSampler):
    """sample_euler_ancestral for non-CONST models (EPS: PixArt), eta=1, s_noise=1: an Euler step down to
    sigma_down, then fresh noise of std sigma_up (get_ancestral_step), from the same noise sampler."""

    def _update(self, i, x, denoised, a, b, sigmas):
        s, s_next = sigmas[i], sigmas[i + 1]
        if self.sigmas[i + 1] == 0:  # host copy: sigma_up = sigma_down = 0, so x = denoised
            return denoised
        sigma_up = torch.minimum(s_next, self.eta * (s_next ** 2 * (s ** 2 - s_next ** 2) / s ** 2) ** 0.5)
        sigma_down = (s_next ** 2 - sigma_up ** 2) ** 0.5
        d = (x - denoised) / s
        x = x + d * (sigma_down - s)
        return x + self._step_noise(i, x)[:, a:b] * self.s_noise * sigma_up


class DPMPP2MSampler(RegionSampler):
    """sample_dpmpp_2m. old_denoised is kept full-size; each region reads and writes its rows."""

    name = "dpmpp_2m"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._old_denoised: torch.Tensor | None = None

    def _update(self, i, x, denoised, a, b, sigmas):
        def sigma_fn(t):
            return t.neg().exp()

        def t_fn(sigma):
            return sigma.log().neg()

        t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
        h = t_next - t
        # ComfyUI's old_denoised is None exactly on the first step of the loop. Host copy: no device sync.
        if i == 0 or self.sigmas[i + 1] == 0:
            out = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised
        else:
            old = self._old_denoised[:, a:b]
            h_last = t - t_fn(sigmas[i - 1])
            r = h_last / h
            denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old
            out = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised_d
        if i + 1 < self.num_steps:  # the last step's denoised is never read again
            if self._old_denoised is None:
                shape = (denoised.shape[0], self.state_len()) + tuple(denoised.shape[2:])
                self._old_denoised = torch.empty(shape, dtype=denoised.dtype, device=denoised.device)
            self._old_denoised[:, a:b] = denoised
        return out


_CLASSES = {cls.name: cls for cls in (EulerSampler, EulerAncestralRFSampler, DPMPP2MSampler)}


def make_sampler(name: str, sigmas: torch.Tensor, seed: int, latent_shape: Sequence[int],
                 to_state: Callable[[torch.Tensor], torch.Tensor] = _identity,
                 noise_device: torch.device | str | None = None, prediction: str = "const",
                 batch_rows: slice | None = None) -> RegionSampler:
    """A region-wise sampler for a model of this `prediction` ("const": rectified flow as Flux; "eps").

    seed is KSampler's seed (ancestral noise uses it, as ComfyUI's does);
    latent_shape is [B, C, H, W]; noise_device defaults to x's device, where
    ComfyUI's noise sampler draws.
    """
    if name not in _CLASSES:
        raise ConfigError(f"Sampler {name!r} is not supported; choose one of {', '.join(SAMPLERS)}.")
    cls = _CLASSES[name]
    if cls is EulerAncestralRFSampler and prediction != "const":  # as k_diffusion picks by model_sampling
        cls = EulerAncestralSampler
    return cls(sigmas, seed, latent_shape, to_state=to_state, noise_device=noise_device, batch_rows=batch_rows)
