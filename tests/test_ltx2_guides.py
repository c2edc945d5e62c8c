"""LTX-2's guide frames (LTXVAddGuide, LTXVAddLatentGuide) in a model call, LTX-2.5's keyframe row, and
LTXVReferenceAudio's reference audio (ID-LoRA).

Two calls as ComfyUI 2026's guide nodes make them (comfy_extras/nodes_lt.py, written out below in their own terms):
- "flf": LTXVAddGuide's first and last frame at strength 0.7 (the first-last-frame templates): two one-frame guides
  appended after a two-frame video, their noise mask 1 - 0.7, their positions at pixel frames 0 and 8, and guide
  attention entries of strength 0.7, so the video and the guides attend each other at log(0.7);
- "iclora": an IC-LoRA reference at half size (reference_downscale_factor 2) with a pixel attention mask: dilated onto
  the full grid with its padding's noise mask negative (those tokens are dropped), its positions' ends stretched by
  the factor, and per-token attention weights from the mask.

The reference is ComfyUI's LTXVModel._process_input, _build_guide_self_attention_mask and _process_output written
from comfy/ldm/lightricks/model.py over test_ltx2_comfyui.comfyui_call (LTXAVModel's forward on diffusers' modules
of the same file): tokens with a negative mask dropped, the guides' positions from keyframe_idxs, the guide mask as
one dense additive mask (ComfyUI splits the queries in groups to avoid building it; the sums are the same), dropped
tokens back as zeros. The runtime's side shares nothing with it but the file and the call's inputs.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families.ltx2_guides import GuideBias, guides_of_call
from test_ltx2 import AUDIO_FRAMES, CONFIGS, EXACT_RTOL, LTX23, PROMPT, H, W, paths  # noqa: F401
from test_ltx2_comfyui import comfyui_call

pytestmark = pytest.mark.timeout(300)

SIGMA, AUDIO_SIGMA, FPS = 0.8, 0.6, 25.0
SCALE = (8, 32, 32)  # the LTX-2 VAE's time, height and width factors (vae.downscale_index_formula)
LTX25 = dataclasses.replace(LTX23, keyframes=True)  # LTX-2.5: the learned keyframe row


# -- ComfyUI's guide nodes, written from comfy_extras/nodes_lt.py ------------------------------------------------

def pixel_coords(frames: int, height: int, width: int, causal_fix: bool) -> torch.Tensor:
    """latent_to_pixel_coords of SymmetricPatchifier(1)'s latent coords: [1, 3, tokens, 2] (start, end) per axis."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width),
                                      indexing="ij")).flatten(1).float()
    coords = torch.stack([grid, grid + 1], dim=-1)[None] * torch.tensor(SCALE).view(1, 3, 1, 1)
    if causal_fix:
        coords[:, 0] = (coords[:, 0] + 1 - SCALE[0]).clamp(min=0)
    return coords


def add_guide(call: dict, guide: torch.Tensor, frame_idx: int, strength: float, factor: int = 1,
              attention_mask: torch.Tensor | None = None) -> dict:
    """LTXVAddGuide.attach_guide_latent (dilate_latent, append_keyframe, add_keyframe_index and the attention
    entry) on `call`'s latent [1, C, T, H, W], noise mask [1, 1, T, H, W], keyframe_idxs and entries."""
    shape = list(guide.shape[2:])
    mask = torch.full((1, 1, guide.shape[2], *call["latent"].shape[3:]), max(0.0, 1.0 - strength))
    if factor > 1:  # dilate_latent: the reference on every factor-th position, its padding marked -1
        dilated = torch.zeros(*guide.shape[:3], guide.shape[3] * factor, guide.shape[4] * factor)
        dilated[..., ::factor, ::factor] = guide
        guide_mask = torch.full((1, 1, *dilated.shape[2:]), -1.0)
        guide_mask[..., ::factor, ::factor] = 1.0
        guide, mask = dilated, guide_mask - strength
    coords = pixel_coords(*guide.shape[2:], causal_fix=frame_idx == 0 or guide.shape[2] == 1)
    coords[:, 0] += frame_idx
    coords[:, 1:, :, 1:] += (factor - 1) * torch.tensor(SCALE[1:], dtype=torch.float32).view(1, -1, 1, 1)
    kf = call.get("keyframe_idxs")
    entry = {"pre_filter_count": guide.shape[2] * guide.shape[3] * guide.shape[4], "strength": strength,
             "pixel_mask": None if attention_mask is None else attention_mask[None, None], "latent_shape": shape}
    return dict(latent=torch.cat([call["latent"], guide], dim=2), noise_mask=torch.cat([call["noise_mask"], mask], 2),
                keyframe_idxs=coords if kf is None else torch.cat([kf, coords], dim=2),
                entries=[*call.get("entries", []), entry])


