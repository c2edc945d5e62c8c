"""ComfyUI 2026's model call for HiDream O1, read into the runtime's ordinary model call.

What model_base.HiDreamO1.extra_conds hands HiDreamO1Transformer.forward (comfy/ldm/hidream_o1/conditioning.py's
build_extra_conds): `context` = the token ids as float32 [B, L, 1] (HiDreamO1TE's surrogate cross_attn, which the
workers embed: Conditioning.cond), and beside it input_ids [B, L], position_ids [B, 3, L + patches], token_types and
vinput_mask [B, L + patches] and ar_len (L - 1). The workers rebuild the positions and the two-pass mask from the
prompt's length and the image's grid (models/families/hidream_o1.py), so here those inputs are checked to be what a
text-to-image call's are and then dropped; anything else would be sampled wrongly, so it is refused in one sentence.
Refused: HiDreamO1ReferenceImages' references (ref_pixel_values, ref_image_grid_thw, ref_patches: the Qwen3-VL
vision tower, which the workers do not load).
"""
from __future__ import annotations

import torch

from . import convert

READ_INPUTS = ("input_ids", "position_ids", "token_types", "vinput_mask", "ar_len")
REFERENCE_INPUTS = ("ref_pixel_values", "ref_image_grid_thw", "ref_patches")
_FIX = "run it with CheckpointLoaderSimple's MODEL and a stock KSampler instead"


def take_conds(x: torch.Tensor, context: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """(the prompt as exact ids [B, L, 1] in float32, kwargs without O1's own inputs), after checking they describe
    this call's text-to-image sequence. BaseModel._apply_model casts `context` to the model's dtype, and bf16 rounds
    ids above 256, so the ids come from input_ids (int64, never cast); context must be them in its own dtype."""
    from parallel_runtime.models.families.hidream_o1 import PATCH, HiDreamO1Config, position_ids

    if any(kwargs.get(k) is not None for k in REFERENCE_INPUTS):
        raise convert.ConfigError(f"the HiDream O1 call carries reference images (HiDreamO1ReferenceImages), which "
                                  f"ParaDiT does not run (they pass through the Qwen3-VL vision tower); {_FIX}.")
    text_len = context.shape[1]
    h, w = x.shape[-2:]
    size_problem = HiDreamO1Config.latent_problem(tuple(x.shape))  # the runtime's own rule, before the grid is cut
    if size_problem:
        raise convert.ConfigError(f"{size_problem}.")
    ids = kwargs.get("input_ids")
    if ids is None or tuple(ids.shape) != tuple(context.shape[:2]) or \
            not torch.equal(ids.cpu().to(context.dtype), context[..., 0].cpu()):
        raise convert.ConfigError(f"the HiDream O1 call's input_ids do not match its prompt; encode the prompt with "
                                  f"the HiDream O1 checkpoint's CLIP (CLIPTextEncode) or {_FIX}.")
    want = position_ids(text_len, h // PATCH, w // PATCH).T
    pos, ar_len = kwargs.get("position_ids"), kwargs.get("ar_len")
    if pos is None or pos.shape[-2:] != want.shape or not torch.equal(pos.long().cpu()[0], want) or \
            int(ar_len if ar_len is not None else -1) != text_len - 1:
        raise convert.ConfigError(f"the HiDream O1 call's positions or ar_len are not a text-to-image call's for "
                                  f"{text_len} prompt tokens; a node changed them, so {_FIX}.")
    mask = kwargs.get("vinput_mask")
    image = mask.bool().cpu() if mask is not None else None
    if image is not None and not (bool(image[:, text_len:].all()) and not bool(image[:, :text_len].any())):
        raise convert.ConfigError(f"the HiDream O1 call's vinput_mask does not mark the image after the prompt; "
                                  f"{_FIX}.")
    rest = {k: v for k, v in kwargs.items() if k not in READ_INPUTS + REFERENCE_INPUTS}
    return ids.long().unsqueeze(-1).float().to(context.device), rest
