"""Bernini's in-context latents through the stock MODEL door: Load Parallel DiT's Wan MODEL called as ComfyUI 2026 calls
WanModel under BerniniConditioning (the video_bernini_r_* templates' node).

ComfyUI 2026's BerniniConditioning sets `context_latents` (the VAE latents of a source video, a reference video and
reference images, each at its own size) on the positive and the negative; WAN21.extra_conds hands them to the
diffusion model as a CONDList, each through process_latent_in and repeated over the call's rows. The fake host is
tests/test_model_path_2026.py's with Wan's detection branch and WAN21's extra_conds (late-2025 ComfyUI, the real
host here, has neither the node nor the key). The reference is test_wan's model call written from ComfyUI's WanModel.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families.wan import WanAdapter
from parallel_runtime.sampling import WAN21_LATENT
from parallel_runtime.spec import StrategySpec as S
from test_model_path_2026 import comfy  # noqa: F401 - fixture: the fake ComfyUI 2026 host
from test_wan import TINY_WAN, bernini_job, reference_call, wan_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # fp32, another op order than the reference and a process_out / process_in round trip: ~2e-7 measured


def wan_conds(base, cross_attn, context_latents=None, **_):
    """WAN21.extra_conds for a text-to-video file: the prompt, and BerniniConditioning's streams through
    process_latent_in (a list: CONDList)."""
    out = {"c_crossattn": cross_attn}
    if context_latents is not None:
        out["context_latents"] = [base.latent_format.process_in(z) for z in context_latents]
    return out


@pytest.fixture
def wan_host(comfy, monkeypatch):
    branch = host.Branch("wan2.1", ("head.modulation", "blocks.0.self_attn.norm_q.weight"),
                         shapes={"dim": ("head.modulation", 2)})
    monkeypatch.setattr(host, "BRANCHES", (branch,) + host.BRANCHES)
    # The fake BaseModel reads the latent format off the adapter class; Wan's is set per instance (2.1 / 2.2), so
    # the class gets 2.1's here (the workers, other processes, are untouched).
    monkeypatch.setattr(WanAdapter, "latent_format", WAN21_LATENT, raising=False)
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (host.Supported(
        "WAN21_T2V", {"image_model": "wan2.1"}, "discrete_flow", 8.0, 1000.0, 16, wan_conds),))
    return comfy


def bernini_call(patcher, job, batched: bool) -> torch.Tensor:
    """BaseModel._apply_model's calls of WanModel on the job's rows: cond and uncond batched in one call where their
    conds concatenate (prompts of one length: each stream repeated over both rows, CONDList.concat), else one call
    each."""
    base = patcher.model
    conds = [base.extra_conds(cross_attn=b.cond, context_latents=list(b.references))
             for b in (job.positive, job.negative)]
    chunks = [[0, 1]] if batched else [[0], [1]]
    outs = []
    for ks in chunks:
        rows = slice(ks[0], ks[-1] + 1)
        options = {"cond_or_uncond": ks, "sigmas": job.timestep[rows] / 1000}
        context = torch.cat([conds[k]["c_crossattn"] for k in ks])
        streams = [torch.cat([conds[k]["context_latents"][n] for k in ks]) for n in range(len(job.positive.references))]
        outs.append(base.diffusion_model(job.latent[rows], job.timestep[rows], context=context, control=None,
                                         transformer_options=options, context_latents=streams))
    return torch.cat(outs)


def test_bernini_context_latents_reach_the_workers_at_one_worker_and_ulysses2(wan_path, wan_host, client1, client2,
                                                                               monkeypatch):
    """Each chunk's context_latents become its in-context streams, one call per chunk (prompts of 9 and 11 rows) and
    cond with uncond in one call (both of 9 rows): equal to the reference at 1 worker and under Ulysses-2."""
    clients = {"cpu:1": client1, "cpu:2": client2}
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    job = bernini_job(wan_path, S())
    even = dataclasses.replace(job, negative=dataclasses.replace(job.negative, cond=job.negative.cond[:, :9]))
    want = {False: reference_call(wan_path, job, TINY_WAN), True: reference_call(wan_path, even, TINY_WAN)}
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        model = host._model(wan_path, devices, **degrees)
        for batched, case in ((False, job), (True, even)):
            errors[f"{label}{', batched' if batched else ''}"] = rel_err(bernini_call(model, case, batched),
                                                                         want[batched])
    print("\n" + ", ".join(f"{k}: {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < RTOL
    plain = dataclasses.replace(job, positive=dataclasses.replace(job.positive, references=(), reference_method=None),
                                negative=dataclasses.replace(job.negative, references=(), reference_method=None))
    assert rel_err(want[False], reference_call(wan_path, plain, TINY_WAN)) > 1e-3  # the streams matter here


def test_bernini_door_refusals():
    """The door's one sentences: a ref_image beside the streams (no Wan reads both), streams that are not video
    latents, and streams that differ between the images of one prompt."""
    from nodes import remote_model

    context = torch.randn(2, 9, 64)
    stream = torch.randn(1, 16, 2, 6, 6).repeat(2, 1, 1, 1, 1)
    chunk = remote_model._chunk_conditioning(1, 1, context, None, None, {"context_latents": [stream]}, WAN21_LATENT)
    assert chunk.reference_method == "in_context" and chunk.references[0].shape == (1, 16, 2, 6, 6)
    assert rel_err(WAN21_LATENT.process_in(chunk.references[0]), stream[1:]) < 1e-6  # raw again, as the node made it
    both = {"context_latents": [stream], "reference_latent": torch.randn(2, 16, 6, 6)}
    with pytest.raises(ConfigError, match="carries both Wan22FunControlToVideo's ref_image and Bernini's in-context "
                                          "latents"):
        remote_model._chunk_conditioning(0, 1, context, None, None, both, WAN21_LATENT)
    with pytest.raises(ConfigError, match=r"context_latents are not a list of video latents"):
        remote_model._chunk_conditioning(0, 1, context, None, None, {"context_latents": [stream[:, :, 0]]},
                                         WAN21_LATENT)
    mixed = torch.randn(2, 16, 1, 6, 6)
    with pytest.raises(ConfigError, match="in-context latent 1 of the model call differs between the images of one "
                                          "prompt"):
        remote_model._chunk_conditioning(0, 2, context[:1].repeat(2, 1, 1), None, None, {"context_latents": [mixed]},
                                         WAN21_LATENT)
