"""ComfyUI 2026's model call for HiDream O1, read into the runtime's ordinary model call.

What model_base.HiDreamO1.extra_conds hands HiDreamO1Transformer.forward (comfy/ldm/hidream_o1/conditioning.py's
build_extra_conds): `context` = the token ids as float32 [B, L, 1] (HiDreamO1TE's surrogate cross_attn, which the
workers embed: Conditioning.cond), and beside it input_ids [B, L], position_ids [B, 3, L + patches], token_types and
vinput_mask [B, L + patches] and ar_len (L - 1). The workers rebuild the positions and the two-pass mask from the
prompt's length and the image's grid (models/families/hidream_o1.py), so here those inputs are checked to be what
ComfyUI's build_extra_conds makes and then dropped; anything else would be sampled wrongly, so it is refused in one
sentence.

HiDreamO1ReferenceImages' references (build_extra_conds' edit branch) arrive as ref_pixel_values and
ref_image_grid_thw (the vision tower's inputs: model-level, the first row's are the call's, as ComfyUI's model reads
them) and ref_patches [B, R, 3072] (each reference's 32-px patches, concatenated), with input_ids holding the
prompt's vision blocks ([vision_start, image_pad x N, vision_end] per reference after its first 3 tokens) while
`context` keeps the plain prompt. Here the patches become one image per reference (its grid read off position_ids:
each reference block's ids start at one T value), carried as the chunk's reference images; the tower's inputs ride
beside them (Conditioning.vision); the prompt is input_ids, vision blocks included; and the positions the workers
will rebuild are checked against ComfyUI's.
"""
from __future__ import annotations

import torch

from . import convert

READ_INPUTS = ("input_ids", "position_ids", "token_types", "vinput_mask", "ar_len")
REFERENCE_INPUTS = ("ref_pixel_values", "ref_image_grid_thw", "ref_patches")
VISION_INPUT = "hidream_o1_vision"  # (ref_pixel_values [N, 1536], ref_image_grid_thw [K, 3]) for _chunk_conditioning
VIT_MERGE = 2  # conditioning.VIT_MERGE: 2x2 tower patches per vision token
_FIX = "run it with CheckpointLoaderSimple's MODEL and a stock KSampler instead"


