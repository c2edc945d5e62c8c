"""MiniMax-H3 through the stock MODEL door: Load Parallel DiT's MODEL called as ComfyUI 2026 calls MiniMaxH3Model.

The fake host is tests/test_model_path_2026.py's (ComfyUI 2026's detection, patcher and wrappers), with the
MiniMaxH3 class added as comfy/supported_models.py and comfy/model_base.py define it: ModelSamplingDiscreteFlow
(shift 12, multiplier 1000), 24 latent channels, and MiniMaxH3.extra_conds (the prompt through the diffusion model's
preprocess_text_embeds, minimax_payload with the tags, keyframes, seed and audio_scale). The call is
BaseModel._apply_model's: x the unpacked [video, audio] streams (flow: calculate_input is x), t = sigma x 1000. The
reference is diffusers' MiniMaxH3Transformer3DModel on the same file (test_minimax_h3.diffusers_model_call), in
ComfyUI's output convention (negated), so the door shares nothing with the reference but the file. fl2va and ref2va
calls (keyframes, reference images, image-token prompt rows) are compared with the family's serial forward on the
packed sequence (itself tested against diffusers in test_minimax_h3), the conditioning rows noise-augmented by this
module's copy of ComfyUI's _cond_video_rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families import minimax_h3 as h3
from test_minimax_h3 import H, LONG_AUDIO_T, T, TEXT_LEN, TINY, W, call_job, diffusers_model_call, h3_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

SIGMA = 0.7
# One fp32 forward in another op order than diffusers' (~1e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5


def h3_conds(base, cross_attn, minimax_token_tags=None, minimax_keyframes=None, minimax_refs=None, seed=0,
             audio_scale=1.0, **_):
    """model_base.MiniMaxH3.extra_conds (ComfyUI 0.34.2 on: the references' latents appended to the keyframes') as
    far as a call reaches it (the payload's audio_scale is the model sampling's, here given directly:
    ModelSamplingAV's value where the sampler carries the packed latent; seed is the sampler's)."""
    payload = {"seed": seed, "audio_scale": audio_scale}
    if minimax_token_tags is not None:
        payload["text_token_tags"] = minimax_token_tags
    if minimax_keyframes is not None:
        payload["keyframes"] = minimax_keyframes
        payload["cond_video_latents"] = [kf["latent"] for kf in minimax_keyframes if kf.get("latent") is not None]
        payload["cond_audio_latents"] = [kf["audio_latent"] for kf in minimax_keyframes
                                         if kf.get("audio_latent") is not None]
    if minimax_refs is not None:
        payload["refs"] = minimax_refs
        payload["cond_video_latents"] = payload.get("cond_video_latents", []) + [
            r["latent"] for r in minimax_refs if "latent" in r]
        payload["cond_audio_latents"] = payload.get("cond_audio_latents", []) + [
            r["audio_latent"] for r in minimax_refs if r.get("audio_latent") is not None]
    return {"c_crossattn": base.diffusion_model.preprocess_text_embeds(cross_attn), "minimax_payload": payload}


@pytest.fixture
def h3_host(comfy, monkeypatch):
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (
        host.Supported("MiniMaxH3", {"image_model": "minimax_h3"}, "discrete_flow", 12.0, 1000.0, 24, h3_conds),))
    return comfy


comfy = host.comfy  # the fake ComfyUI modules


def h3_call(patcher, job, extra=None, options=None, chunks=(0, 1)):
    """BaseModel._apply_model's call of MiniMaxH3Model for the job's `chunks` (0 cond, 1 uncond): [cond; uncond]
    batched is what a sampler makes where the payloads agree; ComfyUI's own model runs one row per call, as
    `chunks=(k,)` makes it."""
    base = patcher.model
    branches = [(job.positive, job.negative)[k] for k in chunks]
    conds = [base.extra_conds(cross_attn=branch.cond, **(extra or {})) for branch in branches]
    context = torch.cat([c["c_crossattn"] for c in conds])
    sigmas = torch.full((len(chunks),), SIGMA)
    rows = list(chunks)
    x = [job.latent[rows].clone(), job.audio[rows].clone()]
    t = base.model_sampling.timestep(sigmas).float()
    transformer_options = {"cond_or_uncond": rows, "sigmas": sigmas, **(options or {})}
    return base.diffusion_model(x, t, context=context, control=None, transformer_options=transformer_options,
                                minimax_payload=conds[0]["minimax_payload"])


def _door(path, devices, clients, monkeypatch, **degrees):
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    return host._model(path, devices, **degrees)


def test_load_parallel_dit_takes_the_file_as_comfyuis_minimax_h3(h3_path, h3_host):
    """The loader's refusal is lifted: ComfyUI's detection picks MiniMaxH3 (shift 12, 24 channels) for the file."""
    from nodes.remote_model import RemoteDiT

    model = host._model(h3_path)
    assert model.model.model_config.supported.name == "MiniMaxH3"
    assert isinstance(model.model.diffusion_model, RemoteDiT)
    assert model.model.latent_format.latent_channels == 24


def test_model_call_equals_diffusers_and_cfg2_ulysses2_equal_it(h3_path, h3_host, client1, client2, monkeypatch):
    """The door's [video, audio] output at 1 worker equals diffusers' model (and the runtime job built by hand);
    CFG-2 (cond and uncond on two ranks) and Ulysses-2 (audio and video rows split together) equal it."""
    from parallel_runtime.spec import StrategySpec

    clients = {"cpu:1": client1, "cpu:2": client2}
    job = call_job(h3_path, StrategySpec())
    video, audio = diffusers_model_call(h3_path, job)
    direct = client1.run(job)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        out = h3_call(_door(h3_path, devices, clients, monkeypatch, **degrees), job)
        assert isinstance(out, list) and out[0].shape == job.latent.shape and out[1].shape == job.audio.shape
        errors[label] = rel_err(out[0], video), rel_err(out[1], audio)
        if label == "1 worker":  # the same worker and job as the hand-built one: nothing rounds between them
            assert torch.equal(out[0], direct.latent) and torch.equal(out[1], direct.audio)
    print("\n" + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}" for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL


def test_one_prompt_per_call_as_comfyui_runs_h3_equals_diffusers_at_ulysses2(h3_path, h3_host, client2,
                                                                            monkeypatch):
    """ComfyUI's MiniMaxH3Model takes one row per call: cond and uncond as two calls, each split by Ulysses-2."""
    from parallel_runtime.spec import StrategySpec

    job = call_job(h3_path, StrategySpec())
    video, audio = diffusers_model_call(h3_path, job)
    model = _door(h3_path, "cpu:2", {"cpu:2": client2}, monkeypatch, ulysses_degree=2)
    for k in (0, 1):
        out = h3_call(model, job, chunks=(k,))
        errors = rel_err(out[0], video[k:k + 1]), rel_err(out[1], audio[k:k + 1])
        print(f"\nchunk {k} alone, ulysses2: video {errors[0]:.1e} audio {errors[1]:.1e}")
        assert max(errors) < RTOL