def make_call(kind: str, config, seed: int = 3) -> dict:
    """One call's video (with its guides appended), noise mask, keyframe_idxs and entries."""
    g = torch.Generator().manual_seed(seed)
    c = config.in_channels
    if kind == "flf":
        call = dict(latent=torch.randn(1, c, 2, H, W, generator=g), noise_mask=torch.ones(1, 1, 2, H, W))
        call = add_guide(call, torch.randn(1, c, 1, H, W, generator=g), 0, 0.7)
        return add_guide(call, torch.randn(1, c, 1, H, W, generator=g), 8, 0.7)  # frame_idx -1 of 9 pixel frames
    call = dict(latent=torch.randn(1, c, 3, H, W, generator=g), noise_mask=torch.ones(1, 1, 3, H, W))
    call["noise_mask"][:, :, 0] = 0.0  # LTXVImgToVideoInplace's first frame
    mask = torch.rand(1, 2 * SCALE[1], 3 * SCALE[2], generator=g)  # a MASK [frames, height, width] in pixels
    return add_guide(call, torch.randn(1, c, 1, H // 2, W // 2, generator=g), 0, 1.0, factor=2, attention_mask=mask)


# -- ComfyUI's model side, written from comfy/ldm/lightricks/model.py -------------------------------------------

def comfy_guide_mask(tokens: int, guide_tokens: int, weights: torch.Tensor) -> torch.Tensor:
    """GuideAttentionMask as one dense additive mask: log(weight) from the video's queries to the tracked guide keys
    and from the tracked guide queries to the video's keys (ComfyUI's noisy_mask and tracked_mask)."""
    tiny, lowest = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).min
    log_w = torch.where(weights > 0, torch.log(weights.clamp(min=tiny)), torch.full_like(weights, lowest))
    start, tracked = tokens - guide_tokens, weights.shape[0]
    full = torch.zeros(tokens, tokens)
    full[:start, start:start + tracked] = log_w[None]
    full[start:start + tracked, :start] = log_w[:, None]
    return full


def tracked_weights(call: dict, guide_kept: torch.Tensor) -> torch.Tensor | None:
    """_build_guide_self_attention_mask's weights: each entry's surviving tokens at its strength, or its pixel mask
    area-downsampled to the pre-dilation latent (one pixel frame, one latent frame here) times the strength."""
    entries = call["entries"]
    if not any(e["strength"] != 1.0 or e["pixel_mask"] is not None for e in entries):
        return None
    out, offset = [], 0
    for e in entries:
        surviving = int(guide_kept[offset:offset + e["pre_filter_count"]].sum())
        offset += e["pre_filter_count"]
        if e["pixel_mask"] is not None:
            f, h, w = e["latent_shape"]
            per_token = F.interpolate(e["pixel_mask"][:, :, 0], size=(h, w), mode="area").flatten(1)[0]
            out.append(per_token[:surviving] * e["strength"])
        else:
            out.append(torch.full((surviving,), e["strength"]))
    return torch.cat(out)


def comfyui_guided_call(path: str, config, call: dict, x: dict, fps: float = FPS) -> tuple[torch.Tensor, torch.Tensor]:
    """LTXVModel._process_input (grid_mask, keyframe positions), the guide mask, LTXAVModel's forward and
    _process_output's zeros for the dropped tokens, on `x`'s rows (every row carries the same guides)."""
    b, tokens = x["video"].shape[:2]
    kf = call["keyframe_idxs"]
    denoise = call["noise_mask"].expand(b, config.in_channels, *call["noise_mask"].shape[2:])
    grid_mask = ~torch.any(denoise.flatten(2).transpose(1, 2) < 0, dim=-1)[0]  # patchify, then any over channels
    kf_grid = grid_mask[-kf.shape[2]:]
    kf = kf[..., kf_grid, :]
    coords = pixel_coords(*call["latent"].shape[2:], causal_fix=True).expand(b, -1, -1, -1)[:, :, grid_mask].clone()
    coords[:, :, -kf.shape[2]:] = kf
    coords[:, 0] = coords[:, 0] * (1.0 / fps)
    kept = dict(x, video=x["video"][:, grid_mask], video_t=x["video_t"][:, grid_mask])
    weights = tracked_weights(call, kf_grid)
    n = int(grid_mask.sum())
    mask = None if weights is None else comfy_guide_mask(n, kf.shape[2], weights).expand(b, n, n)
    v, a = comfyui_call(path, "", kept, fps=fps, config=config, coords=coords, self_mask=mask,
                        guide_tokens=kf.shape[2])
    out = v.new_zeros(b, tokens, v.shape[2])
    out[:, grid_mask] = v
    return out, a


# -- the call as the runtime takes it ---------------------------------------------------------------------------

def guided_job(path: str, config, call: dict, strategy, seed: int = 11):
    """cond and uncond chunks of the call with its guides (process_timestep's per-token video sigmas: mask x sigma);
    `call` without keyframe_idxs: a call without guides."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec

    g = torch.Generator().manual_seed(seed)
    width = 2 * config.caption_channels if config.caption_channels else (
        config.cross_attention_dim + config.audio_cross_attention_dim)
    pos, neg = (Conditioning(torch.randn(1, PROMPT, width, generator=g), torch.zeros(1, 0)) for _ in "pn")
    thw = tuple(call["latent"].shape[2:])
    latent = torch.cat([call["latent"], torch.randn(call["latent"].shape, generator=g)])  # two rows: cond, uncond
    mask = call["noise_mask"].expand(2, 1, *thw)
    timestep = (mask * SIGMA).flatten(1)
    audio = torch.randn(2, config.audio_in_channels // 16, AUDIO_FRAMES, 16, generator=g)
    guides = guides_of_call(call.get("keyframe_idxs"), mask.expand(2, config.in_channels, *thw), call["entries"], thw)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), latent, pos, neg, timestep=timestep, audio=audio,
               audio_timestep=torch.full((2,), AUDIO_SIGMA), extra={"frame_rate": FPS}, video_guides=guides)


def reference_of(path: str, config, call: dict, job) -> tuple[torch.Tensor, torch.Tensor]:
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    cut = config.caption_channels or config.cross_attention_dim
    context = torch.cat([job.positive.cond, job.negative.cond])
    x = dict(video=LTX2Adapter.pack(job.latent), audio=LTX2Adapter.pack_audio(job.audio),
             video_context=context[..., :cut], audio_context=context[..., cut:], video_t=job.timestep * 1000,
             audio_t=(job.audio_timestep * 1000)[:, None].expand(-1, AUDIO_FRAMES))
    v, a = comfyui_guided_call(path, config, call, x)
    return LTX2Adapter.unpack(v, *job.latent.shape[2:]), LTX2Adapter.unpack_audio(a, job.audio.shape[1])


@pytest.fixture(scope="module")
def ltx25(tmp_path_factory):
    from parallel_runtime.models.tiny import write_checkpoint

    folder = tmp_path_factory.mktemp("ltx25")
    return write_checkpoint(str(folder / "ltx2.5.safetensors"), LTX25, seed=3, prefix="model.diffusion_model.")


# -- the guides as the door reads them ---------------------------------------------------------------------------

def test_guides_of_call_reads_comfyuis_inputs():
    """The flf call keeps all 96 tokens, its guides at pixel frames 0 and 8 and weights 0.7 on all 48; the dilated
    reference keeps its 6 of 24 tokens with positions stretched by the factor and the mask's per-token weights; a
    guide at strength 1 without a mask needs no attention weights; damaged inputs get one sentence each."""
    flf = make_call("flf", LTX23)
    thw = tuple(flf["latent"].shape[2:])
    guides = guides_of_call(flf["keyframe_idxs"], flf["noise_mask"], flf["entries"], thw)
    assert guides.kept.tolist() == list(range(4 * H * W))
    assert guides.coords[0, :, 0].unique().tolist() == [0.0, 8.0]  # the two guides' first pixel frames
    assert torch.equal(guides.weights, torch.full((2 * H * W,), 0.7))

    ic = make_call("iclora", LTX23)
    thw = tuple(ic["latent"].shape[2:])
    guides = guides_of_call(ic["keyframe_idxs"], ic["noise_mask"], ic["entries"], thw)
    assert len(guides.kept) == 3 * H * W + 6 and guides.coords.shape == (3, 6, 2)
    assert torch.equal(guides.coords[1:, :, 1] - guides.coords[1:, :, 0], torch.full((2, 6), 64.0))  # 2 x 32 px wide
    want = F.interpolate(ic["entries"][0]["pixel_mask"][:, :, 0], size=(2, 3), mode="area").flatten()
    assert torch.allclose(guides.weights, want)

    plain = dict(ic, entries=[dict(ic["entries"][0], pixel_mask=None)])
    assert guides_of_call(plain["keyframe_idxs"], plain["noise_mask"], plain["entries"], thw).weights is None
    assert guides_of_call(None, ic["noise_mask"], None, thw) is None
    with pytest.raises(ConfigError, match=r"count 23 tokens for 24 guide tokens.*LTXVAddGuide\.$"):
        guides_of_call(ic["keyframe_idxs"], ic["noise_mask"], [dict(ic["entries"][0], pre_filter_count=23)], thw)
    with pytest.raises(ConfigError, match=r"not a whole number of 24-token latent frames.*LTXVCropGuides"):
        guides_of_call(ic["keyframe_idxs"][:, :, :5], ic["noise_mask"], None, thw)


def test_guide_bias_blocks_are_the_dense_mask_cut():
    """GuideBias cuts, for any rows and columns, the block of ComfyUI's mask (a weight of 0 included: the dtype's
    lowest finite value, as ComfyUI writes it)."""
    weights = torch.tensor([0.7, 0.0, 1.3, 1.0, 0.5])
    dense = comfy_guide_mask(12, 6, weights)  # 5 tracked guide tokens of 6, after 6 video tokens
    bias = GuideBias(torch.cat([weights, torch.ones(1)]), 12, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        rows, cols = torch.randperm(12, generator=g)[:7], torch.randperm(12, generator=g)[:5]
        assert torch.equal(bias.dense(rows, cols)[0, 0], dense[rows][:, cols])
    assert torch.equal(bias.dense(torch.arange(12))[0, 0], dense)
    # ... handed to the kernels as two row groups: the video's queries share one bias row (nothing queries x keys)
    groups = bias.block(torch.arange(12)).groups
    assert [(len(r), tuple(b.shape)) for r, b in groups] == [(6, (1, 1, 1, 12)), (6, (1, 1, 6, 12))]
    from parallel_runtime.strategies.attention.local import attention, attention_with_lse

    q, k, v = (torch.randn(2, 12, 3, 8, generator=g) for _ in range(3))
    rows = torch.randperm(12, generator=g)[:9]
    want = attention(q[:, rows], k, v, dense[rows][None, None])
    assert (attention(q[:, rows], k, v, bias.block(rows)) - want).abs().max() < 1e-6  # fp32 kernels: round-off
    out, lse = attention_with_lse(q[:, rows], k, v, bias=bias.block(rows))
    ref_out, ref_lse = attention_with_lse(q[:, rows], k, v, bias=dense[rows][None, None])
    assert (out - ref_out).abs().max() < 1e-6 and (lse - ref_lse).abs().max() < 1e-5


# -- the call on the workers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["flf", "iclora"])
@pytest.mark.parametrize("name", CONFIGS)
def test_guided_call_one_worker_equals_comfyuis(paths, client1, name, kind):
    """One worker on a call with guides equals ComfyUI's LTXAVModel on it; the same call with the guides' positions
    or attention left out does not (so both are read)."""
    from parallel_runtime.spec import StrategySpec

    config = CONFIGS[name]
    call = make_call(kind, config)
    job = guided_job(paths[name], config, call, StrategySpec())
    want_v, want_a = reference_of(paths[name], config, call, job)
    result = client1.run(job)
    assert result.latent.shape == job.latent.shape and want_v.abs().mean() > 0.1
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\n{name} {kind} call, 1 worker vs ComfyUI: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL, errors  # fp32, another op order: ~1e-6
    dropped = int(job.latent[0, 0].numel() - len(job.video_guides.kept))
    assert (result.latent.flatten(2).transpose(1, 2)[:, ~_kept_mask(job)] == 0).all() and dropped == (
        0 if kind == "flf" else 18)  # the reference's 18 padding tokens come back as zeros
    flat = dataclasses.replace(job.video_guides, coords=job.video_guides.coords.clone())
    flat.coords[0] = 0.0  # every guide at frame 0
    moved = client1.run(dataclasses.replace(job, video_guides=flat))
    assert rel_err(moved.latent, want_v) > 1e-3
    if kind == "flf":
        unweighted = client1.run(dataclasses.replace(job, video_guides=dataclasses.replace(job.video_guides,
                                                                                          weights=None)))
        assert rel_err(unweighted.latent, want_v) > 1e-3


def _kept_mask(job) -> torch.Tensor:
    mask = torch.zeros(math.prod(job.latent.shape[2:]), dtype=torch.bool)
    mask[job.video_guides.kept] = True
    return mask


@pytest.mark.parametrize("strategy", [dict(cfg_degree=2), dict(ulysses_degree=2), dict(ring_degree=2),
                                      dict(tensor_degree=2), dict(naive_patch_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "naive_patch2"])
@pytest.mark.parametrize("kind", ["flf", "iclora"])
def test_guided_call_exact_strategies_equal_comfyuis(paths, client2, strategy, kind):
    """Both streams split over two ranks with the guide mask cut per shard (Ulysses: the group's rows; Ring: each
    block's), the chunks over the CFG pair, or the heads over the tensor pair: equal to ComfyUI's call. Naive patch
    (each rank attends its own rows, the mask cut to them) is the approximate baseline: its error is printed."""
    from parallel_runtime.spec import StrategySpec

    name = "ltx2.3"
    config, call = CONFIGS[name], make_call(kind, CONFIGS[name])
    job = guided_job(paths[name], config, call, StrategySpec(**strategy))
    want_v, want_a = reference_of(paths[name], config, call, job)
    result = client2.run(job)
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\n{kind} {StrategySpec.label(StrategySpec(**strategy))}: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    if "naive_patch_degree" in strategy:
        assert errors[0] > 1e-3  # each half attends alone: not exact, and the test can tell
        return
    assert max(errors) < EXACT_RTOL, errors  # exact strategies reorder sums: fp32 round-off


@pytest.mark.parametrize("kind", ["flf", "iclora"])
def test_guided_call_pipefusion(paths, client2, kind):
    """PipeFusion-2 on the schedule's warm-up call (the whole call as one token set, the guide mask cut for its
    queries over the whole buffer) equals ComfyUI's call; the next call runs patch by patch on stale K/V, the guide
    mask cut per patch: approximate, its error printed beside naive patch's on the same call."""
    from parallel_runtime.spec import StrategySpec

    name = "ltx2.3"
    config, call = CONFIGS[name], make_call(kind, CONFIGS[name])
    job = guided_job(paths[name], config, call, StrategySpec(pipefusion_degree=2, warmup_steps=1))
    job = dataclasses.replace(job, call_step=0)
    want_v, want_a = reference_of(paths[name], config, call, job)
    result = client2.run(job)
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    assert max(errors) < EXACT_RTOL, errors
    nxt = dataclasses.replace(job, call_step=1, latent=job.latent * 0.9)
    want_next = reference_of(paths[name], config, call, nxt)[0]
    stale = rel_err(client2.run(nxt).latent, want_next)
    naive = rel_err(client2.run(dataclasses.replace(nxt, strategy=StrategySpec(naive_patch_degree=2))).latent,
                    want_next)
    print(f"\n{kind} PipeFusion-2 after warm-up {stale:.1e} vs naive patch {naive:.1e}")
    assert stale < naive  # stale K/V of the previous call beats attending one's own half alone


