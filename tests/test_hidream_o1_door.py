"""HiDream O1 through Load Parallel DiT's MODEL on the fake ComfyUI 2026 host (tests/test_model_path_2026.py): what
model_base.HiDreamO1.extra_conds hands the diffusion model (input_ids, position_ids, token_types, vinput_mask, ar_len
beside the ids-as-float cross_attn) reaches the workers, and the call's output equals ComfyUI's model call
(tests/test_hidream_o1.py's comfy_call) at 1 worker and under CFG-2 and Ulysses-2; what the door cannot carry is
refused in one sentence.
"""
from __future__ import annotations

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from test_hidream_o1 import H, W, comfy_call, comfy_position_ids, path, prompt_ids  # noqa: F401

pytestmark = pytest.mark.timeout(600)

# One fp32 forward in another op order than ComfyUI's (~2e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5
SIGMA = 0.71


def o1_conds(base, cross_attn, noise, text_input_ids=None, reference_latents=None, **_):
    """model_base.HiDreamO1.extra_conds for a text-to-image call: conditioning.build_extra_conds' T2I branch (the
    position ids with a leading batch dim, token_types 1 from <|tms|> on, vinput_mask on the image, ar_len an int);
    reference images add conditioning.prepare_ref_images' tensors (here only their presence matters: refused)."""
    out = {"c_crossattn": cross_attn}
    if text_input_ids is None:
        return out
    txt_len, image_len = text_input_ids.shape[1], (noise.shape[-2] // 32) * (noise.shape[-1] // 32)
    token_types = torch.zeros(1, txt_len + image_len, dtype=torch.long)
    token_types[:, txt_len - 1:] = 1
    vinput_mask = torch.zeros(1, txt_len + image_len, dtype=torch.bool)
    vinput_mask[:, txt_len:] = True
    out.update(input_ids=text_input_ids, position_ids=comfy_position_ids(text_input_ids, noise.shape[-2] // 32,
                                                                         noise.shape[-1] // 32).unsqueeze(0),
               token_types=token_types, vinput_mask=vinput_mask, ar_len=txt_len - 1)
    if reference_latents is not None:
        out["ref_pixel_values"] = torch.zeros(1, 4, 1536)
    return out


@pytest.fixture
def o1_host(comfy, monkeypatch):
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (
        host.Supported("HiDreamO1", {"image_model": "hidream_o1"}, "discrete_flow", 3.0, 1000.0, 3, o1_conds),))
    return comfy


comfy = host.comfy  # the fake ComfyUI modules


def chunks(lengths=(9, 9)) -> list[dict]:
    """The CONDITIONING of CLIPTextEncode on HiDream O1's CLIP per chunk: cross_attn = ids as float32 [1, L, 1] and
    text_input_ids beside it (HiDreamO1TE.encode_token_weights)."""
    out = []
    for seed, n in enumerate(lengths, start=1):
        ids = prompt_ids(seed, n)
        out.append({"cross_attn": ids.unsqueeze(-1).float(), "text_input_ids": ids})
    return out


def _door(path, devices, clients, monkeypatch, **degrees):
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    return host._model(path, devices, **degrees)


def _reference(path, x, parts) -> torch.Tensor:
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec

    conds = [Conditioning(c["cross_attn"], torch.zeros(1, 0)) for c in parts]
    job = Job(ModelSpec(path), StrategySpec(), SamplingSpec(steps=1), x, conds[0], conds[1],
              timestep=torch.full((x.shape[0],), SIGMA) * 1000)  # model_sampling.timestep: sigma x 1000
    return comfy_call(path, job)


def test_model_call_equals_comfyui_at_1_worker_cfg2_and_ulysses2(path, o1_host, client1, client2, monkeypatch):
    clients = {"cpu:1": client1, "cpu:2": client2}
    x = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(4))
    parts = chunks()
    want = _reference(path, x, parts)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        patcher = _door(path, devices, clients, monkeypatch, **degrees)
        assert patcher.model.model_config.supported.name == "HiDreamO1"
        errors[label] = rel_err(host.model_call(patcher, x, SIGMA, parts), want)
    print("\nHiDream O1 door vs ComfyUI's model call: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < RTOL


def test_the_prompt_ids_come_from_input_ids_when_the_host_casts_context_to_bf16(path, o1_host, client1, monkeypatch):
    """BaseModel._apply_model casts `context` (the ids as float) to the model's dtype: in a bf16 host every id above 256
    is rounded there. The door takes the exact ids from input_ids (int64), so the call still equals ComfyUI's (which
    reads input_ids too)."""
    patcher = _door(path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    base, conds = patcher.model, patcher.model.extra_conds
    monkeypatch.setattr(base, "extra_conds", lambda **kw: {**conds(**kw),
                                                           "c_crossattn": conds(**kw)["c_crossattn"].bfloat16()})
    x = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(6))
    parts = chunks()
    assert not torch.equal(parts[0]["cross_attn"].bfloat16().float(), parts[0]["cross_attn"])  # bf16 rounds them
    err = rel_err(host.model_call(patcher, x, SIGMA, parts), _reference(path, x, parts))
    print(f"\nHiDream O1 door with a bf16 context vs ComfyUI's model call: {err:.1e}")
    assert err < RTOL


def test_what_the_door_cannot_carry_is_refused_in_one_sentence(path, o1_host, client1, monkeypatch):
    patcher = _door(path, "cpu:1", {"cpu:1": client1}, monkeypatch)
    x = torch.randn(2, 3, H, W)
    with_refs = [dict(c, reference_latents=[torch.rand(1, 64, 64, 3)]) for c in chunks()]
    with pytest.raises(ConfigError, match="reference images \\(HiDreamO1ReferenceImages\\).*CheckpointLoaderSimple"):
        host.model_call(patcher, x, SIGMA, with_refs)
    base = patcher.model
    kwargs = base.extra_conds(noise=x[:1], **chunks((9,))[0])
    kwargs["position_ids"] = kwargs["position_ids"] + 1  # a node that moved the positions
    t = base.model_sampling.timestep(torch.full((1,), SIGMA)).float()
    with pytest.raises(ConfigError, match="positions or ar_len are not a text-to-image call's for 9 prompt tokens"):
        base.diffusion_model(x[:1], t, context=kwargs.pop("c_crossattn"), control=None,
                             transformer_options={"cond_or_uncond": [0], "sigmas": torch.full((1,), SIGMA)}, **kwargs)


def test_the_seam_smoothing_wrapper_runs_its_shifted_calls_on_the_workers(path, o1_host, client2, monkeypatch):
    """HiDreamO1PatchSeamSmoothing (the full template's) is a DIFFUSION_MODEL wrapper: it calls the model again on x
    rolled by (16, 16) px and averages the rolled-back predictions. It runs on the host around the parallel MODEL, so
    each shifted call is an ordinary model call (same shapes) on the workers: here under Ulysses-2 against ComfyUI's
    model call on x and on the rolled x, averaged alike."""
    def smoothing(executor, *args, **kwargs):  # the node's "single_shift", 2 passes, "average", strength 1 core
        x = args[0]
        pred = executor(*args, **kwargs)
        rolled = executor(torch.roll(x, shifts=(16, 16), dims=(-2, -1)), *args[1:], **kwargs)
        return (pred + torch.roll(rolled, shifts=(-16, -16), dims=(-2, -1))) / 2

    x = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(5))
    parts = chunks()
    want = (_reference(path, x, parts) + torch.roll(_reference(path, torch.roll(x, (16, 16), (-2, -1)), parts),
                                                    (-16, -16), (-2, -1))) / 2
    patcher = _door(path, "cpu:2", {"cpu:2": client2}, monkeypatch, ulysses_degree=2)
    out = host.model_call(patcher, x, SIGMA, parts, wrappers={"diffusion_model": {"seam": [smoothing]}})
    err = rel_err(out, want)
    print(f"\nHiDream O1 seam-smoothing wrapper under Ulysses-2 vs ComfyUI's calls: {err:.1e}")
    assert err < RTOL
