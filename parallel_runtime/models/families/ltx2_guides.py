"""LTX-2's guide frames in a model call: which video tokens run, where the guides sit, how strongly they attend.

LTXVAddGuide and LTXVAddLatentGuide (ComfyUI 2026's comfy_extras/nodes_lt.py) append a guide's latent frames after
the video's, so the latent the sampler steps grows by those frames, and record for the model call: each guide
token's pixel-space position (`keyframe_idxs` [B, 3, tokens, 2]: start and end on the time, height and width axes,
time in pixel frames), a noise mask for the guide frames (1 - strength; negative on a dilated IC-LoRA reference's
padding) and one `guide_attention_entries` dict per guide (its token count, strength, optional pixel mask). ComfyUI's
LTXVModel._process_input and _build_guide_self_attention_mask (comfy/ldm/lightricks/model.py) read them so:

- tokens whose noise mask is negative anywhere in their channels are dropped before the blocks and come back as
  zeros (`VideoGuides.kept`: the grid indices that run, ascending);
- the last `len(coords)` kept tokens are the guides'; their RoPE positions are keyframe_idxs' (filtered like the
  tokens) instead of the grid's (`token_coords`);
- where some guide's strength is not 1 or it carries a pixel mask, self-attention adds log(weight) between a tracked
  guide token and every video (non-guide) token, both ways: a video query reading that guide key, the guide query
  reading any video key; guide-guide and video-video scores are unchanged (`GuideBias`). A weight of 0 adds the
  dtype's lowest finite value, as ComfyUI does, so no query is ever left without keys. Like ComfyUI's, the bias is
  never built as queries x keys: the video's queries share one row of it, the guides' hold their own rows.

`guides_of_call` turns a call's inputs into `VideoGuides` on the host (the door: nodes/ltx2_call.py); the workers
read them in strategies/two_stream_call.py. Nothing here imports ComfyUI.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...spec import VideoGuides
from ...strategies.attention.bias import RowGroups


def guides_of_call(keyframe_idxs: torch.Tensor | None, denoise_mask: torch.Tensor | None, entries,
                   thw: tuple[int, int, int]) -> VideoGuides | None:
    """The call's guides as the workers take them, or None where the call has no guide tokens. `denoise_mask`: the
    video noise mask LTXAV.extra_conds hands the model ([B, C, T, H, W], or broadcastable to it); `entries`: the
    call's guide_attention_entries (None: no attention control); `thw`: the video latent's frames, height, width
    (the guides' frames included)."""
    if keyframe_idxs is None or keyframe_idxs.shape[2] == 0:
        return None
    t, h, w = thw
    guide_tokens = keyframe_idxs.shape[2]
    if guide_tokens % (h * w) or guide_tokens > t * h * w:
        raise ConfigError(f"the LTX-2 call's guides hold {guide_tokens} tokens, which is not a whole number of "
                          f"{h * w}-token latent frames of this latent: they were recorded at another resolution; "
                          f"crop the guides (LTXVCropGuides) before upscaling the latent and add them again after.")
    if keyframe_idxs.shape[0] > 1 and not bool((keyframe_idxs == keyframe_idxs[:1]).all()):
        raise ConfigError("the LTX-2 call's rows carry different guide frames (positive and negative made by "
                          "different LTXVAddGuide chains); feed both prompts through the same guide nodes.")
    kept = _kept_tokens(denoise_mask, thw)
    guide_kept = kept[-guide_tokens:]
    coords = keyframe_idxs[0].float()[:, guide_kept]
    return VideoGuides(torch.nonzero(kept).flatten(), coords.contiguous(),
                       _guide_weights(entries, guide_kept, guide_tokens))


def _kept_tokens(denoise_mask: torch.Tensor | None, thw: tuple[int, int, int]) -> torch.Tensor:
    """[T*H*W] bool: ComfyUI's grid_mask, the tokens whose noise mask (of the call's first row, as ComfyUI reads it)
    is nowhere negative."""
    t, h, w = thw
    if denoise_mask is None:
        return torch.ones(t * h * w, dtype=torch.bool)
    mask = denoise_mask[0]
    if mask.ndim != 4 or mask.shape[1] != t:
        raise ConfigError(f"the LTX-2 call's noise mask has shape {tuple(denoise_mask.shape)}, which does not fit its "
                          f"{t}-frame video latent; a node changed the latent after the guides were added: add the "
                          f"guides (LTXVAddGuide) last.")
    return ~(mask < 0).any(dim=0).expand(t, h, w).reshape(-1)


def _guide_weights(entries, guide_kept: torch.Tensor, guide_tokens: int) -> torch.Tensor | None:
    """[guide tokens kept] float32: each kept guide token's attention weight to the video (1: unchanged), or None
    where every weight is 1 (ComfyUI then builds no mask). ComfyUI's order: each entry's surviving tokens in turn,
    its pixel mask's per-token weights (cut to the surviving count) or its strength; the tracked weights sit on the
    first guide tokens and any guide token after them keeps weight 1."""
    if not entries:
        return None
    counts = [int(e["pre_filter_count"]) for e in entries]
    if sum(counts) != guide_tokens:
        raise ConfigError(f"the LTX-2 call's guide attention entries count {sum(counts)} tokens for {guide_tokens} "
                          f"guide tokens; a node edited the guides by hand: rebuild them with LTXVAddGuide.")
    if not any(float(e.get("strength", 1.0)) != 1.0 or e.get("pixel_mask") is not None for e in entries):
        return None
    tracked, offset = [], 0
    for entry, count in zip(entries, counts):
        surviving = int(guide_kept[offset:offset + count].sum())
        offset += count
        if surviving == 0:
            continue
        strength = float(entry.get("strength", 1.0))
        pixel_mask, shape = entry.get("pixel_mask"), entry.get("latent_shape")
        if pixel_mask is not None and shape is not None:
            per_token = downsample_mask(pixel_mask.detach().float().cpu(), *shape)[0]  # may arrive on a GPU
            tracked.append(per_token[:min(per_token.shape[0], surviving)] * strength)
        else:
            tracked.append(torch.full((surviving,), strength))
    weights = torch.ones(int(guide_kept.sum()))
    if tracked:
        joined = torch.cat(tracked)
        weights[:joined.shape[0]] = joined
    return None if bool((weights == 1.0).all()) else weights


def downsample_mask(mask: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """ComfyUI's LTXVModel._downsample_mask_to_latent: a pixel mask [B, 1, F, H, W] as per-token weights
    [B, frames * height * width]: area-averaged per frame, the first pixel frame for the first latent frame, the rest
    averaged in groups (or repeated where there are fewer pixel frames than latent frames)."""
    b, pixel_frames = mask.shape[0], mask.shape[2]
    spatial = F.interpolate(mask.permute(0, 2, 1, 3, 4).reshape(-1, 1, *mask.shape[3:]), size=(height, width),
                            mode="area").reshape(b, pixel_frames, height, width)
    first = spatial[:, :1]
    if pixel_frames > 1 and frames > 1:
        rest_pixels, rest_latent = pixel_frames - 1, frames - 1
        group = rest_pixels // rest_latent
        if group < 1:
            flat = spatial[:, 1:].permute(0, 2, 3, 1).reshape(-1, 1, rest_pixels)
            rest = F.interpolate(flat, size=rest_latent, mode="nearest").reshape(b, height, width, rest_latent)
            rest = rest.permute(0, 3, 1, 2)
        else:
            rest = spatial[:, 1:1 + rest_latent * group].reshape(b, rest_latent, group, height, width).mean(dim=2)
        latent = torch.cat([first, rest], dim=1)
    elif frames > 1:
        latent = first.expand(-1, frames, -1, -1)
    else:
        latent = first
    return latent.reshape(b, -1)


def token_coords(grid: torch.Tensor, guides: VideoGuides, fps: float) -> torch.Tensor:
    """The kept tokens' RoPE coordinates [B, 3, kept, 2] from the grid's (`grid`: diffusers' prepare_video_coords,
    time in seconds): the grid's, with the guide tokens' taken from keyframe_idxs (time from pixel frames to
    seconds, as LTXBaseModel._prepare_positional_embeddings scales it)."""
    coords = grid[:, :, guides.kept.to(grid.device)].clone()
    g = guides.coords.shape[1]
    if g:
        own = guides.coords.to(grid.device, grid.dtype).clone()
        own[0] = own[0] / fps
        coords[:, :, -g:] = own
    return coords


def first_frame_marker(grid: torch.Tensor, guides: VideoGuides | None) -> torch.Tensor:
    """[B, tokens] bool: the tokens LTX-2.5's keyframe row is added to (LTXVModel.keyframes_abs_pos_mask): those whose
    time starts at 0 (the causal first latent frame, one pixel frame), never a guide's."""
    marker = grid[:, 0, :, 0] == 0
    if guides is None:
        return marker
    marker = marker[:, guides.kept.to(grid.device)]
    g = guides.coords.shape[1]
    if g:
        marker[:, -g:] = False
    return marker


class GuideBias:
    """The guide attention of one call as the strategies cut it (bias.AttentionBias' interface): log(weight) between
    each tracked guide token and every video token, over `tokens` kept tokens whose last len(weights) are the guides',
    in the compute dtype (ComfyUI builds it in the model's dtype)."""

    def __init__(self, weights: torch.Tensor, tokens: int, dtype: torch.dtype, device):
        w = weights.to(device=device, dtype=dtype)
        lowest = torch.finfo(dtype)
        log_w = torch.where(w > 0, torch.log(w.clamp(min=lowest.tiny)), torch.full_like(w, lowest.min))
        self.log_weight = torch.zeros(tokens, dtype=dtype, device=device)
        self.log_weight[tokens - w.shape[0]:] = log_w
        self.guide_start = tokens - w.shape[0]

    def block(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> RowGroups:
        """The bias of queries `rows` over keys `cols` (canonical token indices; every key where None) as two row
        groups, as ComfyUI's _attention_with_guide_mask splits them: the video's queries share one row (the guide
        keys' log weights, broadcast), the guides' each add their own log weight on the video's keys; a group whose
        bias is all zero in this block carries none."""
        device = self.log_weight.device
        rows = rows.to(device)
        cols = torch.arange(len(self.log_weight), device=device) if cols is None else cols.to(device)
        row_guide, col_guide = rows >= self.guide_start, cols >= self.guide_start
        zero = self.log_weight.new_zeros(())
        video_rows, guide_rows = torch.nonzero(~row_guide).flatten(), torch.nonzero(row_guide).flatten()
        video_bias = guide_bias = None
        if bool(col_guide.any()):  # the video's queries reading guide keys
            video_bias = torch.where(col_guide, self.log_weight[cols], zero)[None, None, None]
        if bool((~col_guide).any()) and len(guide_rows):  # the guides' queries reading video keys
            guide_bias = torch.where(~col_guide[None, :], self.log_weight[rows[guide_rows]][:, None], zero)[None, None]
        return RowGroups(((video_rows, video_bias), (guide_rows, guide_bias)))

    def dense(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """The same block as one [1, 1, len(rows), len(cols)] tensor (what the groups add, row by row)."""
        groups = self.block(rows, cols)
        n = len(self.log_weight) if cols is None else len(cols)
        out = self.log_weight.new_zeros(1, 1, len(rows), n)
        for index, bias in groups.groups:
            if bias is not None:
                out[:, :, index] = bias.expand(1, 1, len(index), n)
        return out