def test_damaged_guides_are_refused_in_one_sentence(paths):
    from parallel_runtime.spec import StrategySpec
    from parallel_runtime.validate import validate_job

    config, call = CONFIGS["ltx2.3"], make_call("flf", CONFIGS["ltx2.3"])
    job = guided_job(paths["ltx2.3"], config, call, StrategySpec())
    validate_job(job, 1)
    bad = [dataclasses.replace(job.video_guides, kept=job.video_guides.kept + 1),
           dataclasses.replace(job.video_guides, weights=torch.full((3,), 0.5)),
           dataclasses.replace(job.video_guides, coords=job.video_guides.coords.new_full((3, 48, 2), math.nan))]
    for guides in bad:
        with pytest.raises(ConfigError, match=r"guide frames do not fit its video latent.*LTXVAddGuide\.$"):
            validate_job(dataclasses.replace(job, video_guides=guides), 1)


# -- LTX-2.5's keyframe row ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [None, "flf"])
def test_ltx25_adds_the_keyframe_row_as_comfyui_does(ltx25, client1, client2, kind):
    """A file with LTX-2.5's keyframes_abs_pos_embedding: ComfyUI adds it on every call to the first latent frame's
    tokens, never a guide's. One worker and Ulysses-2 equal ComfyUI's call with and without guides; without the row
    the output moves (so the row is read)."""
    from parallel_runtime.spec import StrategySpec

    if kind is None:  # a plain call: no guides, the first frame an image-to-video conditioning frame
        call = dict(latent=torch.randn(1, LTX25.in_channels, 3, H, W, generator=torch.Generator().manual_seed(3)),
                    noise_mask=torch.ones(1, 1, 3, H, W), keyframe_idxs=torch.zeros(1, 3, 0, 2), entries=[])
        call["noise_mask"][:, :, 0] = 0.0
    else:
        call = make_call(kind, LTX25)
    for client, strategy in ((client1, StrategySpec()), (client2, StrategySpec(ulysses_degree=2))):
        job = guided_job(ltx25, LTX25, call, strategy)
        want_v, want_a = reference_of(ltx25, LTX25, call, job) if kind else _plain_reference(ltx25, job)
        result = client.run(job)
        errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
        print(f"\nLTX-2.5 {kind or 'plain'} {strategy.label()}: video {errors[0]:.1e}, audio {errors[1]:.1e}")
        assert max(errors) < EXACT_RTOL, errors
    if kind is None:
        without_row = _plain_reference(ltx25, job, marker=False)[0]
        assert rel_err(without_row, want_v) > 1e-3


