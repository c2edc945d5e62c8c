"""HiDream O1 through Load Parallel DiT's MODEL on the fake ComfyUI 2026 host (tests/test_model_path_2026.py): what
model_base.HiDreamO1.extra_conds hands the diffusion model (input_ids, position_ids, token_types, vinput_mask, ar_len
beside the ids-as-float cross_attn; with HiDreamO1ReferenceImages' references also ref_pixel_values,
ref_image_grid_thw and ref_patches) reaches the workers, and the call's output equals ComfyUI's model call
(tests/test_hidream_o1.py's comfy_call) at 1 worker and under CFG-2 and Ulysses-2; what the door cannot carry is
refused in one sentence.
"""
from __future__ import annotations

import pytest
import torch

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from test_hidream_o1 import (H, IMAGE_PAD, VISION_END, VISION_START, W, comfy_call, comfy_edit_positions,  # noqa: F401
                             comfy_position_ids, path, prompt_ids, ref_path, reference_inputs)

pytestmark = pytest.mark.timeout(600)

# One fp32 forward in another op order than ComfyUI's (~2e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5
SIGMA = 0.71


def o1_conds(base, cross_attn, noise, text_input_ids=None, reference_latents=None, **_):
    """model_base.HiDreamO1.extra_conds: conditioning.build_extra_conds' T2I branch (the position ids with a leading
    batch dim, token_types 1 from <|tms|> on, vinput_mask on the image, ar_len an int), or its edit branch where
    reference images are attached (o1_edit_conds)."""
    out = {"c_crossattn": cross_attn}
    if text_input_ids is None:
        return out
    if reference_latents is not None:
        out.update(o1_edit_conds(text_input_ids, noise, reference_latents))
        return out
    txt_len, image_len = text_input_ids.shape[1], (noise.shape[-2] // 32) * (noise.shape[-1] // 32)
    token_types = torch.zeros(1, txt_len + image_len, dtype=torch.long)
    token_types[:, txt_len - 1:] = 1
    vinput_mask = torch.zeros(1, txt_len + image_len, dtype=torch.bool)
    vinput_mask[:, txt_len:] = True
    out.update(input_ids=text_input_ids, position_ids=comfy_position_ids(text_input_ids, noise.shape[-2] // 32,
                                                                         noise.shape[-1] // 32).unsqueeze(0),
               token_types=token_types, vinput_mask=vinput_mask, ar_len=txt_len - 1)
    return out


def o1_edit_conds(text_input_ids, noise, references) -> dict:
    """build_extra_conds' edit branch. `references`: what conditioning.prepare_ref_images makes of each image (its
    resampling stays ComfyUI's, on the host), as (the 32-px image in [-1, 1] [1, 3, h, w], its tower patches
    [n, 1536], its (t, h, w) tower grid): ref_patches patchified (c, p1, p2) and concatenated, ref_pixel_values and
    ref_image_grid_thw with a leading batch dim, input_ids with build_ref_input_ids' vision blocks, the edit
    positions, ar_len = the new prompt length - 1."""
    grid = torch.tensor([list(r[2]) for r in references])
    ids = text_input_ids[0].tolist()
    blocks = []
    for t, h, w in grid.tolist():
        blocks += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
    input_ids = torch.tensor([ids[:3] + blocks + ids[3:]])
    h_p, w_p = noise.shape[-2] // 32, noise.shape[-1] // 32
    ref_grids = [(r[0].shape[-2] // 32, r[0].shape[-1] // 32) for r in references]
    patches = torch.cat([r[0][0].reshape(3, gh, 32, gw, 32).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3072)
                         for r, (gh, gw) in zip(references, ref_grids)])
    txt_len = input_ids.shape[1]
    total = txt_len + h_p * w_p + patches.shape[0]
    token_types = torch.zeros(1, total, dtype=torch.long)
    token_types[:, txt_len - 1:] = 1
    vinput_mask = torch.zeros(1, total, dtype=torch.bool)
    vinput_mask[:, txt_len:] = True
    return dict(input_ids=input_ids, position_ids=comfy_edit_positions(input_ids, h_p, w_p, grid, ref_grids)[None],
                token_types=token_types, vinput_mask=vinput_mask, ar_len=txt_len - 1,
                ref_pixel_values=torch.cat([r[1] for r in references])[None], ref_image_grid_thw=grid[None],
                ref_patches=patches[None])


def prepared_references() -> list[tuple]:
    """test_hidream_o1's two references as prepare_ref_images' per-image outputs."""
    images, pixels, grid = reference_inputs()
    split = pixels.split(grid.prod(-1).tolist())
    return [(img, pix, tuple(g)) for img, pix, g in zip(images, split, grid.tolist())]


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


def _edit_reference(path, x, parts) -> torch.Tensor:
    """comfy_call on the chunks' edit inputs (the runtime's Conditioning of each, as test_hidream_o1 writes it)."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec

    conds = []
    for c in parts:
        made = o1_edit_conds(c["text_input_ids"], x[:1], c["reference_latents"])
        images = tuple(r[0] for r in c["reference_latents"])
        conds.append(Conditioning(made["input_ids"].unsqueeze(-1).float(), torch.zeros(1, 0), references=images,
                                  vision=made["ref_pixel_values"][0], vision_grid=made["ref_image_grid_thw"][0]))
    job = Job(ModelSpec(path), StrategySpec(), SamplingSpec(steps=1), x, conds[0], conds[1],
              timestep=torch.full((x.shape[0],), SIGMA) * 1000)
    return comfy_call(path, job)


def test_reference_images_equal_comfyui_at_1_worker_cfg2_and_ulysses2(ref_path, o1_host, client1, client2,
                                                                      monkeypatch):
    """HiDreamO1ReferenceImages' two references on both prompts (as the node attaches them): the door reads the
    patches back into images by position_ids' reference blocks, carries the tower's inputs beside them and the
    spliced prompt as the ids, and the workers' call equals ComfyUI's."""
    clients = {"cpu:1": client1, "cpu:2": client2}
    x = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(8))
    parts = [dict(c, reference_latents=prepared_references()) for c in chunks()]
    want = _edit_reference(ref_path, x, parts)
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2})):
        patcher = _door(ref_path, devices, clients, monkeypatch, **degrees)
        errors[label] = rel_err(host.model_call(patcher, x, SIGMA, parts), want)
    plain = rel_err(_reference(ref_path, x, chunks()), want)  # the same call without its references
    print("\nHiDream O1 door with references vs ComfyUI's model call: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f"; without the references {plain:.1e}")
    assert max(errors.values()) < RTOL
    assert plain > 1e-3  # the references reach the model


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
    base = patcher.model
    t = base.model_sampling.timestep(torch.full((1,), SIGMA)).float()
    options = {"cond_or_uncond": [0], "sigmas": torch.full((1,), SIGMA)}
    edit = base.extra_conds(noise=x[:1], **dict(chunks((9,))[0], reference_latents=prepared_references()))
    partial = {k: v for k, v in edit.items() if k != "ref_patches"}  # a node that dropped the patches
    with pytest.raises(ConfigError, match="carries reference images without ref_patches; attach them with "
                                          "HiDreamO1ReferenceImages"):
        base.diffusion_model(x[:1], t, context=partial.pop("c_crossattn"), control=None,
                             transformer_options=dict(options), **partial)
    moved = dict(edit, position_ids=edit["position_ids"].clone())
    moved["position_ids"][:, 0, -1] += 1  # the last patch of the second reference no longer in its block
    with pytest.raises(ConfigError, match="reference patches do not match its 2 reference images' positions"):
        base.diffusion_model(x[:1], t, context=moved.pop("c_crossattn"), control=None,
                             transformer_options=dict(options), **moved)
    kwargs = base.extra_conds(noise=x[:1], **chunks((9,))[0])
    kwargs["position_ids"] = kwargs["position_ids"] + 1  # a node that moved the positions
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
