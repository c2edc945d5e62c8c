"""ComfyUI 2026's model call for MiniMax-H3, read into the runtime's (video, audio) model call.

What BaseModel._apply_model hands MiniMaxH3Model.forward (comfy/model_base.py MiniMaxH3, comfy/ldm/minimax/model.py):
x = [video [B, 24, T, H, W], audio [B, 32, 2, T40]] (utils.unpack_latents of the packed latent), timestep = the
video sigma x 1000, context = the Qwen3-VL states (or states the host already refined: preprocess_text_embeds),
and minimax_payload (text_token_tags, keyframes, refs, cond latents and their noise augmentation, seed, layout,
audio_scale), denoise_mask / audio_denoise_mask, and the sigma shifts in transformer_options.

Read: x's two streams, timestep, context, audio_scale (the sampler carries the audio at (sigma_a / sigma_v) x its
latent: undone here on the host outside the wrappers, exactly as ComfyUI's forward undoes it), the prompt's modality
tags (vision-token rows of MiniMaxH3ImageToVideo's frames in the prompt), fl2va's keyframe latents at their frames
(MiniMaxH3ImageToVideo's first/last frame, MiniMaxH3AddGuide's images and clips), ref2va's reference images
(MiniMaxH3ReferenceToVideo), the wrappers and patches RemoteDiT reads for every family (skip-layer block patches,
LoRA). The conditioning latents get ComfyUI's noise augmentation here on the host (aug x rows + (1 - aug) x noise,
the noise of the patch rows drawn from the payload's seed, restarted per latent, as _cond_video_rows draws it) and
ride to the workers as the call's reference latents, placed by the family's CallLayout (keyframes' frames,
references, prompt tags). Refused in one sentence naming the node that adds it: everything else that changes the
model's output (guide or reference audio, reference videos, another noise augmentation, denoise masks, other sigma
shifts). The payload's prebuilt layout is ComfyUI's own reading of the same keyframes and references.
"""
from __future__ import annotations

import torch

from parallel_runtime.models.families.minimax_h3 import (
    SIGMA_SHIFT_AUDIO, SIGMA_SHIFT_VIDEO, VISUAL_COND_T, CallLayout, patchify_video, time_shift, unpatchify_video)

from . import convert

SHIFT_KEYS = ("minimax_h3_sigma_shift_video", "minimax_h3_sigma_shift_audio")  # MiniMaxH3SigmaShift sets them
# MiniMaxH3Model's sigma_shift_video / _audio: the shifts the workers run.
DEFAULT_SHIFTS = (SIGMA_SHIFT_VIDEO, SIGMA_SHIFT_AUDIO)
TEXT_TAG = 1  # ComfyUI's modality tag of a prompt row that is text (video 0, audio 2)
# Conditioning the workers cannot run yet, by the node that adds it.
_GUIDE_AUDIO = "the audio of MiniMaxH3AddGuide's guide"
_REFERENCE_KINDS = {"video": "MiniMaxH3ReferenceToVideo's reference videos",
                    "video_audio": "MiniMaxH3ReferenceToVideo's reference videos with their soundtracks",
                    "audio": "MiniMaxH3ReferenceToVideo's reference audio"}


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
    unread = [_GUIDE_AUDIO for kf in payload.get("keyframes") or () if kf.get("audio_latent") is not None]
    unread += [_REFERENCE_KINDS.get(blk.get("kind"), f"reference blocks of kind {blk.get('kind')!r}")
               for blk in payload.get("refs") or () if blk.get("kind") != "image"]
    if payload.get("cond_audio_latents") and not unread:
        unread.append("conditioning audio (MiniMaxH3AddGuide's or MiniMaxH3ReferenceToVideo's)")
    if unread:
        raise convert.ConfigError(f"the MiniMax-H3 call carries conditioning ParaDiT does not run yet "
                                  f"({', '.join(dict.fromkeys(unread))}); anchor images only (MiniMaxH3AddGuide "
                                  f"without audio, reference images) or load the model with UNETLoader.")
    aug = float(payload.get("visual_cond_noise_aug", VISUAL_COND_T))
    if aug != VISUAL_COND_T and payload.get("cond_video_latents"):
        raise convert.ConfigError(f"the MiniMax-H3 call sets the conditioning frames' noise augmentation to {aug:g}, "
                                  f"but ParaDiT runs ComfyUI's own {VISUAL_COND_T:g}; remove the node that sets "
                                  f"visual_cond_noise_aug or load the model with UNETLoader.")
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


def conditioning_rows(payload: dict, text_len: int, video: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], str | None]:
    """(the keyframes' then the references' latents, noise-augmented as ComfyUI's model augments them, float32 on
    the CPU; their CallLayout's method, None where the call has neither nor mixed prompt tags)."""
    keyframes = [kf for kf in payload.get("keyframes") or () if kf.get("latent") is not None]
    references = [blk for blk in payload.get("refs") or () if blk.get("kind") == "image"]
    tags = payload.get("text_token_tags")
    tags = None if tags is None else [int(x) for x in torch.as_tensor(tags).flatten().tolist()]
    if tags is not None and len(tags) != text_len:
        raise convert.ConfigError(f"the MiniMax-H3 prompt has {text_len} rows but {len(tags)} modality tags; encode "
                                  f"the prompt and its images with one CLIPTextEncode / MiniMaxH3ImageToVideo node.")
    if tags is not None and all(x == TEXT_TAG for x in tags):
        tags = None  # all text: the family's default
    if not keyframes and not references and tags is None:
        return (), None
    frames = [int(kf["resolved_frame_index"]) for kf in keyframes]
    layout = CallLayout(tuple((f, int(kf["latent"].shape[2])) for f, kf in zip(frames, keyframes)), len(references),
                        None if tags is None else tuple(tags))
    # ComfyUI fills the conditioning rows from cond_video_latents (extra_conds: the keyframes' latents, then the
    # references'), which a core before 0.34.2 overwrote with the references' alone: then they do not fit the layout.
    latents = list(payload.get("cond_video_latents") or ())
    problem = layout.problem(tuple(tuple(z.shape) for z in latents), tuple(video.shape[-2:]))
    if problem is not None:
        raise convert.ConfigError(f"the MiniMax-H3 call's conditioning latents do not fit its keyframes and "
                                  f"references ({problem}); update ComfyUI to 0.34.2 or later, whose MiniMaxH3 "
                                  f"keeps the keyframes' latents beside the references'.")
    aug = float(payload.get("visual_cond_noise_aug", VISUAL_COND_T))
    seed = int(payload.get("seed", 0))
    return tuple(_augmented(z, aug, seed) for z in latents), layout.method


def _augmented(latent: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    """ComfyUI's _cond_video_rows on one latent: its patch rows aug x r + (1 - aug) x noise (a CPU generator seeded
    with `seed` for every latent), back in the latent's shape (patchifying is a permutation: the rows the workers
    patchify again are these)."""
    z = latent.detach().float().cpu()
    if aug >= 1.0:
        return z
    rows = patchify_video(z)[0]
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    rows = aug * rows + (1.0 - aug) * noise
    return unpatchify_video(rows[None], z.shape[2], z.shape[3] // 2, z.shape[4] // 2)


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
