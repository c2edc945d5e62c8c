"""Parallel Sampler's one decision (nodes/route.py): the workers' own step loop where it reproduces the graph,
ComfyUI's sampler (KSampler's own code, one runtime job per model evaluation) for everything else.

Without a ComfyUI host the MODEL is a stand-in carrying a real RemoteDiT, and ComfyUI's common_ksampler is a
recording fake: these tests pin which path a graph takes, what the node says, and that Cancel and errors reach
ComfyUI. That the per-call path equals KSampler's latent is shown in the host tests (test_comfyui_*), where the
same common_ksampler runs."""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch

import test_nodes
from test_nodes import FakeHost, Interrupt, cond, handle, latent

from nodes import convert, remote_model, route
from nodes import sampler as sampler_mod
from parallel_runtime.errors import ConfigError
from parallel_runtime.spec import StrategySpec

runtime = test_nodes.runtime  # the fake runtime fixture (client, auto, devices)


class _Base:  # what RemoteDiT reads of ComfyUI's BaseModel (held weakly, so a class, not a SimpleNamespace)
    latent_format = types.SimpleNamespace(latent_channels=16)


def parallel_model(video=False, **options):
    """A stand-in for Load Parallel DiT's MODEL: a ModelPatcher-like object whose BaseModel holds a RemoteDiT."""
    base = _Base()
    remote = remote_model.RemoteDiT(handle(convert.strategy_choice("manual", pipefusion_degree=2)), torch.float32,
                                    base, {})
    remote._video_model = video
    base.diffusion_model = remote
    return types.SimpleNamespace(model=base, model_options=dict(options), object_patches={}, _keep=base)


@dataclass
class RecordingHost(FakeHost):
    """FakeHost plus ComfyUI's common_ksampler, recorded; the remote's last strategy set as a model call would."""
    calls: list = field(default_factory=list)
    fail: BaseException | None = None
    sets_strategy: bool = True

    def fixed_latent(self, model, latent):
        """ComfyUI's fix_empty_latent_channels for a 16-channel model: an empty 4-channel latent is widened."""
        samples = latent["samples"]
        if samples.shape[1] == 4 and not samples.any():
            return dict(latent, samples=samples.repeat(1, 4, *([1] * (samples.ndim - 2))))
        return latent

    def ksampler(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise):
        self.calls.append(dict(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                               denoise=denoise, latent=latent))
        if self.fail is not None:
            raise self.fail
        if self.sets_strategy:  # as the run's model calls do
            remote = model.model.diffusion_model
            remote.last_strategy = StrategySpec(pipefusion_degree=2)
            for step in range(steps):
                remote.on_call(step, remote.last_strategy, _StatusClient())
        return dict(latent, samples=latent["samples"] * 2)


class _StatusClient:
    def status(self):
        return {"workers": [{"rank": 0, "alive": True}]}


def gap(model=None, cfg=3.0, sampler="euler", scheduler="simple", positive=None, negative=None, lat=None,
        video=False):
    return route.worker_loop_gap(model if model is not None else parallel_model(video), cfg, sampler, scheduler,
                                 positive if positive is not None else cond(),
                                 negative if negative is not None else cond(),
                                 lat if lat is not None else latent(), video)


def test_the_worker_loop_runs_plain_graphs_images_and_videos():
    assert gap() is None
    assert gap(positive=cond(guidance=3.5, reference_latents=[torch.randn(1, 16, 8, 8)])) is None
    assert gap(lat={"samples": torch.randn(1, 16, 3, 10, 16)}, video=True) is None  # Wan T2V: cross-step
    assert gap(positive=cond(start_percent=0.0, end_percent=1.0, strength=1.0)) is None  # defaults change nothing
    # a start image's CLIP-vision tokens and Wan Animate's pose and face video: the MODEL's own extra_conds makes
    # their inputs for the worker loop (sampler._with_image_inputs)
    assert gap(positive=cond(clip_vision_output=object(), pose_video_latent=torch.zeros(1), face_video_pixels=1)) is None


@pytest.mark.parametrize("change,phrase", [
    (dict(sampler="dpmpp_2m_sde"), "the sampler dpmpp_2m_sde"),
    (dict(scheduler="karras"), "the scheduler karras"),
    (dict(lat=latent(noise_mask=torch.ones(1, 1, 16, 16))), "a noise mask"),
    (dict(lat={"samples": torch.randn(1, 16, 3, 8, 8)}), "a 3-frame video latent"),
    (dict(positive=cond() + cond()), "2 combined positive conditionings"),
    (dict(positive=cond(area=(8, 8, 0, 0))), "area conditioning (ConditioningSetArea) in the positive"),
    (dict(negative=cond(mask=torch.ones(1, 8, 8))), "masked conditioning (ConditioningSetMask) in the negative"),
    (dict(positive=cond(control=object())), "a ControlNet in the positive conditioning"),
    (dict(positive=cond(start_percent=0.5)), "a timestep range (ConditioningSetTimestepRange)"),
    (dict(positive=cond(strength=0.5)), "a conditioning strength other than 1"),
    (dict(positive=cond(some_2027_key=1)), "'some_2027_key' in the positive conditioning"),
    (dict(model=parallel_model(sampler_post_cfg_function=[lambda a: a["denoised"]])),
     "a post-CFG function (sampler_post_cfg_function)"),
    (dict(model=parallel_model(transformer_options={"patches_replace": {"dit": {("double_block", 1): print}}})),
     "block patches (patches_replace, as SkipLayerGuidance nodes set)"),
])
def test_what_the_worker_loop_lacks_is_named(change, phrase):
    found = gap(**change)
    assert found is not None and phrase in found