def _plain_reference(path, job, marker: bool = True):
    """ComfyUI's call without guides (comfyui_call adds the keyframe row on a file that has it); `marker=False`:
    no token marked (every token counted as a guide's, which only the row reads)."""
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    cut = LTX25.cross_attention_dim
    context = torch.cat([job.positive.cond, job.negative.cond])
    thw = tuple(job.latent.shape[2:])
    x = dict(video=LTX2Adapter.pack(job.latent), audio=LTX2Adapter.pack_audio(job.audio),
             video_context=context[..., :cut], audio_context=context[..., cut:], video_t=job.timestep * 1000,
             audio_t=(job.audio_timestep * 1000)[:, None].expand(-1, AUDIO_FRAMES))
    coords = pixel_coords(*thw, causal_fix=True).expand(2, -1, -1, -1).clone()
    coords[:, 0] = coords[:, 0] * (1.0 / FPS)
    v, a = comfyui_call(path, "", x, fps=FPS, config=LTX25, coords=coords,
                        guide_tokens=0 if marker else math.prod(thw))
    return LTX2Adapter.unpack(v, *thw), LTX2Adapter.unpack_audio(a, job.audio.shape[1])


def test_guides_on_a_job_that_cannot_read_them_are_refused(paths):
    """Guides only ride in an LTX-2 model call: on the workers' own loop (no timestep) they are refused in one
    sentence naming the way that runs them."""
    from parallel_runtime.spec import StrategySpec
    from parallel_runtime.validate import validate_job

    config, call = CONFIGS["ltx2.3"], make_call("flf", CONFIGS["ltx2.3"])
    job = guided_job(paths["ltx2.3"], config, call, StrategySpec())
    with pytest.raises(ConfigError, match=r"^guide frames ride in a model call only, .* on Load Parallel DiT's "
                                          r"MODEL\.$"):
        validate_job(dataclasses.replace(job, timestep=None, audio_timestep=None), 1)


