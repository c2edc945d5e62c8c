"""ScaleROPE through the stock MODEL door: Load Parallel DiT's Wan MODEL called as ComfyUI 2026 calls WanModel
with a ScaleROPE node on it (ChronoEdit's template: scale_t 7).

ComfyUI 2026's ScaleROPE (comfy_extras/nodes_rope.py) stores {scale_x, shift_x, scale_y, shift_y, scale_t, shift_t}
as model_options["transformer_options"]["rope_options"], which reaches the diffusion model in every call's
transformer_options and moves WanModel.rope_encode's grid. The fake host is tests/test_model_path_2026.py's with
Wan's detection branch and a supported_models class added (test_wan_bernini_door's `wan_host`) (late-2025 ComfyUI, the real host here, has neither the
node nor the option). The reference is test_wan's model call written from ComfyUI's WanModel, with the same options.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.spec import StrategySpec as S
from test_model_path_2026 import comfy  # noqa: F401 - fixture: the fake ComfyUI 2026 host
from test_wan_bernini_door import wan_host  # noqa: F401 - fixture: that host with Wan's branch and WAN21's conds
from test_wan import MOVED_ROPE, TINY_WAN, call_job, reference_call, wan_path  # noqa: F401

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # fp32, another op order than the reference (float64 RoPE angles): ~2.4e-7 measured


def wan_call(patcher, job, rope_options: dict | None) -> torch.Tensor:
    """BaseModel._apply_model's call of WanModel: cond and uncond, one call each (prompts of 9 and 11 rows)."""
    base, outs = patcher.model, []
    for k, chunk in enumerate((job.positive, job.negative)):
        options = {"cond_or_uncond": [k], "sigmas": job.timestep[k:k + 1] / 1000}
        if rope_options is not None:
            options["rope_options"] = rope_options
        c = base.extra_conds(cross_attn=chunk.cond)
        outs.append(base.diffusion_model(job.latent[k:k + 1], job.timestep[k:k + 1], context=c["c_crossattn"],
                                         control=None, transformer_options=options))
    return torch.cat(outs)


def test_scale_rope_reaches_the_workers_at_one_worker_and_ulysses2(wan_path, wan_host, client1, client2,
                                                                    monkeypatch):
    """ScaleROPE's options on the MODEL move the workers' RoPE grid as they move ComfyUI's (missing entries at the
    node's defaults); without them the call is the plain grid's (dropping them at the door measured 2.5e-2)."""
    clients = {"cpu:1": client1, "cpu:2": client2}
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    names = ("scale_t", "scale_y", "scale_x", "shift_t", "shift_y", "shift_x")
    node = dict(zip(names, MOVED_ROPE))
    job = call_job(wan_path, S())
    want = reference_call(wan_path, dataclasses.replace(job, extra={"rope_options": MOVED_ROPE}), TINY_WAN)
    chrono = reference_call(wan_path, dataclasses.replace(job, extra={"rope_options": [7.0, 1, 1, 0, 0, 0]}), TINY_WAN)
    plain = reference_call(wan_path, job, TINY_WAN)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        model = host._model(wan_path, devices, **degrees)
        errors[label] = rel_err(wan_call(model, job, node), want)
        errors[label + ", scale_t only"] = rel_err(wan_call(model, job, {"scale_t": 7.0}), chrono)
        errors[label + ", no node"] = rel_err(wan_call(model, job, None), plain)
    print("\n" + ", ".join(f"{k}: {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < RTOL
    assert rel_err(want, plain) > 1e-3  # the options matter on this file
