"""MiniMax-H3 through the stock MODEL door: Load Parallel DiT's MODEL called as ComfyUI 2026 calls MiniMaxH3Model.

The fake host is tests/test_model_path_2026.py's (ComfyUI 2026's detection, patcher and wrappers), with the
MiniMaxH3 class added as comfy/supported_models.py and comfy/model_base.py define it: ModelSamplingDiscreteFlow
(shift 12, multiplier 1000), 24 latent channels, and MiniMaxH3.extra_conds (the prompt through the diffusion model's
preprocess_text_embeds, minimax_payload with the tags, keyframes, seed and audio_scale). The call is
BaseModel._apply_model's: x the unpacked [video, audio] streams (flow: calculate_input is x), t = sigma x 1000. The
reference is diffusers' MiniMaxH3Transformer3DModel on the same file (test_minimax_h3.diffusers_model_call), in
ComfyUI's output convention (negated), so the door shares nothing with the reference but the file.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families import minimax_h3 as h3
from test_minimax_h3 import LONG_AUDIO_T, TEXT_LEN, TINY, call_job, diffusers_model_call, h3_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

SIGMA = 0.7
# One fp32 forward in another op order than diffusers' (~1e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5


def h3_conds(base, cross_attn, minimax_token_tags=None, minimax_keyframes=None, minimax_refs=None, seed=0,
             audio_scale=1.0, **_):
    """model_base.MiniMaxH3.extra_conds as far as a t2va call reaches it (the payload's audio_scale is the model
    sampling's, here given directly: ModelSamplingAV's value where the sampler carries the packed latent)."""
    payload = {"seed": seed, "audio_scale": audio_scale}
    if minimax_token_tags is not None:
        payload["text_token_tags"] = minimax_token_tags
    if minimax_keyframes is not None:
        payload["keyframes"] = minimax_keyframes
        payload["cond_video_latents"] = [kf["latent"] for kf in minimax_keyframes if kf.get("latent") is not None]
    if minimax_refs is not None:
        payload["refs"] = minimax_refs
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


@pytest.mark.parametrize("extra, options, pattern", [
    ({"minimax_keyframes": [{"resolved_frame_index": 0, "latent": torch.zeros(1, 24, 1, 4, 6)}]}, None,
     r"the MiniMax-H3 call carries conditioning ParaDiT does not run yet \(keyframes: first/last frames of "
     r"MiniMaxH3ImageToVideo or MiniMaxH3AddGuide's guides, cond_video_latents: MiniMaxH3ImageToVideo's, "
     r"MiniMaxH3AddGuide's or MiniMaxH3ReferenceToVideo's latents\); sample text-to-video-and-audio "
     r"\(EmptyMiniMaxH3LatentAV\) or load the model with UNETLoader\."),
    ({"minimax_refs": [{"kind": "image"}]}, None,
     r"the MiniMax-H3 call carries conditioning ParaDiT does not run yet \(refs: MiniMaxH3ReferenceToVideo's "
     r"reference blocks\); .*"),
    ({"minimax_token_tags": torch.tensor([1, 0, 0, 1, 1, 1, 1])}, None,
     r"the MiniMax-H3 prompt holds image tokens \(MiniMaxH3ImageToVideo's first/last frame in the prompt\), which "
     r"ParaDiT does not run yet; encode a text-only prompt or load the model with UNETLoader\."),
    ({}, {"minimax_h3_sigma_shift_video": 8.0},
     r"the MiniMax-H3 call sets sigma shifts \(8\.0, 3\.0\) \(video, audio\) but ParaDiT runs the model's own "
     r"\(12\.0, 3\.0\); set MiniMaxH3SigmaShift \(ModelSamplingMiniMaxH3\) to 12 and 3, or load the model with "
     r"UNETLoader\."),
], ids=["keyframes", "refs", "image_tags", "shifts"])
def test_what_the_door_cannot_carry_is_refused_in_one_sentence(h3_path, h3_host, client1, monkeypatch, extra,
                                                               options, pattern):
    from parallel_runtime.spec import StrategySpec

    model = _door(h3_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    with pytest.raises(ConfigError, match=f"^{pattern}$") as refusal:
        h3_call(model, call_job(h3_path, StrategySpec()), extra, options)
    assert ". " not in str(refusal.value).rstrip(".")


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