# -- LTXVReferenceAudio's reference audio (ID-LoRA) ----------------------------------------------------------------

REF_AUDIO_FRAMES = 5  # reference audio latent frames: 5 rows before the call's 13


def audio_seconds(start: int, end: int) -> torch.Tensor:
    """AudioPatchifier._get_audio_latent_time_in_sec of LTXAVModel's patchifier (16 kHz, hop 160, 4 mel frames per
    latent frame, causal)."""
    mel = (torch.arange(start, end, dtype=torch.float32) * 4 + 1 - 4).clip(min=0)
    return mel * 160 / 16000


def comfyui_reference_audio_call(path: str, config, job) -> tuple[torch.Tensor, torch.Tensor]:
    """LTXAVModel._process_input's ID-LoRA path: the reference tokens before the audio's, placed at negative times
    (the reference ends one latent frame before 0), at timestep 0 (_prepare_timestep), trimmed from the output."""
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    b, n = job.latent.shape[0], job.audio_reference.shape[1]
    cut = config.caption_channels or config.cross_attention_dim
    context = torch.cat([job.positive.cond, job.negative.cond])
    start, end = audio_seconds(0, n), audio_seconds(1, n + 1)
    offset = end[-1].item() + 160 * 4 / 16000
    ref_coords = torch.stack([start - offset, end - offset], dim=-1)[None, None].expand(b, -1, -1, -1)
    own = torch.stack([audio_seconds(0, AUDIO_FRAMES), audio_seconds(1, AUDIO_FRAMES + 1)], dim=-1)
    audio_coords = torch.cat([ref_coords, own[None, None].expand(b, -1, -1, -1)], dim=2)
    audio_t = (job.audio_timestep * 1000)[:, None].expand(-1, AUDIO_FRAMES)
    x = dict(video=LTX2Adapter.pack(job.latent), video_t=job.timestep * 1000,
             audio=torch.cat([job.audio_reference.expand(b, -1, -1), LTX2Adapter.pack_audio(job.audio)], dim=1),
             audio_t=torch.cat([audio_t.new_zeros(b, n), audio_t], dim=1),
             video_context=context[..., :cut], audio_context=context[..., cut:])
    thw = tuple(job.latent.shape[2:])
    coords = pixel_coords(*thw, causal_fix=True).expand(b, -1, -1, -1).clone()
    coords[:, 0] = coords[:, 0] * (1.0 / FPS)
    v, a = comfyui_call(path, "", x, fps=FPS, config=config, coords=coords, audio_coords=audio_coords)
    return LTX2Adapter.unpack(v, *thw), LTX2Adapter.unpack_audio(a[:, n:], job.audio.shape[1])