def test_model_options_route_unless_empty_or_paradits_own_wrapper():
    assert gap(model=parallel_model(transformer_options={"wrappers": {"outer_sample": {
        "paradit_controlnet": [print]}}, "callbacks": {}}, disable_cfg1_optimization=False)) is None
    assert gap(model=parallel_model(denoise_mask_function=print)) == \
        "a denoise mask function (DifferentialDiffusion) (denoise_mask_function)"
    assert gap(model=parallel_model(transformer_options={"wrappers": {"outer_sample": {"easycache": [print]}}})) == \
        "a model wrapper (easycache)"
    assert gap(model=parallel_model(transformer_options={"callbacks": {"on_pre_run": {"x": [print]}}})) == \
        "a model callback (x)"
    assert gap(model=parallel_model(some_2027_option=1)) == "a model option (some_2027_option)"
    assert gap(model=parallel_model(some_tensor_option=torch.zeros(3))) == "a model option (some_tensor_option)"


def test_wrappers_and_callbacks_on_the_patcher_itself_route():
    """ComfyUI keeps add_wrapper_with_key / add_callback_with_key entries on the ModelPatcher and copies them into
    transformer_options only in the sampler's own clone: the route reads the patcher's."""
    model = parallel_model()
    model.wrappers = {"outer_sample": {"paradit_controlnet": [print]}, "predict_noise": {}}
    model.callbacks = {"on_pre_run": {}}
    assert gap(model=model) is None
    model.wrappers["predict_noise"]["lazycache"] = [print]
    assert gap(model=model) == "a model wrapper (lazycache)"
    model = parallel_model()  # EasyCache's three wrappers under one key: named once
    model.wrappers = {kind: {"easycache": [print]} for kind in ("outer_sample", "calc_cond_batch", "diffusion_model")}
    assert gap(model=model) == "a model wrapper (easycache)"
    model = parallel_model()
    model.callbacks = {"on_cleanup": {"some_node": [print]}}
    assert gap(model=model) == "a model callback (some_node)"
    model = parallel_model()
    model.injections = {"some_node": [object()]}
    assert gap(model=model) == "model injections (some_node)"


def test_a_prompt_mask_that_hides_nothing_keeps_the_worker_loop():
    """Lumina 2's and Z-Image's encoders attach an all-ones mask; ComfyUI drops it, the worker loop runs that
    prompt unpadded. A mask that hides padding routes (and the model call refuses padding in one sentence)."""
    assert gap(positive=cond(attention_mask=torch.ones(1, 8))) is None
    padded = torch.ones(1, 8)
    padded[0, 6:] = 0
    assert "attention mask" in gap(positive=cond(attention_mask=padded))


def test_cfg_1_ignores_the_negative_in_both_loops():
    assert gap(cfg=1.0, negative=cond(area=(8, 8, 0, 0))) is None
    assert gap(cfg=3.0, negative=cond(area=(8, 8, 0, 0))) is not None


def test_a_patched_model_sampling_routes_to_comfyuis_sampler():
    model = parallel_model()
    model.object_patches = {"model_sampling": object()}  # ModelSamplingFlux / ModelSamplingSD3's shift
    assert gap(model=model) == "a patched model (model_sampling, as ModelSampling nodes set)"


def test_a_routed_graph_runs_comfyuis_sampler_and_says_so(runtime):
    host = RecordingHost()
    model = parallel_model()
    lat = latent(noise_mask=torch.ones(1, 1, 16, 16))
    out, summary = sampler_mod.sample(model, 7, 4, 3.5, "euler", "simple", cond(), cond(), lat, 0.8, node_id="9",
                                      host=host)
    assert [(c["seed"], c["steps"], c["cfg"], c["denoise"]) for c in host.calls] == [(7, 4, 3.5, 0.8)]
    assert host.calls[0]["latent"] is lat  # the LATENT as given: ComfyUI's sampler applies its noise mask
    assert torch.equal(out["samples"], lat["samples"] * 2)
    assert runtime.clients == {}  # no worker-loop job
    line = "per-call pipeline: the graph has a noise mask (inpainting, or an image-to-video latent's first frames)"
    assert host.texts == [("9", line)]
    # One "running" event with the workers' status (later calls within STATUS_INTERVAL_S send none).
    assert [e["state"] for e in host.events] == ["starting", "running", "done"]
    assert host.events[1]["step"] == 1 and host.events[1]["total"] == 4 and host.events[1]["status"]["workers"]
    assert model.model.diffusion_model.on_call is None  # unhooked after the run
    assert host.events[-1]["strategy"] == "pp2xM2w1" and host.events[-1]["reason"] == line
    assert summary.startswith("pp2xM2w1 on 2 worker(s), one runtime job per model call (" + line + "): 4 steps in ")


