"""Which of the runtime's two loops samples a graph: the one place that decides.

Parallel Sampler and KSampler take the same inputs on Load Parallel DiT's MODEL. The workers can run the whole
step loop themselves (one job: PipeFusion pipelines across steps, nothing crosses the host between steps), but
that loop knows only the runtime's samplers, schedulers and conditioning. Every other graph is sampled by
ComfyUI's own sampler, calling the workers once per model evaluation, exactly as under KSampler. `worker_loop_gap`
names the first thing in a graph the worker loop would not reproduce (None: it runs the graph), so both nodes
share one decision and one set of sentences; what the per-call path cannot run either is refused by the model
call itself (remote_model), whichever node asked.
"""
from __future__ import annotations

import math

import torch

from .controlnet import WRAPPER_KEY as CONTROLNET_WRAPPER

# Conditioning keys the worker loop reads (convert.conditioning, sampler._with_concat), with the values at which
# a key changes nothing. Any other key (area, mask, ControlNet, hooks, CLIP-vision tokens, 2026's new keys, ...)
# routes the graph to ComfyUI's sampler, which hands the key to the model call as it does under KSampler.
_READ_KEYS = {"pooled_output", "guidance", "width", "height", "aspect_ratio", "reference_latents",
              "reference_latents_method", "concat_latent_image", "concat_mask", "concat_mask_index",
              "camera_conditions", "vace_frames", "vace_mask", "vace_strength", "conditioning_llama3",
              "frame_rate", "unprocessed_ltxav_embeds",  # LTX-2's (sampler._validated_job, _with_prompt_states)
              "clip_vision_output", "pose_video_latent", "face_video_pixels"}  # sampler._with_image_inputs
_NEUTRAL = {"start_percent": 0.0, "end_percent": 1.0, "strength": 1.0}
MINIMAX_TEXT_TAG = 1  # ComfyUI's modality tag of a MiniMax-H3 prompt row that is text (video 0, audio 2)

# What each routed key is, for the status line ("per-call pipeline: the graph has ...").
_KEY_NAMES = {
    "area": "area conditioning (ConditioningSetArea)",
    "mask": "masked conditioning (ConditioningSetMask)",
    "control": "a ControlNet",
    "gligen": "GLIGEN",
    "hooks": "conditioning hooks (LoRA hooks)",
    "attention_mask": "an attention mask (StyleModelApply's, or a padded prompt's)",
    "context_latents": "Bernini's in-context latents (BerniniConditioning)",
    "start_percent": "a timestep range (ConditioningSetTimestepRange)",
    "end_percent": "a timestep range (ConditioningSetTimestepRange)",
    "strength": "a conditioning strength other than 1",
    "minimax_token_tags": "image tokens in the MiniMax-H3 prompt (MiniMaxH3ImageToVideo's frames)",
    "hidream_o1_ref_images": "HiDream O1 reference images (HiDreamO1ReferenceImages)",
}

# What ComfyUI's model_options entries that change how a sampler calls or combines the model are, for the status
# line; any other non-empty entry routes too, named by its key.
_HOOK_NAMES = {"model_function_wrapper": "a model function wrapper", "sampler_cfg_function": "a CFG function",
               "sampler_pre_cfg_function": "a pre-CFG function", "sampler_post_cfg_function": "a post-CFG function",
               "sampler_calc_cond_batch_function": "a cond-batch function",
               "denoise_mask_function": "a denoise mask function (DifferentialDiffusion)"}



