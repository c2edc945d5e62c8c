"""ComfyUI 2026's model call for MiniMax-H3, read into the runtime's (video, audio) model call.

What BaseModel._apply_model hands MiniMaxH3Model.forward (comfy/model_base.py MiniMaxH3, comfy/ldm/minimax/model.py):
x = [video [B, 24, T, H, W], audio [B, 32, 2, T40]] (utils.unpack_latents of the packed latent), timestep = the
video sigma x 1000, context = the Qwen3-VL states (or states the host already refined: preprocess_text_embeds),
and minimax_payload (text_token_tags, keyframes, refs, cond latents and their noise augmentation, seed, layout,
audio_scale), denoise_mask / audio_denoise_mask, and the sigma shifts in transformer_options.

Read: x's two streams, timestep, context, audio_scale (the sampler carries the audio at (sigma_a / sigma_v) x its
latent: undone here on the host outside the wrappers, exactly as ComfyUI's forward undoes it), prompt tags that are
all text, the wrappers and patches RemoteDiT reads for every family (skip-layer block patches, LoRA). Refused in one sentence naming the node that adds it: everything else that changes the model's
output (keyframes, references, mixed prompt tags, denoise masks, other sigma shifts). The payload's layout, seed and
noise augmentation only describe keyframes and references, so without those they change nothing.
"""
from __future__ import annotations

import torch

from parallel_runtime.models.families.minimax_h3 import SIGMA_SHIFT_AUDIO, SIGMA_SHIFT_VIDEO, time_shift

from . import convert

SHIFT_KEYS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio")  # MiniMaxH3SigmaShift sets them
# MiniMaxH3Model's sigma_shift_video / _audio: the shifts the workers run.
DEFAULT_SHIFTS = (SIGMA_SHIFT_VIDEO, SIGMA_SHIFT_AUDIO)
TEXT_TAG = 1  # ComfyUI's modality tag of a prompt row that is text (video 0, audio 2)
# Payload entries the workers cannot run yet, by the node that adds them.
_PAYLOAD_SOURCES = {
    "keyframes": "first/last frames of MiniMaxH3ImageToVideo or MiniMaxH3AddGuide's guides",
    "refs": "MiniMaxH3ReferenceToVideo's reference blocks",
    "cond_video_latents": "MiniMaxH3ImageToVideo's, MiniMaxH3AddGuide's or MiniMaxH3ReferenceToVideo's latents",
    "cond_audio_latents": "MiniMaxH3AddGuide's or MiniMaxH3ReferenceToVideo's audio",
}


def is_av_call(x) -> bool:
    """Whether a model call's x is an audio-video model's streams (a list, or ComfyUI's NestedTensor)."""
    return isinstance(x, (list, tuple)) or bool(getattr(x, "is_nested", False))


def streams(x) -> tuple[torch.Tensor, torch.Tensor]:
    parts = list(getattr(x, "tensors", x))
    if len(parts) != 2 or parts[0].ndim != 5 or parts[1].ndim != 4:
        raise convert.ConfigError(f"the model call's latent has {len(parts)} stream(s) but MiniMax-H3 needs (video, "
                                  f"audio); use EmptyMiniMaxH3LatentAV's or MiniMaxH3ImageToVideo's latent.")
    return parts[0], parts[1]


def refuse_unsupported(payload: dict, options: dict, denoise_mask, audio_denoise_mask) -> None:
    """One sentence for each input of the call the workers would otherwise silently ignore."""
    present = [k for k in _PAYLOAD_SOURCES if payload.get(k)]
    if present:
        named = ", ".join(f"{k}: {_PAYLOAD_SOURCES[k]}" for k in present)
        raise convert.ConfigError(f"the MiniMax-H3 call carries conditioning ParaDiT does not run yet ({named}); "
                                  f"sample text-to-video-and-audio (EmptyMiniMaxH3LatentAV) or load the model with "
                                  f"UNETLoader.")
    tags = payload.get("text_token_tags")
    if tags is not None and bool((torch.as_tensor(tags) != TEXT_TAG).any()):
        raise convert.ConfigError("the MiniMax-H3 prompt holds image tokens (MiniMaxH3ImageToVideo's first/last "
                                  "frame in the prompt), which ParaDiT does not run yet; encode a text-only prompt "
                                  "or load the model with UNETLoader.")
    if denoise_mask is not None or audio_denoise_mask is not None:
        raise convert.ConfigError("the MiniMax-H3 call carries a denoise mask (SetLatentNoiseMask or an inpainting "
                                  "latent), which ParaDiT does not run for this model yet; remove that node or load "
                                  "the model with UNETLoader.")
    shifts = shifts_of(options, DEFAULT_SHIFTS)
    if shifts != DEFAULT_SHIFTS:
        raise convert.ConfigError(f"the MiniMax-H3 call sets sigma shifts {shifts} (video, audio) but ParaDiT runs "
                                  f"the model's own {DEFAULT_SHIFTS}; set MiniMaxH3SigmaShift (ModelSamplingMiniMaxH3) "
                                  f"to {DEFAULT_SHIFTS[0]:g} and {DEFAULT_SHIFTS[1]:g}, or load the model with "
                                  f"UNETLoader.")


def shifts_of(options: dict, defaults: tuple) -> tuple[float, float]:
    return tuple(float(options.get(k, d)) for k, d in zip(SHIFT_KEYS, defaults))


class AudioCarry:
    """ComfyUI's ModelSamplingAV carries the audio latent at sigma_a / sigma_v times the stream's own (payload
    audio_scale != 1): MiniMaxH3Model.forward undoes that outside the DIFFUSION_MODEL wrappers, so they and the
    network see the stream's own latent, and returns the carried variable's velocity; the same here, on the host."""

    def __init__(self, scale: float, carry: torch.Tensor, sigma_a: torch.Tensor):
        self.scale, self.carry, self.sigma_a = scale, carry, sigma_a
        self.carried = None

    @classmethod
    def of(cls, x, timestep: torch.Tensor, options: dict, payload) -> "AudioCarry | None":
        """The call's carry (from the first row's timestep, as ComfyUI's forward), None where there is none."""
        scale = float((payload or {}).get("audio_scale", 1.0))
        if not is_av_call(x) or scale == 1.0:
            return None
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        sigma_a = time_shift(sigma_v, *shifts_of(options, DEFAULT_SHIFTS))
        return cls(scale, sigma_a / sigma_v, sigma_a)

    def into(self, x) -> list:
        video, audio = streams(x)
        self.carried = audio * self.carry.to(audio.dtype)
        return [video, self.carried]

    def out_of(self, out) -> list:
        video, audio = out
        return [video, (1.0 - self.scale) * self.carried
                + (1.0 + (self.scale - 1.0) * self.sigma_a).to(audio.dtype) * audio]
