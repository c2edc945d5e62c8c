"""KSampler's math on an audio-video latent (LTX-2, MiniMax-H3), as ComfyUI 2026 samples its NestedTensor.

ComfyUI keeps such a latent as a NestedTensor [video, audio]. comfy.sample.prepare_noise draws the noise of each
stream in turn from one seeded CPU generator (video first), and CFGGuider.sample flattens both streams per row and
concatenates them (comfy.utils.pack_latents: [B, 1, video numel + audio numel]); every sampler then runs on that one
flat latent with the model's sigmas, so one sigma schedule steps both streams. The state here is that pack as
[B, N, 1] (the token axis second, as the region samplers want it): the same numbers in the same order, so an
ancestral sampler's noise, drawn as randn([B, 1, N]) like ComfyUI's default_noise_sampler, lands on the same
elements.

MiniMax-H3's audio runs on its own shifted schedule. ComfyUI's ModelSamplingAV (model_base.MiniMaxH3) carries the
audio latent scaled onto the video schedule: process_latent_in multiplies it by audio_scale = shift / audio_shift
(12 / 3), the model undoes the carry on its input (x_audio = carried x sigma_a / sigma_v) and returns the carried
variable's velocity, and process_latent_out divides the result by audio_scale again (`AudioCarry`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def pack_streams(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """comfy.utils.pack_latents of [video, audio], as [B, N, 1]."""
    b = video.shape[0]
    return torch.cat([video.reshape(b, -1), audio.reshape(b, -1)], dim=1).unsqueeze(-1)


def unpack_streams(x: torch.Tensor, video_shape: Sequence[int], audio_shape: Sequence[int]) -> tuple:
    """pack_streams' inverse: (video, audio) with the streams' shapes past the batch axis."""
    flat, n = x.squeeze(-1), math.prod(video_shape[1:])
    b = flat.shape[0]
    return flat[:, :n].reshape(b, *video_shape[1:]), flat[:, n:].reshape(b, *audio_shape[1:])


def prepare_nested_noise(latents: Sequence[torch.Tensor], seed: int,
                         batch_index: Sequence[int] | None = None) -> list[torch.Tensor]:
    """comfy.sample.prepare_noise over a NestedTensor: one generator seeded once, each stream's noise drawn in turn
    (with a LATENT's batch_index, each stream's draws as prepare_noise_inner makes them)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    noises = []
    for latent in latents:
        if batch_index is None:
            noises.append(torch.randn(latent.size(), dtype=torch.float32, generator=generator).to(latent.dtype))
            continue
        wanted, draws = sorted(set(batch_index)), {}
        for i in range(wanted[-1] + 1):
            noise = torch.randn([1, *latent.shape[1:]], dtype=torch.float32, generator=generator).to(latent.dtype)
            if i in wanted:
                draws[i] = noise
        noises.append(torch.cat([draws[i] for i in batch_index]))
    return noises


def time_shift_sigma(sigma, from_shift: float, to_shift: float):
    """A sigma on the `from_shift` schedule moved to the `to_shift` one (comfy/ldm/minimax/model.py)."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


class AudioCarry:
    """ModelSamplingAV's audio carry for a model whose audio runs at `audio_shift` beside the video's `shift`."""

    def __init__(self, shift: float, audio_shift: float):
        self.shift, self.audio_shift = shift, audio_shift
        self.scale = shift / audio_shift  # ModelSamplingAV.audio_scale

    def latent_in(self, audio: torch.Tensor) -> torch.Tensor:
        return audio * self.scale if self.scale != 1.0 else audio

    def latent_out(self, audio: torch.Tensor) -> torch.Tensor:
        return audio * (1.0 / self.scale) if self.scale != 1.0 else audio

    def _sigmas(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma_v, sigma_a) as MiniMaxH3Model.forward reads them from the call's first timestep (sigma x 1000)."""
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        return sigma_v, time_shift_sigma(sigma_v, self.shift, self.audio_shift)

    def model_input(self, timestep: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        """The stream's own latent the network reads: the carried one times sigma_a / sigma_v."""
        if self.scale == 1.0:
            return carried
        sigma_v, sigma_a = self._sigmas(timestep)
        return carried * (sigma_a / sigma_v).to(carried.dtype)

    def velocity(self, timestep: torch.Tensor, audio_in: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The carried variable's velocity from the network's audio output `out` on input `audio_in`."""
        if self.scale == 1.0:
            return out
        _, sigma_a = self._sigmas(timestep)
        return (1.0 - self.scale) * audio_in + (1.0 + (self.scale - 1.0) * sigma_a).to(out.dtype) * out