def take_conds(x: torch.Tensor, context: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """(the prompt as exact ids [B, L, 1] in float32, kwargs without O1's own inputs: with references, their images
    as `ref_latents` and the tower's inputs as VISION_INPUT), after checking they describe this call's sequence.
    BaseModel._apply_model casts `context` to the model's dtype, and bf16 rounds ids above 256, so the ids come from
    input_ids (int64, never cast); context must be them (less the vision blocks) in its own dtype."""
    from parallel_runtime.models.families.hidream_o1 import PATCH, HiDreamO1Config, position_ids

    size_problem = HiDreamO1Config.latent_problem(tuple(x.shape))  # the runtime's own rule, before the grid is cut
    if size_problem:
        raise convert.ConfigError(f"{size_problem}.")
    h, w = x.shape[-2:]
    ids = kwargs.get("input_ids")
    refs = _references(kwargs, ids, x.shape[0])
    text_len = ids.shape[1] if ids is not None else context.shape[1]
    plain = _without_vision_blocks(ids, refs["tokens"]) if refs and ids is not None else ids
    if ids is None or tuple(plain.shape) != tuple(context.shape[:2]) or \
            not torch.equal(plain.cpu().to(context.dtype), context[..., 0].cpu()):
        raise convert.ConfigError(f"the HiDream O1 call's input_ids do not match its prompt; encode the prompt with "
                                  f"the HiDream O1 checkpoint's CLIP (CLIPTextEncode) or {_FIX}.")
    pos, ar_len = kwargs.get("position_ids"), kwargs.get("ar_len")
    grids = refs["grids"] if refs else ()
    merged = tuple((int(t), int(gh) // VIT_MERGE, int(gw) // VIT_MERGE) for t, gh, gw in refs["grid"].tolist()) \
        if refs else ()
    want = position_ids(text_len, h // PATCH, w // PATCH, merged, grids).T
    if pos is None or pos.shape[-2:] != want.shape or not torch.equal(pos.long().cpu()[0], want) or \
            int(ar_len if ar_len is not None else -1) != text_len - 1:
        what = "an edit call's" if refs else "a text-to-image call's"
        raise convert.ConfigError(f"the HiDream O1 call's positions or ar_len are not {what} for {text_len} prompt "
                                  f"tokens; a node changed them, so {_FIX}.")
    mask = kwargs.get("vinput_mask")
    image = mask.bool().cpu() if mask is not None else None
    if image is not None and not (bool(image[:, text_len:].all()) and not bool(image[:, :text_len].any())):
        raise convert.ConfigError(f"the HiDream O1 call's vinput_mask does not mark the image after the prompt; "
                                  f"{_FIX}.")
    rest = {k: v for k, v in kwargs.items() if k not in READ_INPUTS + REFERENCE_INPUTS}
    if refs:
        rest["ref_latents"] = refs["images"]
        rest[VISION_INPUT] = (refs["pixels"], refs["grid"])
    return ids.long().unsqueeze(-1).float().to(context.device), rest


def _references(kwargs: dict, ids, rows: int) -> dict | None:
    """The call's reference inputs read back into images and the tower's inputs (None: a text-to-image call):
    `images` one [rows, 3, 32 h, 32 w] image in [-1, 1] per reference, `grids` their (h, w) patch grids, `pixels`
    and `grid` the tower's inputs, `tokens` each reference's vision-token count."""
    present = [k for k in REFERENCE_INPUTS if kwargs.get(k) is not None]
    if not present:
        return None
    if len(present) != len(REFERENCE_INPUTS):
        missing = ", ".join(k for k in REFERENCE_INPUTS if k not in present)
        raise convert.ConfigError(f"the HiDream O1 call carries reference images without {missing}; attach them with "
                                  f"HiDreamO1ReferenceImages, or {_FIX}.")
    pixels, grid, patches = (kwargs[k].detach().cpu() for k in REFERENCE_INPUTS)
    pixels = pixels[0] if pixels.dim() == 3 else pixels  # extra_conds' leading batch dim: the refs are model-level
    grid = (grid[0] if grid.dim() == 3 else grid).long()
    pos = kwargs.get("position_ids")
    if ids is None or pos is None or grid.dim() != 2 or grid.shape[-1] != 3 or patches.dim() != 3 or \
            patches.shape[-1] != 3 * 32 * 32:
        raise convert.ConfigError(f"the HiDream O1 call's reference inputs are not HiDreamO1ReferenceImages'; {_FIX}.")
    tokens = [int(t * gh * gw) // VIT_MERGE ** 2 for t, gh, gw in grid.tolist()]
    # The reference blocks of the positions: after the prompt and the target, each reference's ids run from one T
    # value (its (0, r, c) grid plus one start), so the runs of equal T are the references in order.
    start = pos.shape[-1] - patches.shape[1]
    t_ids, r_ids, c_ids = pos.long().cpu()[0][:, start:]
    grids, images, at = [], [], 0
    for _ in range(grid.shape[0]):
        if at >= t_ids.numel():
            break
        first = int(t_ids[at])
        n = int((t_ids[at:] == first).long().cumprod(0).sum())
        gh, gw = int(r_ids[at:at + n].max()) - first + 1, int(c_ids[at:at + n].max()) - first + 1
        if gh * gw != n:
            break
        block = patches[:, at:at + n].float().reshape(-1, gh, gw, 3, 32, 32).permute(0, 3, 1, 4, 2, 5)
        images.append(block.reshape(-1, 3, gh * 32, gw * 32).expand(rows, -1, -1, -1).contiguous())
        grids.append((gh, gw))
        at += n
    if len(grids) != grid.shape[0] or at != patches.shape[1]:
        raise convert.ConfigError(f"the HiDream O1 call's reference patches do not match its {grid.shape[0]} "
                                  f"reference images' positions; a node changed them, so {_FIX}.")
    return {"images": images, "grids": tuple(grids), "pixels": pixels.float(), "grid": grid, "tokens": tokens}


def _without_vision_blocks(ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """input_ids less the [vision_start, image_pad x n, vision_end] blocks build_ref_input_ids spliced in after the
    prompt's first 3 tokens (the shape stays wrong, and so refused, where they are not there)."""
    from parallel_runtime.models.families.hidream_o1 import IMAGE_PAD_ID, VISION_SPLICE_AT

    length = sum(n + 2 for n in tokens)
    body = ids[:, VISION_SPLICE_AT:VISION_SPLICE_AT + length].cpu()
    pads = torch.cat([torch.tensor([0] + [1] * n + [0], dtype=torch.bool) for n in tokens]) if tokens else None
    if ids.shape[1] < VISION_SPLICE_AT + length or pads is None or not bool((body[:, pads] == IMAGE_PAD_ID).all()):
        return ids
    return torch.cat([ids[:, :VISION_SPLICE_AT], ids[:, VISION_SPLICE_AT + length:]], dim=1)