def test_the_carried_audio_is_undone_as_comfyuis_forward_does(h3_path, h3_host, client1, monkeypatch):
    """audio_scale != 1 (ModelSamplingAV carries the audio at sigma_a / sigma_v): the door hands the workers the
    stream's own latent and returns the carried variable's velocity, ComfyUI's formula on diffusers' output; a
    DIFFUSION_MODEL wrapper sees the stream's own latent, as ComfyUI undoes the carry outside the wrappers."""
    from parallel_runtime.spec import StrategySpec

    seen = []

    def probe(executor, *args, **kwargs):
        seen.append(args[0][1])
        return executor(*args, **kwargs)

    job = call_job(h3_path, StrategySpec())
    sigma_a = float(h3.time_shift(torch.tensor(SIGMA), 12.0, 3.0))
    carry, scale = sigma_a / SIGMA, 0.5
    carried = job.latent, job.audio / carry  # what the sampler holds: the stream's latent over the carry
    video, audio = diffusers_model_call(h3_path, job)
    expected = (1 - scale) * job.audio + (1 + (scale - 1) * sigma_a) * audio
    out = h3_call(_door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch),
                  dataclasses.replace(job, latent=carried[0], audio=carried[1]), {"audio_scale": scale},
                  {"wrappers": {"diffusion_model": {"probe": [probe]}}})
    assert len(seen) == 1 and rel_err(seen[0], job.audio) < 1e-6  # x / carry * carry: two float32 roundings
    errors = rel_err(out[0], video), rel_err(out[1], expected)
    print(f"\naudio_scale {scale}: video {errors[0]:.1e} audio {errors[1]:.1e}")
    assert max(errors) < RTOL


