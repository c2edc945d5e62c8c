"""Parallel Sampler's step loop for an audio-video family (LTX-2, MiniMax-H3): the video and the audio latent
denoised together, as KSampler denoises ComfyUI 2026's NestedTensor latent of these models.

Each step is one model call of the family over the step's [cond; uncond] chunks, run exactly as a stock sampler's
call (model_call.py for MiniMax-H3's packed [audio | video] rows in one stream, two_stream_call.py for LTX-2's two
streams): the CFG group splits the chunks, Ulysses and Ring split the audio and the video rows (MiniMax-H3: as one
sequence; LTX-2: each stream over the same ranks), tensor parallelism and sharded weights split the layers. The call's
outputs come back whole on every rank; every rank then takes the same sampler step on the whole flat latent
(sampling/audio_video.py: ComfyUI's packed latent, one sigma schedule for both streams, MiniMax-H3's audio carried on
the video's schedule). The state is the latent (a few MB at the released shapes) where a step's compute is seconds, so
keeping it whole on every rank costs next to nothing and needs no exchange of it.

PipeFusion and displaced patch parallelism run where the family's model call runs them (MiniMax-H3's one packed
stream: patches are runs of its [audio | video] rows; LTX-2's two streams: PipeFusion's patches are runs of the video
rows, the audio rows with the first, two_stream_pipefusion.py): per call, as under a stock sampler, so each step's
pipeline drains (there is no cross-step pipeline here) and every attention layer reads the other patches' K/V as
the previous step left them, after `warmup_steps` exact steps. validate.av_sampling_problem refuses what a family's
call does not run (LTX-2: displaced patch, PipeFusion inside sequence or tensor parallelism) and the step cache.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..sampling import cfg_combine, cfg_uses_uncond, ksampler_sigmas, make_sampler
from ..sampling.audio_video import AudioCarry, pack_streams, prepare_nested_noise, unpack_streams
from ..spec import Job
from .denoise import Denoiser
from .model_call import ModelCallForward
from .two_stream_call import two_stream_outputs


class AudioVideoDenoiser(Denoiser):
    """The runner of a Parallel Sampler job that carries an audio latent (the worker picks it where Job.audio is
    set): the Denoiser's job handling (progress, cancel votes, the forward's amax reduce), its step loop
    `run_av_job`."""

    def _run(self, job: Job) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            return run_av_job(self, job)
        finally:
            self._finish_vote()


def run_av_job(denoiser, job: Job) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(video, audio) LATENT on the result rank, None elsewhere. `denoiser`: the job's Denoiser (its adapter,
    topology, comm, attention context, progress and cancel hooks)."""
    adapter, sp = denoiser.adapter, job.sampling
    ms, carry = adapter.model_sampling, _carry_of(adapter)
    sigmas = ksampler_sigmas(ms, sp.scheduler, sp.steps, sp.denoise)
    video_shape, audio_shape = tuple(job.latent.shape), tuple(job.audio.shape)
    denoiser.step_times, denoiser.sigmas = [], sigmas
    if len(sigmas) <= 1:  # denoise 0: KSampler returns the input untouched
        return (job.latent.clone(), job.audio.clone()) if denoiser._is_result_rank() else None

    x = pack_streams(*_start(job, sigmas[0], adapter, carry)).to(adapter.device)
    sampler = make_sampler(sp.sampler_name, sigmas, sp.seed, (job.batch, 1, x.shape[1]),
                           to_state=lambda noise: noise.transpose(1, 2), prediction=ms.prediction)
    # The step's model call, run by a ModelCallForward on this rank's comm and attention context (a call never
    # cancels: this loop's own vote does, every rank at the same step).
    call = ModelCallForward(adapter, denoiser.topology, denoiser.comm, denoiser.context, denoiser.controlnets)
    call.cancel_requested, call.progress = (lambda: False), (lambda i, n: None)
    negative = job.negative if cfg_uses_uncond(sp.cfg) else None
    chunks = 1 + (negative is not None)
    # LTX-2's RoPE reads the frame rate LTXVConditioning sets; ComfyUI's LTXAV.extra_conds defaults it to 25.
    extra = {**job.extra, "frame_rate": float(job.extra.get("frame_rate", 25.0))}
    for i in range(len(sigmas) - 1):
        t0 = time.perf_counter()
        denoiser._check_cancel()
        video, audio = unpack_streams(x, video_shape, audio_shape)
        timestep = ms.timestep(sigmas[i].expand(chunks * job.batch)).float()  # model_base._apply_model's t
        audio_in = carry.model_input(timestep, audio) if carry is not None else audio
        step = dataclasses.replace(job, latent=video.repeat(chunks, *[1] * (video.ndim - 1)),
                                   audio=audio_in.repeat(chunks, *[1] * (audio.ndim - 1)), negative=negative,
                                   timestep=timestep, audio_timestep=None, call_step=i, call_slot=0, extra=extra)
        out_video, out_audio = _call(call, step, adapter)
        if carry is not None:
            out_audio = carry.velocity(timestep, step.audio, out_audio)
        out = pack_streams(out_video.float(), out_audio.float()).to(x.device)
        denoised = ms.calculate_denoised(sigmas[i], out, x.repeat(chunks, 1, 1)).chunk(chunks)
        x = sampler.step(i, x, cfg_combine(denoised[0], denoised[1] if chunks > 1 else None, sp.cfg))
        denoiser._step_done(i, t0)
    if not denoiser._is_result_rank():
        return None
    video, audio = unpack_streams(ms.inverse_noise_scaling(sigmas[-1], x).float().cpu(), video_shape, audio_shape)
    return (adapter.latent_format.process_out(video),
            carry.latent_out(audio) if carry is not None else audio)


def _carry_of(adapter) -> AudioCarry | None:
    """ModelSamplingAV's audio carry where the family runs its audio on its own shift (MiniMax-H3), else None."""
    shifts = getattr(adapter, "audio_shifts", None)
    return AudioCarry(*shifts) if shifts is not None else None


def _start(job: Job, sigma0, adapter, carry: AudioCarry | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams at the first sigma, as CFGGuider.inner_sample and KSAMPLER.sample make the packed latent: the
    NestedTensor's noise, process_latent_in unless the whole latent is zero (an empty latent), noise_scaling."""
    ms, video, audio = adapter.model_sampling, job.latent.float(), job.audio.float()
    noise = prepare_nested_noise((video, audio), job.sampling.seed, job.extra.get("batch_index"))
    if torch.count_nonzero(video) + torch.count_nonzero(audio) > 0:
        video = adapter.latent_format.process_in(video)
        audio = carry.latent_in(audio) if carry is not None else audio
    return ms.noise_scaling(sigma0, noise[0], video), ms.noise_scaling(sigma0, noise[1], audio)


def _call(call, step: Job, adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's model outputs (video, audio) in the latents' shapes, whole on every rank."""
    if getattr(adapter, "two_streams", False):
        call.step_times = []
        v, a = two_stream_outputs(call, step)
        return adapter.unpack(v, *step.latent.shape[2:]), adapter.unpack_audio(a, step.audio.shape[1])
    out = call.call_outputs(step)
    if call.topology.pipefusion > 1:  # only the last stage holds the output; the others hold zeros: a sum is exact
        out = call.comm.all_reduce(out, call.comm.group("pipefusion"), op="pipefusion")
    return adapter.unpack_av(out, *call.hw)
