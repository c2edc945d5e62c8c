"""Kandinsky 5 through the stock MODEL door: Load Parallel DiT's MODEL called as ComfyUI 2026 calls Kandinsky5.

The fake host is tests/test_model_path_2026.py's, with ComfyUI 2026's Kandinsky 5 added: its detection branch (the
cross-attention key norm of the first visual block), a supported_models class on the discrete flow (timestep =
sigma x 1000) and extra_conds giving the prompt rows as c_crossattn, the pooled CLIP-L vector as y, and for a video
file a c_concat of condition channels and mask, which BaseModel._apply_model concatenates to the latent. The call is
BaseModel._apply_model's: x = [latent, c_concat], t = sigma x 1000. The reference is the model call written from
ComfyUI's source in test_kandinsky5 (comfyui_call) on the same file and the same x: it shares nothing with the door
but the file.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_path_2026 as host
from test_model_path_2026 import comfy  # noqa: F401 - fixture: the fake ComfyUI 2026 host
from conftest import rel_err
from parallel_runtime.spec import StrategySpec as S
from test_kandinsky5 import SIGMA, TINY, call_job, comfyui_call, k5_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # fp32, another op order than ComfyUI's (float64 RoPE frequencies): ~3e-7 measured


def k5_conds(base, cross_attn, pooled_output=None, concat=None, **_):
    return {"c_crossattn": cross_attn, "y": pooled_output, "c_concat": concat}


@pytest.fixture
def k5_host(comfy, monkeypatch):
    branch = host.Branch("kandinsky5", ("visual_transformer_blocks.0.cross_attention.key_norm.weight",),
                         shapes={"model_dim": ("visual_embeddings.in_layer.bias", 0)})
    monkeypatch.setattr(host, "BRANCHES", (branch,) + host.BRANCHES)
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (host.Supported(
        "Kandinsky5", {"image_model": "kandinsky5"}, "discrete_flow", 5.0, 1000.0, TINY.latent_dim, k5_conds),))
    return comfy


def k5_call(patcher, job, concat, start=None):
    """BaseModel._apply_model's calls of Kandinsky5, c_concat joined to the latent: cond then uncond, one call each
    (their prompts are 5 and 7 rows long, which ComfyUI does not batch)."""
    base, outs = patcher.model, []
    for k, chunk in enumerate((job.positive, job.negative)):
        c = base.extra_conds(cross_attn=chunk.cond, pooled_output=chunk.pooled, concat=concat[k:k + 1])
        sigmas = torch.full((1,), SIGMA)
        outs.append(base.diffusion_model(torch.cat([job.latent[k:k + 1], c["c_concat"]], dim=1),
                                         base.model_sampling.timestep(sigmas).float(), context=c["c_crossattn"],
                                         y=c["y"], control=None,
                                         transformer_options={"cond_or_uncond": [k], "sigmas": sigmas},
                                         **({} if start is None else {"time_dim_replace": start})))
    return torch.cat(outs)


def test_model_call_equals_comfyuis_at_one_worker_and_ulysses2(k5_path, k5_host, client1, client2, monkeypatch):
    from nodes.remote_model import RemoteDiT

    clients = {"cpu:1": client1, "cpu:2": client2}
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    job = call_job(k5_path, S())
    concat = torch.randn(2, TINY.latent_dim + 1, *job.latent.shape[2:], generator=torch.Generator().manual_seed(9))
    want = comfyui_call(k5_path, TINY, job, concat)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        model = host._model(k5_path, devices, **degrees)
        assert model.model.model_config.supported.name == "Kandinsky5"
        assert isinstance(model.model.diffusion_model, RemoteDiT)
        out = k5_call(model, job, concat)
        assert out.shape == job.latent.shape
        errors[label] = rel_err(out, want)
    print("\n" + ", ".join(f"{k}: {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < RTOL



def test_the_start_image_is_written_over_the_start_frames_as_comfyui_does(k5_path, k5_host, client1, client2,
                                                                           monkeypatch):
    """Kandinsky5ImageToVideo's start_image arrives as the call's time_dim_replace, which ComfyUI's Kandinsky5
    writes over the latent's first frame(s) before the model: the door does the same (1 worker, Ulysses-2); a start
    latent of another size is refused in one sentence."""
    from parallel_runtime.errors import ConfigError

    clients = {"cpu:1": client1, "cpu:2": client2}
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    job = call_job(k5_path, S())
    g = torch.Generator().manual_seed(10)
    concat = torch.randn(2, TINY.latent_dim + 1, *job.latent.shape[2:], generator=g)
    start = torch.randn(1, TINY.latent_dim, 1, *job.latent.shape[3:], generator=g)
    replaced = job.latent.clone()
    replaced[:, :, :1] = start
    want = comfyui_call(k5_path, TINY, dataclasses.replace(job, latent=replaced), concat)
    assert rel_err(want, comfyui_call(k5_path, TINY, job, concat)) > 0.01  # the start frame matters
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        errors[label] = rel_err(k5_call(host._model(k5_path, devices, **degrees), job, concat, start), want)
    print("\nstart image: " + ", ".join(f"{k}: {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < RTOL
    with pytest.raises(ConfigError, match=r"start image latent has shape \(1, 4, 1, 2, 6\).*width and height\.$"):
        k5_call(host._model(k5_path, "cpu:1"), job, concat, start[..., :2, :])