# -- fl2va and ref2va: keyframes, reference images and image-token prompt rows ----------------------------------

FRAMES = sum(h3.FRAME_SPANS[k % 5] for k in range(T))  # pixel frames of the T latent frames (MiniMaxH3AddGuide's)
SEED = 11  # the sampler's seed, which ComfyUI's model draws the conditioning rows' noise augmentation from
TAGS = torch.tensor([1, 1, 0, 0, 1, 1, 1])  # two vision-token rows of a frame in the prompt, tagged video


def conditioning(kind: str) -> dict:
    """extra_conds inputs of MiniMaxH3ImageToVideo with first and last frame (fl2va) or of MiniMaxH3ReferenceToVideo
    with two reference images of other sizes than the video (ref2va), each with a mixed-tag prompt."""
    g = torch.Generator().manual_seed(5)
    if kind == "fl2va":
        keyframes = [{"resolved_frame_index": frame, "latent": torch.randn(1, 24, 1, H, W, generator=g)}
                     for frame in (0, FRAMES - 1)]
        return {"minimax_keyframes": keyframes, "minimax_token_tags": TAGS, "seed": SEED}
    refs = [{"kind": "image", "latent_h": h, "latent_w": w, "latent": torch.randn(1, 24, 1, h, w, generator=g)}
            for h, w in ((4, 4), (2, 6))]
    return {"minimax_refs": refs, "minimax_token_tags": TAGS, "seed": SEED}