def worker_loop_gap(model, cfg: float, sampler_name: str, scheduler: str, positive, negative, latent,
                    video_model: bool) -> str | None:
    """What in this graph the worker-side step loop does not run, as a phrase ("a noise mask"); None when it
    runs all of it. `model`: the MODEL (its patches are read), `video_model`: whether the file is a video model
    (whose latents keep their frame axis)."""
    from parallel_runtime.sampling import SAMPLERS, SCHEDULERS, cfg_uses_uncond

    if sampler_name not in SAMPLERS:
        return f"the sampler {sampler_name}"
    if scheduler not in SCHEDULERS:
        return f"the scheduler {scheduler}"
    gap = _model_patch_gap(model) or _latent_gap(latent, video_model) or _conditioning_gap(positive, "positive")
    if gap is None and _finite(cfg) and cfg_uses_uncond(float(cfg)):  # at cfg 1 both loops skip the negative
        gap = _conditioning_gap(negative, "negative")
    return gap


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _model_patch_gap(model) -> str | None:
    """Anything set on the MODEL that ComfyUI's sampler would apply and the worker loop would not: a ModelSampling
    patch, a guidance hook (SkipLayerGuidanceDiT's post-CFG function, CFG-Zero*), DifferentialDiffusion's denoise
    mask function, block patches, another node's wrappers, callbacks, injections or attachments (on the patcher
    itself: ComfyUI copies them into transformer_options only inside the sampler's clone). Only ParaDiT's own
    ControlNet wrapper (which acts only on conditionings carrying a ControlNet, routed anyway) is no reason."""
    patched = sorted(getattr(model, "object_patches", None) or {})
    if patched:
        return f"a patched model ({', '.join(patched)}, as ModelSampling nodes set)"
    options = getattr(model, "model_options", None) or {}
    for key, value in options.items():
        if key != "transformer_options" and _present(value):
            return f"{_HOOK_NAMES[key]} ({key})" if key in _HOOK_NAMES else f"a model option ({key})"
    transformer = options.get("transformer_options") or {}
    for key in ("patches_replace", "patches"):
        if _present(transformer.get(key)):
            return f"block patches ({key}, as SkipLayerGuidance nodes set)"
    for where in (transformer, vars(model) if hasattr(model, "__dict__") else {}):
        for kind in ("wrappers", "callbacks"):
            # One key per node: EasyCache's "easycache" wraps three stages (outer sample, cond batch, model).
            named = sorted({key for per_type in (where.get(kind) or {}).values()
                            for key, fns in (per_type or {}).items() if key != CONTROLNET_WRAPPER and _present(fns)})
            if named:
                return f"a model {kind[:-1]} ({', '.join(named)})"
    for key, value in transformer.items():
        if key not in ("patches_replace", "patches", "wrappers", "callbacks") and _present(value):
            return f"a transformer option ({key})"
    for kind in ("injections", "attachments"):
        if _present(getattr(model, kind, None)):
            return f"model {kind} ({', '.join(sorted(map(str, getattr(model, kind))))})"
    return None


def _present(value) -> bool:
    """Whether an option is set: a tensor always is (its truth value is ambiguous), a container when any of its
    entries is, anything else by its truth."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_present(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_present(v) for v in value)
    return bool(value)


def _latent_gap(latent, video_model: bool) -> str | None:
    if not isinstance(latent, dict):
        return None  # not a LATENT: convert.latent_samples says so in one sentence
    if latent.get("noise_mask") is not None:
        return "a noise mask (inpainting, or an image-to-video latent's first frames)"
    samples = latent.get("samples")
    if isinstance(samples, torch.Tensor) and samples.dim() == 5 and samples.shape[2] > 1 and not video_model:
        # The model call refuses it (remote_model), so both nodes give that one sentence.
        return f"a {samples.shape[2]}-frame video latent"
    return None


def _conditioning_gap(value, which: str) -> str | None:
    if not isinstance(value, (list, tuple)) or not value:
        return None  # not a CONDITIONING: convert.conditioning says so in one sentence
    if len(value) > 1:
        return f"{len(value)} combined {which} conditionings"
    entry = value[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        return None
    for key, v in (entry[1] or {}).items():
        if v is None or (key in _READ_KEYS and key != "reference_latents"):
            continue
        if key in _NEUTRAL and _is_neutral(v, _NEUTRAL[key]):
            continue
        if key == "attention_mask" and _hides_nothing(v):
            continue
        if key == "minimax_token_tags" and _all_text(v):
            continue
        if key == "text_input_ids" and _same_ids(v, entry[0]):
            continue
        if key == "reference_latents" and "text_input_ids" in (entry[1] or {}):
            # HiDream O1's reference images (HiDreamO1ReferenceImages): images, not latents, whose vision-tower
            # inputs and patches the host's extra_conds prepares for the model call
            return f"HiDream O1 reference images (HiDreamO1ReferenceImages) in the {which} conditioning"
        if key in _READ_KEYS:
            continue
        return f"{_KEY_NAMES.get(key, repr(key))} in the {which} conditioning"
    return None


def _hides_nothing(mask) -> bool:
    """A prompt mask [B, L] of all ones (Lumina 2's and Z-Image's encoders always attach one): ComfyUI's
    extra_conds drops it, and the worker loop runs the unpadded prompt it describes."""
    return isinstance(mask, torch.Tensor) and mask.ndim == 2 and bool((mask == 1).all())


def _same_ids(ids, cond) -> bool:
    """HiDream O1's text_input_ids beside its cross_attn, which holds the same ids as float32 [B, L, 1]
    (HiDreamO1TE): the worker loop embeds them from the cross_attn, so the key adds nothing."""
    return (isinstance(ids, torch.Tensor) and isinstance(cond, torch.Tensor) and cond.ndim == 3
            and cond.shape[-1] == 1 and tuple(ids.shape) == tuple(cond.shape[:2])
            and torch.equal(ids.long().cpu(), cond[..., 0].round().long().cpu()))


def _all_text(tags) -> bool:
    """MiniMax-H3's prompt tags when every row is text (its text encoder always attaches them): the worker loop's
    packed sequence tags the prompt so (a keyframe's image tokens in the prompt route the graph)."""
    return isinstance(tags, torch.Tensor) and bool((tags == MINIMAX_TEXT_TAG).all())


def _is_neutral(value, neutral: float) -> bool:
    try:
        return float(value) == neutral
    except (TypeError, ValueError):
        return False
