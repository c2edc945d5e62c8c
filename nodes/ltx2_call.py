"""ComfyUI 2026's model call for LTX-2 / 2.3, read into the runtime's two-stream model call.

What BaseModel._apply_model hands LTXAVModel.forward (comfy/model_base.py LTXAV, comfy/ldm/lightricks/av_model.py):
x = [video [B, 128, T, H, W], audio [B, 8, frames, 16]] (utils.unpack_latents of the packed latent); timestep =
LTXAV.process_timestep's (video, audio) pair: the sigma per row, or where the sampler holds a noise mask
(LTXVImgToVideo's first frame at 1 - strength, an audio mask) mask x sigma per video token [B, tokens, 1] and per
audio frame [B, frames, 1]; context = the prompt connectors' rows, which extra_conds made through the diffusion
model's preprocess_text_embeds (RemoteDiT runs the file's connectors on the host:
parallel_runtime/models/families/ltx2_connectors.py); frame_rate (LTXVConditioning); denoise_mask /
audio_denoise_mask (the noise masks, which the model reads to drop a guide's padding tokens); keyframe_idxs and
guide_attention_entries (LTXVAddGuide, LTXVAddLatentGuide); and what reference-audio and guidance nodes add.

Read: both streams, the timesteps (per video row, latent frame or token: per token only where the mask varies
within a frame, a dilated IC-LoRA guide's or an inpainting mask's), frame_rate, the prompt, the guide frames (which
tokens run, the guides' positions and attention weights: spec.VideoGuides), and the wrappers, LoRA and block-skip
patches RemoteDiT reads for every family. Refused in one sentence naming the node that adds it, before the workers
see the call: everything else that changes the output (generated keyframes, STG's perturbed blocks, modality
guidance's severed cross-attention, ControlNet residuals). LTXVReferenceAudio's reference audio (ref_audio) is read:
its tokens ride as Job.audio_reference.
"""
from __future__ import annotations

import torch

from . import convert

DEFAULT_FRAME_RATE = 25.0  # LTXAV.extra_conds' frame_rate without LTXVConditioning
# Model inputs ComfyUI 2026 passes that the workers do not run, by the node that adds them.
_INPUT_SOURCES = {
    "generated_keyframes": "LTX-2.5's generated keyframes",
}
# transformer_options keys the model reads, by the node that sets them, and which values leave the output unchanged.
_OPTION_SOURCES = {
    "stg_self_attn_blocks": ("LTXVSpatioTemporalGuidance's perturbed blocks", lambda v: not v),
    "a2v_cross_attn": ("LTXVModalityGuidance's severed audio-video attention", lambda v: v is True),
    "v2a_cross_attn": ("LTXVModalityGuidance's severed audio-video attention", lambda v: v is True),
    "run_vx": ("a node that skips the video stream", lambda v: v is True),
    "run_ax": ("a node that skips the audio stream", lambda v: v is True),
}
# Inputs read here (frame_rate, the masks through the timesteps) or handed on to the generic checks.
READ_INPUTS = ("frame_rate", "denoise_mask", "audio_denoise_mask", "latent_shapes", "attention_mask", "keyframe_idxs",
               "guide_attention_entries", "ref_audio") + tuple(_INPUT_SOURCES)


def patchifiers():
    """The patchifiers LTXAV.process_timestep calls on the diffusion model: ComfyUI's own, as LTXAVModel holds them."""
    from comfy.ldm.lightricks.symmetric_patchifier import AudioPatchifier, SymmetricPatchifier

    return SymmetricPatchifier(1, start_end=True), AudioPatchifier(1, start_end=True)


def streams(x) -> tuple[torch.Tensor, torch.Tensor]:
    parts = list(getattr(x, "tensors", x)) if isinstance(x, (list, tuple)) or getattr(x, "is_nested", False) else [x]
    if len(parts) != 2 or parts[0].ndim != 5 or parts[1].ndim != 4:
        raise convert.ConfigError(f"the model call's latent has {len(parts)} stream(s) but LTX-2 needs (video, "
                                  f"audio); join them with LTXVConcatAVLatent (an empty audio latent from "
                                  f"LTXVEmptyLatentAudio) before sampling.")
    return parts[0], parts[1]