def comfy_augmented(latent: torch.Tensor, seed: int, aug: float = 0.999) -> torch.Tensor:
    """MiniMaxH3Model._cond_video_rows (comfy/ldm/minimax/model.py) on one latent, in the latent's shape: its
    1x2x2 patch rows (einsum nctrhpwq->nthwcrpq) mixed with noise of their shape from a CPU generator seeded anew."""
    b, c, t, h, w = latent.shape
    rows = torch.einsum("nctrhpwq->nthwcrpq", latent.reshape(b, c, t, 1, h // 2, 2, w // 2, 2)).reshape(-1, c * 4)
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    rows = aug * rows + (1.0 - aug) * noise
    x = torch.einsum("nthwcrpq->nctrhpwq", rows.reshape(1, t, h // 2, w // 2, c, 1, 2, 2))
    return x.reshape(1, c, t, h, w)


@torch.no_grad()
def serial_reference(path: str, job, extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's serial forward (tested against diffusers on keyframes and mixed tags in test_minimax_h3) on
    the packed sequence of the call's conditioning, the rows noise-augmented as ComfyUI's model does; per chunk, in
    ComfyUI's convention (negated) and the call's shapes."""
    from test_minimax_h3 import build_adapter

    keyframes = tuple(h3.Keyframe(comfy_augmented(kf["latent"], SEED), kf["resolved_frame_index"])
                      for kf in extra.get("minimax_keyframes", ()))
    refs = tuple(h3.ReferenceImage(comfy_augmented(r["latent"], SEED)) for r in extra.get("minimax_refs", ()))
    seq = h3.pack_sequence(TEXT_LEN, (T, H, W), job.audio.shape[-1], keyframes, refs, extra["minimax_token_tags"])
    adapter = build_adapter(path)
    videos, audios = [], []
    for k, branch in enumerate((job.positive, job.negative)):
        out = h3.comfy_output(adapter.forward_rows(seq, torch.arange(seq.seq_len), branch.cond, job.latent[k:k + 1],
                                                   job.audio[k:k + 1], h3.call_timesteps(SIGMA)))
        videos.append(h3.unpatchify_video(out["video"], T, H // 2, W // 2))
        audios.append(h3.unpack_audio(out["audio"]))
    return torch.cat(videos), torch.cat(audios)


@pytest.mark.parametrize("kind", ["fl2va", "ref2va"])
def test_fl2va_and_ref2va_calls_equal_the_serial_model_at_1_worker_cfg2_and_ulysses2(h3_path, h3_host, client1,
                                                                                    client2, monkeypatch, kind):
    """The door carries the keyframes (first and last frame at their frames) or the reference images (their own
    sizes, ahead of the targets), noise-augmented from the sampler's seed as ComfyUI's model augments them, and the
    prompt's image-token rows: 1 worker equals the family's serial model on that packed sequence, and CFG-2 and
    Ulysses-2 (the conditioning rows split with the audio and video rows) equal it."""
    from parallel_runtime.spec import StrategySpec

    clients = {"cpu:1": client1, "cpu:2": client2}
    job = call_job(h3_path, StrategySpec())
    extra = conditioning(kind)
    video, audio = serial_reference(h3_path, job, extra)
    plain = serial_reference(h3_path, job, {"minimax_token_tags": None})
    assert min(rel_err(video, plain[0]), rel_err(audio, plain[1])) > 1e-3  # the conditioning rows matter
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        out = h3_call(_door(h3_path, devices, clients, monkeypatch, **degrees), job, extra)
        errors[label] = rel_err(out[0], video), rel_err(out[1], audio)
    print(f"\n{kind}: " + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}" for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL


GUIDE_AUDIO = {"resolved_frame_index": 0, "audio_latent": torch.zeros(1, 32, 2, 4)}
REF_VIDEO = {"kind": "video", "latent_t": 2, "latent_h": 4, "latent_w": 6, "ref_audio_t": 0,
             "latent": torch.zeros(1, 24, 2, 4, 6), "audio_latent": None}


@pytest.mark.parametrize("extra, options, pattern", [
    ({"minimax_keyframes": [GUIDE_AUDIO]}, None,
     r"the MiniMax-H3 call carries conditioning ParaDiT does not run yet \(the audio of MiniMaxH3AddGuide's guide\); "
     r"anchor images only \(MiniMaxH3AddGuide without audio, reference images\) or load the model with "
     r"UNETLoader\."),
    ({"minimax_refs": [REF_VIDEO]}, None,
     r"the MiniMax-H3 call carries conditioning ParaDiT does not run yet \(MiniMaxH3ReferenceToVideo's reference "
     r"videos\); .*"),
    ({"minimax_token_tags": torch.tensor([1, 0, 0, 1, 1])}, None,
     r"the MiniMax-H3 prompt has 7 rows but 5 modality tags; encode the prompt and its images with one "
     r"CLIPTextEncode / MiniMaxH3ImageToVideo node\."),
    ({}, {"minimax_h3_sigma_shift_video": 8.0},
     r"the MiniMax-H3 call sets sigma shifts \(8\.0, 3\.0\) \(video, audio\) but ParaDiT runs the model's own "
     r"\(12\.0, 3\.0\); set MiniMaxH3SigmaShift \(ModelSamplingMiniMaxH3\) to 12 and 3, or load the model with "
     r"UNETLoader\."),
], ids=["guide_audio", "ref_video", "tags_length", "shifts"])
def test_what_the_door_cannot_carry_is_refused_in_one_sentence(h3_path, h3_host, client1, monkeypatch, extra,
                                                               options, pattern):
    from parallel_runtime.spec import StrategySpec

    model = _door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    with pytest.raises(ConfigError, match=f"^{pattern}$") as refusal:
        h3_call(model, call_job(h3_path, StrategySpec()), extra, options)
    assert ". " not in str(refusal.value).rstrip(".")


def test_keyframes_overwritten_by_an_old_core_and_another_noise_augmentation_are_refused(h3_path, h3_host, client1,
                                                                                        monkeypatch):
    """A core before 0.34.2 kept only the references' latents where the layout also has keyframes; a payload with
    another visual_cond_noise_aug (no stock node sets one) changes the conditioning rows' timestep."""
    from parallel_runtime.spec import StrategySpec

    model = _door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    job = call_job(h3_path, StrategySpec())
    payload = h3_conds(model.model, job.positive.cond, **conditioning("fl2va"))["minimax_payload"]
    base = model.model.diffusion_model
    call = dict(context=torch.cat([job.positive.cond, job.negative.cond]), control=None,
                transformer_options={"cond_or_uncond": [0, 1]})
    with pytest.raises(ConfigError, match=r"^the MiniMax-H3 call's conditioning latents do not fit its keyframes and "
                                          r"references \(1 conditioning latents for 2 keyframe\(s\) and 0 "
                                          r"reference\(s\)\); update ComfyUI to 0\.34\.2 or later, whose MiniMaxH3 "
                                          r"keeps the keyframes' latents beside the references'\.$"):
        base([job.latent, job.audio], torch.full((2,), 700.0), **call,
             minimax_payload={**payload, "cond_video_latents": payload["cond_video_latents"][1:]})
    with pytest.raises(ConfigError, match=r"^the MiniMax-H3 call sets the conditioning frames' noise augmentation to "
                                          r"0\.9, but ParaDiT runs ComfyUI's own 0\.999; remove the node that sets "
                                          r"visual_cond_noise_aug or load the model with UNETLoader\.$"):
        base([job.latent, job.audio], torch.full((2,), 700.0), **call,
             minimax_payload={**payload, "visual_cond_noise_aug": 0.9})


def test_text_tags_and_a_denoise_mask(h3_path, h3_host, client1, monkeypatch):
    """All-text prompt tags (the CLIP's output for a text-only prompt) are read as the family's default; a denoise
    mask is refused in one sentence."""
    from parallel_runtime.spec import StrategySpec

    model = _door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    job = call_job(h3_path, StrategySpec())
    plain = h3_call(model, job)
    tagged = h3_call(model, job, {"minimax_token_tags": torch.ones(TEXT_LEN, dtype=torch.long)})
    assert torch.equal(plain[0], tagged[0]) and torch.equal(plain[1], tagged[1])
    base = model.model
    with pytest.raises(ConfigError, match=r"^the MiniMax-H3 call carries a denoise mask \(SetLatentNoiseMask or an "
                                          r"inpainting latent\), which ParaDiT does not run for this model yet; remove "
                                          r"that node or load the model with UNETLoader\.$"):
        base.diffusion_model([job.latent, job.audio], torch.full((2,), 700.0), context=torch.cat(
            [job.positive.cond, job.negative.cond]), control=None, transformer_options={"cond_or_uncond": [0, 1]},
            minimax_payload={}, denoise_mask=torch.ones(1, 1, 3, 4, 6) * 0.5)


def test_another_familys_streams_are_refused_in_one_sentence(h3_path, h3_host, client1, monkeypatch):
    """A [video, audio] call reaches the H3 conversion only for an H3 file (LTX-2's go to their own, other families
    have no second stream)."""
    import types

    from parallel_runtime.spec import StrategySpec

    model = _door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    monkeypatch.setattr("parallel_runtime.validate.model_config",
                        lambda path: types.SimpleNamespace(family="wan", title="Wan 2.2"))
    with pytest.raises(ConfigError, match=r"^the model call carries several latent streams, which Load Parallel DiT's "
                                          r"MODEL runs for MiniMax-H3 and LTX-2 only, not for Wan 2\.2; load the model "
                                          r"with UNETLoader\.$"):
        h3_call(model, call_job(h3_path, StrategySpec()))


def test_reference_latents_out_of_their_layout_are_refused_in_one_sentence():
    """A ReferenceLatent node's latents (no MiniMax-H3 layout) and conditioning latents that do not fit their layout
    (a keyframe of another length than its layout says) each get one sentence before any work."""
    from parallel_runtime.spec import Conditioning
    from parallel_runtime.validate import validate_references

    prompt = torch.zeros(1, TEXT_LEN, TINY.text_dim), torch.zeros(1, 0)
    with pytest.raises(ConfigError, match=r"^the positive conditioning carries reference latents \(ReferenceLatent\), "
                                          r"which MiniMax-H3 does not read; remove the ReferenceLatent node and give "
                                          r"reference images through MiniMaxH3ReferenceToVideo\.$"):
        validate_references("positive", Conditioning(*prompt, references=(torch.zeros(1, 24, H, W),)), TINY)
    layout = h3.CallLayout(keyframes=((0, 1),)).method
    with pytest.raises(ConfigError, match=r"^the negative conditioning's MiniMax-H3 conditioning rows do not fit their "
                                          r"layout \(a keyframe latent of shape \(1, 24, 2, 4, 6\), not \[1, C, 1, H, "
                                          r"W\] of the video\); this is a ParaDiT bug, please report it\.$"):
        validate_references("negative", Conditioning(*prompt, references=(torch.zeros(1, 24, 2, H, W),),
                                                     reference_method=layout), TINY)
    validate_references("positive", Conditioning(*prompt, references=(torch.zeros(1, 24, 1, H, W),),
                                                 reference_method=layout), TINY)  # fits: no refusal
