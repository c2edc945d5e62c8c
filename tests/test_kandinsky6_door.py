"""Kandinsky 6 through the stock MODEL door: Load Parallel DiT's MODEL called as ComfyUI 2026 calls
Kandinsky6NativeAVDiT.

The fake host is tests/test_model_path_2026.py's, with ComfyUI 2026's Kandinsky 6 added as its source defines it:
comfy/ldm/kandinsky6/detection.py's branch (ComfyUI's names: visual_blocks.N.videoT...), supported_models'
Kandinsky6 (ModelSamplingDiscreteFlow, shift 5, multiplier 1000; the HunyuanVideo latent's 16 channels) and
model_base's extra_conds (the prompt rows as c_crossattn, the pooled CLIP-L vector as y, the reference-tail flag
where Kandinsky6ImageToVideoAudio sets it). The call is BaseModel._apply_model's: x the unpacked [video, audio]
streams (flow: calculate_input is x), t = sigma x 1000. The reference is the model call written from ComfyUI's
source in test_kandinsky6 (comfyui_call) on the same file: it shares nothing with the door but the file.
"""
from __future__ import annotations

import pytest
import torch

import test_model_path_2026 as host
from test_model_path_2026 import comfy  # noqa: F401 - fixture: the fake ComfyUI 2026 host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from test_kandinsky6 import SIGMA, call_inputs, call_job, comfyui_call, k6_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # fp32, another op order than ComfyUI's (float64 RoPE frequencies): ~3e-7 measured


def k6_conds(base, cross_attn, pooled_output=None, k6_reference_tail=None, **_):
    out = {"c_crossattn": cross_attn, "y": pooled_output}
    if k6_reference_tail is not None:
        out["k6_reference_tail"] = bool(k6_reference_tail)
    return out


@pytest.fixture
def k6_host(comfy, monkeypatch):
    branch = host.Branch("kandinsky6", ("audio_embeddings.in_layer.weight", "visual_blocks.0.va_modulation."),
                         shapes={"model_dim": ("visual_embeddings.in_layer.weight", 0),
                                 "model_dim_a": ("audio_embeddings.in_layer.weight", 0)})
    monkeypatch.setattr(host, "BRANCHES", (branch,) + host.BRANCHES)
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (
        host.Supported("Kandinsky6", {"image_model": "kandinsky6"}, "discrete_flow", 5.0, 1000.0, 16, k6_conds),))
    return comfy


def k6_call(patcher, job, extra=None, options=None):
    """BaseModel._apply_model's call of Kandinsky6NativeAVDiT for [cond; uncond] batched."""
    base = patcher.model
    conds = [base.extra_conds(cross_attn=b.cond, pooled_output=b.pooled, **(extra or {}))
             for b in (job.positive, job.negative)]
    sigmas = torch.full((2,), SIGMA)
    rest = {k: v for k, v in conds[0].items() if k not in ("c_crossattn", "y")}
    return base.diffusion_model([job.latent.clone(), job.audio.clone()], base.model_sampling.timestep(sigmas).float(),
                                context=torch.cat([c["c_crossattn"] for c in conds]),
                                y=torch.cat([c["y"] for c in conds]), control=None,
                                transformer_options={"cond_or_uncond": [0, 1], "sigmas": sigmas, **(options or {})},
                                **rest)


def _door(path, devices, clients, monkeypatch, **degrees):
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    return host._model(path, devices, **degrees)


def test_model_call_equals_comfyuis_at_one_worker_and_ulysses2(k6_path, k6_host, client1, client2, monkeypatch):
    """The door's [video, audio] output equals ComfyUI's model call at 1 worker and with both streams split by
    Ulysses-2, and the runtime job built by hand bit for bit at 1 worker."""
    from nodes.remote_model import RemoteDiT
    from parallel_runtime.spec import StrategySpec

    clients = {"cpu:1": client1, "cpu:2": client2}
    job = call_job(k6_path, StrategySpec())
    video, audio = comfyui_call(k6_path, *call_inputs(job))
    direct = client1.run(job)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        model = _door(k6_path, devices, clients, monkeypatch, **degrees)
        assert model.model.model_config.supported.name == "Kandinsky6"
        assert isinstance(model.model.diffusion_model, RemoteDiT)
        out = k6_call(model, job)
        assert isinstance(out, list) and out[0].shape == job.latent.shape and out[1].shape == job.audio.shape
        errors[label] = rel_err(out[0], video), rel_err(out[1], audio)
        if label == "1 worker":
            assert torch.equal(out[0], direct.latent) and torch.equal(out[1], direct.audio)
    print("\n" + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}" for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL


def test_what_the_door_cannot_carry_is_refused_in_one_sentence(k6_path, k6_host, client1, monkeypatch):
    from parallel_runtime.spec import StrategySpec

    job = call_job(k6_path, StrategySpec())
    model = _door(k6_path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    for extra, options, pattern in (({"k6_reference_tail": True}, None, r"Kandinsky6ImageToVideoAudio's reference"),
                                    (None, {"k6_magcache": object()}, r"MagCache")):
        with pytest.raises(ConfigError, match=pattern) as refused:
            k6_call(model, job, extra, options)
        assert str(refused.value).count(". ") == 0  # one sentence