@pytest.mark.parametrize("strategy", [dict(), dict(cfg_degree=2), dict(ulysses_degree=2), dict(ring_degree=2),
                                      dict(tensor_degree=2), dict(pipefusion_degree=2, warmup_steps=1)],
                         ids=["serial", "cfg2", "ulysses2", "ring2", "tensor2", "pipefusion2_warmup"])
def test_reference_audio_equals_comfyuis(paths, client1, client2, strategy):
    """LTXVReferenceAudio's tokens (5 latent frames) before the call's 13 audio rows: every strategy equals ComfyUI's
    call (the audio shards now 18 rows); without the reference the output moves (so it is read)."""
    from parallel_runtime.spec import StrategySpec

    name = "ltx2.3"
    config = CONFIGS[name]
    call = dict(latent=torch.randn(1, config.in_channels, 3, H, W, generator=torch.Generator().manual_seed(3)),
                noise_mask=torch.ones(1, 1, 3, H, W), keyframe_idxs=None, entries=[])
    spec = StrategySpec(**strategy)
    job = guided_job(paths[name], config, call, spec)
    reference = torch.randn(1, REF_AUDIO_FRAMES, config.audio_in_channels, generator=torch.Generator().manual_seed(8))
    job = dataclasses.replace(job, audio_reference=reference, call_step=0)
    want_v, want_a = comfyui_reference_audio_call(paths[name], config, job)
    result = (client1 if spec.world_size == 1 else client2).run(job)
    assert result.audio.shape == job.audio.shape
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\nreference audio {spec.label()}: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL, errors
    if spec.world_size == 1:
        plain = client1.run(dataclasses.replace(job, audio_reference=None))
        assert rel_err(plain.audio, want_a) > 1e-3 and rel_err(plain.latent, want_v) > 1e-4