def test_a_plain_graph_on_a_parallel_model_is_one_worker_job(runtime):
    host = RecordingHost()
    out, summary = sampler_mod.sample(parallel_model(), 1, 3, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0,
                                      host=host)
    assert host.calls == [] and len(runtime.clients["cpu:2"].jobs) == 1
    assert "per model call" not in summary


def test_a_video_latent_reaches_the_worker_loop_with_its_frames(runtime):
    video = {"samples": torch.randn(1, 16, 3, 10, 16)}
    sampler_mod.sample(parallel_model(video=True), 1, 2, 1.0, "euler", "simple", cond(), cond(), video, 1.0,
                       host=RecordingHost())
    job = runtime.clients["cpu:2"].jobs[0]
    assert tuple(job.latent.shape) == (1, 16, 3, 10, 16)


def test_an_empty_latent_is_widened_as_ksampler_widens_it(runtime):
    """Empty Latent Image's 4 channels for a 16-channel model: KSampler's fix_empty_latent_channels first, then the
    worker loop, and the output has the widened shape, as KSampler's."""
    empty = {"samples": torch.zeros(1, 4, 16, 16)}
    out, _ = sampler_mod.sample(parallel_model(), 1, 2, 1.0, "euler", "simple", cond(), cond(), empty, 1.0,
                                host=RecordingHost())
    assert tuple(runtime.clients["cpu:2"].jobs[0].latent.shape) == (1, 16, 16, 16)
    assert tuple(out["samples"].shape) == (1, 16, 16, 16)


def test_the_summary_never_shows_an_earlier_prompts_strategy(runtime):
    model = parallel_model()
    model.model.diffusion_model.last_strategy = StrategySpec(ring_degree=2)  # a KSampler run before this one
    host = RecordingHost(sets_strategy=False)  # denoise leaves no step: no model call
    _, summary = sampler_mod.sample(model, 0, 2, 1.0, "euler", "simple", cond(), cond(),
                                    latent(noise_mask=torch.ones(1, 1, 16, 16)), 0.0, host=host)
    assert summary.startswith("ParaDiT, one runtime job per model call") and host.events[-1]["strategy"] is None


def test_cancel_and_errors_on_the_per_call_path_reach_comfyui(runtime):
    lat = latent(noise_mask=torch.ones(1, 1, 16, 16))
    host = RecordingHost(fail=Interrupt())
    model = parallel_model()
    with pytest.raises(Interrupt):
        sampler_mod.sample(model, 0, 2, 1.0, "euler", "simple", cond(), cond(), lat, 1.0, host=host)
    assert host.events[-1]["state"] == "cancelled" and host.events[-1]["message"] == "Cancelled."
    assert model.model.diffusion_model.on_call is None  # a later KSampler run on this MODEL sends no events
    host = RecordingHost(fail=ConfigError("the model call carries inputs ParaDiT does not run (x)."))
    with pytest.raises(ConfigError, match="inputs ParaDiT does not run"):
        sampler_mod.sample(parallel_model(), 0, 2, 1.0, "euler", "simple", cond(), cond(), lat, 1.0, host=host)
    assert host.events[-1]["state"] == "error" and "inputs ParaDiT does not run" in host.events[-1]["message"]


@pytest.mark.parametrize("cfg,denoise,name", [(float("nan"), 1.0, "cfg"), (3.0, float("inf"), "denoise")])
def test_nan_settings_are_refused_before_comfyuis_sampler_runs(runtime, cfg, denoise, name):
    host = RecordingHost()
    lat = latent(noise_mask=torch.ones(1, 1, 16, 16))
    # The same sentence the workers' path gives (validate.check_setting).
    with pytest.raises(ConfigError, match=rf"^{name}=(nan|inf) is not a finite number; set {name} (to a number|between)"):
        sampler_mod.sample(parallel_model(), 0, 2, cfg, "euler", "simple", cond(), cond(), lat, denoise, host=host)
    assert host.calls == [] and host.events == []


def test_a_video_latent_for_an_image_model_gets_one_sentence_from_the_model_call():
    """Routed to ComfyUI's sampler (as KSampler would run it), the model call refuses it with the same sentence
    the worker loop's conversion gives."""
    remote = parallel_model(video=False).model.diffusion_model
    with pytest.raises(ConfigError, match=r"^The latent has 3 frames, but tiny is an image model"):
        remote(torch.zeros(1, 16, 3, 8, 8), torch.zeros(1), context=torch.zeros(1, 4, 8))