def refuse_unsupported(kwargs: dict, options: dict, control) -> None:
    """One sentence for each input of the call the workers would otherwise silently ignore."""
    present = [k for k, source in _INPUT_SOURCES.items() if _carries(kwargs.get(k))]
    present += [k for k, (_, unchanged) in _OPTION_SOURCES.items() if k in options and not unchanged(options[k])]
    if present:
        named = ", ".join(f"{k}: {(_INPUT_SOURCES.get(k) or _OPTION_SOURCES[k][0])}" for k in present)
        raise convert.ConfigError(f"the LTX-2 call carries inputs ParaDiT does not run yet ({named}); remove that "
                                  f"node or load the model with UNETLoader.")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise convert.ConfigError("the LTX-2 prompt carries an attention mask that hides tokens, which ParaDiT does "
                                  "not apply for this model yet; encode the prompt with LTXAVTextEncoderLoader's text "
                                  "encoder or load the model with UNETLoader.")
    if control is not None:
        raise convert.ConfigError("the LTX-2 call carries ControlNet residuals, which ParaDiT does not add for this "
                                  "model; remove the ControlNet or load the model with UNETLoader.")


def _carries(value) -> bool:
    if value is None:
        return False
    if isinstance(value, torch.Tensor):  # keyframe_idxs [B, 3, tokens, 2]: no guide tokens is no guide
        return value.numel() > 0
    return bool(value)


def guides(kwargs: dict, thw: tuple):
    """The call's guide frames (LTXVAddGuide, LTXVAddLatentGuide) as the workers take them (spec.VideoGuides), or
    None: which tokens run, the guides' positions and attention weights (parallel_runtime's ltx2_guides.py reads
    keyframe_idxs, the video noise mask and guide_attention_entries as LTXVModel._process_input does)."""
    from parallel_runtime.models.families.ltx2_guides import guides_of_call

    keyframe_idxs = kwargs.get("keyframe_idxs")
    if keyframe_idxs is None:
        return None
    mask = kwargs.get("denoise_mask")
    return guides_of_call(keyframe_idxs.detach().float().cpu(), None if mask is None else mask.detach().float().cpu(),
                          kwargs.get("guide_attention_entries"), thw)


def reference_audio(kwargs: dict) -> torch.Tensor | None:
    """LTXVReferenceAudio's reference (ID-LoRA): its patchified audio latent tokens [1 or rows, frames, channels x
    bins] as float32 on the host, or None."""
    ref = kwargs.get("ref_audio")
    if ref is None:
        return None
    tokens = ref.get("tokens") if isinstance(ref, dict) else None
    if not isinstance(tokens, torch.Tensor):
        raise convert.ConfigError("the LTX-2 call's reference audio carries no tokens (LTXVReferenceAudio makes a "
                                  "dict with its audio latent's tokens); connect LTXVReferenceAudio's conditioning "
                                  "outputs as they are.")
    return tokens.detach().float().cpu()


def call_timesteps(timestep, thw: tuple, audio_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(video [rows], [rows, T] or [rows, tokens], audio [rows] or [rows, frames]) sigmas from process_timestep's
    pair: the runtime's per-row, per-frame or (where a mask varies within a frame: a dilated guide's, an inpainting
    mask's) per-token video timesteps and per-row or per-frame audio ones."""
    video, audio = timestep if isinstance(timestep, (tuple, list)) else (timestep, timestep)
    rows, (t, h, w) = video.shape[0], thw
    if video.ndim > 1:
        per_token = video.reshape(rows, -1)
        if per_token.shape[1] == t * h * w:
            per_frame = per_token.view(rows, t, h * w)
            video = per_token if bool((per_frame != per_frame[..., :1]).any()) else per_frame[..., 0]
        elif per_token.shape[1] == t:
            video = per_token
        else:
            raise convert.ConfigError(f"the LTX-2 call's video timesteps have shape {tuple(video.shape)}, which fits "
                                      f"neither its {t} latent frames nor their {t * h * w} tokens; a node patches "
                                      f"the timesteps in a way ParaDiT does not split: remove it.")
    if audio.ndim > 1:
        audio = audio.reshape(rows, -1)
        if audio.shape[1] != audio_frames:
            raise convert.ConfigError(f"the LTX-2 call's audio timesteps have {audio.shape[1]} values per row for "
                                      f"{audio_frames} audio frames; a node patches the audio timesteps in a way "
                                      f"ParaDiT does not split: remove it.")
    return video, audio


def frame_rate(kwargs: dict) -> float:
    value = kwargs.get("frame_rate")
    return DEFAULT_FRAME_RATE if value is None else float(value)