def test_pixel_masks_downsample_as_comfyui_does():
    """LTXVModel._downsample_mask_to_latent: area-averaged per frame; the first pixel frame makes the first latent
    frame, the rest are averaged in groups of (pixel frames - 1) // (latent frames - 1), or repeated (nearest) where
    fewer pixel frames than latent frames remain; one pixel frame fills every latent frame."""
    from parallel_runtime.models.families.ltx2_guides import downsample_mask

    g = torch.Generator().manual_seed(4)

    def area(frame):  # one pixel frame [H, W] -> [2, 3]
        return F.interpolate(frame[None, None], size=(2, 3), mode="area")[0, 0]

    mask = torch.rand(1, 1, 9, 64, 96, generator=g)  # 1 + 8 pixel frames onto 1 + 2 latent frames: groups of 4
    want = torch.stack([area(mask[0, 0, 0]), torch.stack([area(f) for f in mask[0, 0, 1:5]]).mean(0),
                        torch.stack([area(f) for f in mask[0, 0, 5:9]]).mean(0)])
    assert torch.allclose(downsample_mask(mask, 3, 2, 3), want.reshape(1, -1), atol=1e-6)
    short = mask[:, :, :2]  # 1 + 1 pixel frames onto 1 + 2 latent frames: the second repeated
    want = torch.stack([area(short[0, 0, 0]), area(short[0, 0, 1]), area(short[0, 0, 1])])
    assert torch.allclose(downsample_mask(short, 3, 2, 3), want.reshape(1, -1), atol=1e-6)
    single = mask[:, :, :1]  # one pixel frame: every latent frame is it
    assert torch.allclose(downsample_mask(single, 2, 2, 3), area(single[0, 0, 0]).repeat(2, 1, 1).reshape(1, -1))
