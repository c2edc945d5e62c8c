"""Parallel Sampler on the audio-video families (LTX-2, MiniMax-H3): the workers' own step loop denoises the video and
the audio latent together, as KSampler samples ComfyUI 2026's NestedTensor latent of these models.

The references are plain loops written here from ComfyUI 2026's source, over a model call that shares nothing with
the runtime but the file: comfy.sample.prepare_noise over the NestedTensor (one generator, video then audio),
CFGGuider's packed latent stepped with the model's sigmas (KSampler's "simple" schedule written out: MiniMax-H3's
ModelSamplingDiscreteFlow shift 12, LTX-2's ModelSamplingFlux shift 2.37), CFG on the predictions, and KSampler's
euler / euler_ancestral (sample_euler_ancestral_RF, its noise drawn over the packed latent). MiniMax-H3's audio is
carried on the video's schedule as ModelSamplingAV and model_base.MiniMaxH3 carry it (audio_scale 12 / 3;
MiniMaxH3Model.forward's undo of the carry); its model is diffusers' MiniMaxH3Transformer3DModel on diffusers' own
layout (test_minimax_h3.diffusers_call). LTX-2's model is ComfyUI 2026's LTXAVModel forward written out
(test_ltx2_comfyui.comfyui_call), both streams at the step's sigma as LTXAV.process_timestep gives them without a
noise mask. Every exact strategy then equals the serial run.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
from parallel_runtime.validate import validate_job

import test_ltx2
import test_minimax_h3 as h3t
from test_ltx2_comfyui import comfyui_call
from test_minimax_h3_door import comfy, h3_host  # noqa: F401 - fixtures: ComfyUI 2026's host with MiniMaxH3

pytestmark = pytest.mark.timeout(600)

STEPS, CFG, SEED = 4, 3.0, 42
# fp32 loops of 4 steps over models in another op order than the runtime's (~1e-7 per call measured): the serial
# run against its reference, and each exact strategy against the serial run (reordered sums, ~1e-7).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-5
H3_AUDIO_T = 5  # MiniMax-H3 audio latent frames (10 audio rows beside 18 video rows)
LTX_NAME = "ltx2.3"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("av-sampler")
    return {"minimax_h3": write_checkpoint(str(folder / "minimax_h3_tiny.safetensors"), h3t.TINY, seed=1,
                                           layout="minimax"),
            "ltx2": write_checkpoint(str(folder / "ltx2_tiny.safetensors"), test_ltx2.CONFIGS[LTX_NAME], seed=3,
                                     prefix="model.diffusion_model.")}


def simple_sigmas(sigma_of, steps: int = STEPS) -> torch.Tensor:
    """KSampler's "simple" schedule where the steps divide the sigma table: the table at t = 1, 1 - 1/steps, ...,
    then 0 (float32, as ComfyUI's tables)."""
    t = torch.tensor([1.0 - k / steps for k in range(steps)], dtype=torch.float32)
    return torch.cat([sigma_of(t).float(), torch.zeros(1)])


def h3_job(path: str, strategy=StrategySpec(), sampler: str = "euler", denoise: float = 1.0, batch: int = 1,
           latent: tuple | None = None, steps: int = STEPS) -> Job:
    g = torch.Generator().manual_seed(9)
    pos, neg = (Conditioning(torch.randn(1, h3t.TEXT_LEN, h3t.TINY.text_dim, generator=g), torch.zeros(1, 0))
                for _ in "pn")
    video, audio = latent or (torch.zeros(batch, 24, h3t.T, h3t.H, h3t.W), torch.zeros(batch, 32, 2, H3_AUDIO_T))
    return Job(ModelSpec(path), strategy, SamplingSpec(seed=SEED, steps=steps, cfg=CFG, sampler_name=sampler,
                                                       scheduler="simple", denoise=denoise), video, pos, neg,
               audio=audio)


def ltx_job(path: str, strategy=StrategySpec(), sampler: str = "euler_ancestral", batch: int = 2,
            steps: int = STEPS) -> Job:
    config, g = test_ltx2.CONFIGS[LTX_NAME], torch.Generator().manual_seed(13)
    width = config.cross_attention_dim + config.audio_cross_attention_dim
    pos, neg = (Conditioning(torch.randn(1, test_ltx2.PROMPT, width, generator=g), torch.zeros(1, 0)) for _ in "pn")
    video = torch.zeros(batch, config.in_channels, test_ltx2.T, test_ltx2.H, test_ltx2.W)
    audio = torch.zeros(batch, config.audio_in_channels // 16, test_ltx2.AUDIO_FRAMES, 16)
    return Job(ModelSpec(path), strategy, SamplingSpec(seed=SEED, steps=steps, cfg=CFG, sampler_name=sampler,
                                                       scheduler="simple"), video, pos, neg, audio=audio,
               extra={"frame_rate": 25.0})


# -- the references ----------------------------------------------------------------------------------------------

def comfy_noise(seed: int, *shapes, noise_inds=None) -> list[torch.Tensor]:
    """comfy.sample.prepare_noise over a NestedTensor: the CPU generator seeded once (torch.manual_seed(seed)), then
    each stream's noise in turn, video first; with a LATENT's batch_index (noise_inds) each stream draws one image
    per index up to the largest and keeps those named."""
    generator = torch.Generator().manual_seed(seed)
    if noise_inds is None:
        return [torch.randn(shape, generator=generator) for shape in shapes]
    out = []
    for shape in shapes:
        draws = [torch.randn((1, *shape[1:]), generator=generator) for _ in range(max(noise_inds) + 1)]
        out.append(torch.cat([draws[i] for i in noise_inds]))
    return out


@functools.lru_cache(maxsize=2)
def h3_diffusers_model(path: str):
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    model = MiniMaxH3Transformer3DModel(**h3t.TINY.diffusers_kwargs()).eval()
    model.load_state_dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(load_file(path),
                                                                                 h3t.TINY.diffusers_kwargs()))
    return model


def shift_h3(sigma, frm: float, to: float):
    base = sigma / (frm + sigma * (1.0 - frm))
    return to * base / (1.0 + (to - 1.0) * base)


def h3_reference(path: str, job: Job) -> tuple[torch.Tensor, torch.Tensor]:
    """KSampler's euler on MiniMax-H3's packed latent: the audio carried at audio_scale 4 (process_latent_in), the
    model reading carried x sigma_a / sigma_v and answering with the carried variable's velocity, CFG, Euler, then
    process_latent_out's division; the model diffusers' own on each branch (ComfyUI's sign: the negated velocity)."""
    from parallel_runtime.models.families.minimax_h3 import unpack_audio, unpatchify_video

    scale = 12.0 / 3.0
    model = h3_diffusers_model(path)
    sigmas = simple_sigmas(lambda t: 12.0 * t / (1 + 11.0 * t), int(job.sampling.steps / job.sampling.denoise))
    sigmas = sigmas[-(job.sampling.steps + 1):]
    noise_v, noise_a = comfy_noise(SEED, job.latent.shape, job.audio.shape)
    lat_v, lat_a = job.latent, job.audio
    if lat_v.count_nonzero() + lat_a.count_nonzero():
        lat_a = lat_a * scale
    s0 = sigmas[0]
    xv, xa = s0 * noise_v + (1 - s0) * lat_v, s0 * noise_a + (1 - s0) * lat_a
    for i in range(job.sampling.steps):
        s = sigmas[i]
        s_a = shift_h3(s, 12.0, 3.0)
        audio_in = xa * (s_a / s)
        outs = []
        for branch in (job.positive, job.negative):
            out = h3t.diffusers_call(path, branch.cond, xv, audio_in, sigma=float(s), model=model)
            video_out = -unpatchify_video(out["video"], h3t.T, h3t.H // 2, h3t.W // 2)
            audio_out = -unpack_audio(out["audio"])
            outs.append((video_out, (1 - scale) * audio_in + (1 + (scale - 1) * s_a) * audio_out))
        (cv, ca), (uv, ua) = outs
        dt = sigmas[i + 1] - s
        xv, xa = xv + (uv + CFG * (cv - uv)) * dt, xa + (ua + CFG * (ca - ua)) * dt
    return xv, xa / scale


def ltx_reference(path: str, job: Job) -> tuple[torch.Tensor, torch.Tensor]:
    """KSampler's euler_ancestral on LTX-2's packed latent (sample_euler_ancestral_RF, eta 1: its noise one randn of
    the packed [B, 1, N] per step from a generator seeded with the seed), ComfyUI's LTXAVModel on [cond; uncond],
    both streams at the step's sigma (LTXAV.process_timestep without a mask), CFG on the denoised latents."""
    T, H, W, F = test_ltx2.T, test_ltx2.H, test_ltx2.W, test_ltx2.AUDIO_FRAMES
    config, b = test_ltx2.CONFIGS[LTX_NAME], job.latent.shape[0]
    mu = 2.37
    sigmas = simple_sigmas(lambda t: math.exp(mu) / (math.exp(mu) + (1 / t - 1)))
    noise_v, noise_a = comfy_noise(SEED, job.latent.shape, job.audio.shape, noise_inds=job.extra.get("batch_index"))
    x = torch.cat([(sigmas[0] * noise_v).reshape(b, -1), (sigmas[0] * noise_a).reshape(b, -1)], dim=1)
    nv = job.latent[0].numel()
    step_noise = torch.Generator().manual_seed(SEED)
    cut = config.cross_attention_dim
    context = torch.cat([job.positive.cond.expand(b, -1, -1), job.negative.cond.expand(b, -1, -1)])
    for i in range(STEPS):
        s, s_next = sigmas[i], sigmas[i + 1]
        video = x[:, :nv].reshape(job.latent.shape).repeat(2, 1, 1, 1, 1)
        audio = x[:, nv:].reshape(job.audio.shape).repeat(2, 1, 1, 1)
        inputs = dict(video=video.flatten(2).transpose(1, 2), audio=audio.permute(0, 2, 1, 3).flatten(2),
                      video_context=context[..., :cut], audio_context=context[..., cut:],
                      video_t=torch.full((2 * b, T * H * W), float(s) * 1000), audio_t=torch.full((2 * b, F),
                                                                                                  float(s) * 1000))
        with torch.no_grad():
            v, a = comfyui_call(path, LTX_NAME, inputs, fps=25.0)
        out = torch.cat([v.transpose(1, 2).reshape(2 * b, -1),  # back to the latents' element order
                         a.unflatten(2, (job.audio.shape[1], 16)).permute(0, 2, 1, 3).reshape(2 * b, -1)], dim=1)
        cond, uncond = (x.repeat(2, 1) - out * s).chunk(2)
        denoised = uncond + (cond - uncond) * CFG
        if s_next == 0:
            x = denoised
            continue
        sigma_down = s_next * (1 + (s_next / s - 1))
        alpha_next, alpha_down = 1 - s_next, 1 - sigma_down
        renoise = (s_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        x = (sigma_down / s) * x + (1 - sigma_down / s) * denoised
        x = (alpha_next / alpha_down) * x + torch.randn((b, 1, x.shape[1]), generator=step_noise)[:, 0] * renoise
    return x[:, :nv].reshape(job.latent.shape), x[:, nv:].reshape(job.audio.shape)


# -- serial Parallel Sampler against the references ---------------------------------------------------------------

def _errors(result, reference) -> tuple[float, float]:
    assert result.latent.shape == reference[0].shape and result.audio.shape == reference[1].shape
    return rel_err(result.latent, reference[0]), rel_err(result.audio, reference[1])


@pytest.mark.parametrize("denoise", [1.0, 0.75], ids=["t2va", "denoise0.75"])
def test_minimax_h3_one_worker_equals_ksamplers_loop(files, client1, denoise):
    """t2va from an empty latent, and a 0.75 denoise of a given (video, audio) latent (process_latent_in's audio
    scale and process_latent_out's division both read)."""
    g = torch.Generator().manual_seed(2)
    latent = None if denoise == 1.0 else (torch.randn(1, 24, h3t.T, h3t.H, h3t.W, generator=g),
                                          torch.randn(1, 32, 2, H3_AUDIO_T, generator=g))
    job = h3_job(files["minimax_h3"], denoise=denoise, latent=latent)
    reference = h3_reference(files["minimax_h3"], job)
    errors = _errors(client1.run(job), reference)
    print(f"\nMiniMax-H3 Parallel Sampler ({STEPS} euler steps, cfg {CFG}, denoise {denoise}), 1 worker vs KSampler's "
          f"loop: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert reference[1].abs().mean() > 0.1  # the audio really was sampled
    assert max(errors) <= SERIAL_RTOL


@pytest.mark.parametrize("batch_index", [None, [3, 1]], ids=["batch2", "batch_index"])
def test_ltx2_one_worker_equals_ksamplers_loop(files, client1, batch_index):
    """Two videos with their sound, euler_ancestral (step noise over the packed latent), cfg 3; and the two as
    images 3 and 1 of a batch (a LATENT's batch_index: each stream's noise drawn as prepare_noise draws it)."""
    job = ltx_job(files["ltx2"])
    if batch_index is not None:
        job = dataclasses.replace(job, extra={**job.extra, "batch_index": batch_index})
    reference = ltx_reference(files["ltx2"], job)
    errors = _errors(client1.run(job), reference)
    print(f"\nLTX-2.3 Parallel Sampler ({STEPS} euler_ancestral steps, cfg {CFG}, batch 2), 1 worker vs KSampler's "
          f"loop: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert reference[1].abs().mean() > 0.1
    assert max(errors) <= SERIAL_RTOL


# -- every exact strategy equals the serial run -------------------------------------------------------------------

STRATEGIES = {"cfg2": dict(cfg_degree=2), "ulysses2": dict(ulysses_degree=2), "ring2": dict(ring_degree=2),
              "tensor2": dict(tensor_degree=2), "ulysses2_sharded": dict(ulysses_degree=2, shard_weights=True)}


STRATEGY_STEPS = 2  # every step is the same split model call: two show the loop carries the split state


@pytest.fixture(scope="module")
def serial_run(files, client1):
    """The 1-worker run of a family's job (MiniMax-H3: dpmpp_2m, whose second step reads the first's prediction;
    LTX-2: euler_ancestral) of so many steps, each run once per module."""
    runs = {}

    def run(family: str, steps: int):
        if (family, steps) not in runs:
            make = functools.partial(h3_job, sampler="dpmpp_2m") if family == "minimax_h3" else ltx_job
            runs[family, steps] = client1.run(make(files[family], steps=steps))
        return runs[family, steps]

    return run


def _check_against_serial(client, files, serial_run, family: str, strategy: dict) -> None:
    """The family's job on `strategy` (STRATEGY_STEPS steps) on `client`'s workers equals the 1-worker run."""
    make = functools.partial(h3_job, sampler="dpmpp_2m") if family == "minimax_h3" else ltx_job
    result = client.run(make(files[family], StrategySpec(**strategy), steps=STRATEGY_STEPS))
    serial = serial_run(family, STRATEGY_STEPS)
    errors = _errors(result, (serial.latent, serial.audio))
    print(f"\n{family} Parallel Sampler, {StrategySpec(**strategy).label()} vs 1 worker: video {errors[0]:.1e}, "
          f"audio {errors[1]:.1e}")
    assert max(errors) <= EXACT_RTOL


@pytest.mark.parametrize("family", ["minimax_h3", "ltx2"])
@pytest.mark.parametrize("strategy", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_exact_strategies_equal_the_serial_run(files, client2, serial_run, family, strategy):
    """MiniMax-H3's audio and video rows split as one packed sequence, LTX-2's as two streams over the same ranks;
    the CFG group takes one branch each, tensor parallelism half of every layer's heads and units."""
    _check_against_serial(client2, files, serial_run, family, strategy)


@pytest.mark.parametrize("family, strategy", [("minimax_h3", dict(cfg_degree=2, ulysses_degree=2)),
                                              ("ltx2", dict(ulysses_degree=2, ring_degree=2)),
                                              ("ltx2", dict(cfg_degree=2, pipefusion_degree=2,
                                                            warmup_steps=STRATEGY_STEPS))],
                         ids=["minimax_h3-cfg2xulysses2", "ltx2-ulysses2xring2", "ltx2-cfg2xpipefusion2"])
def test_hybrids_on_four_equal_the_serial_run(files, client4, serial_run, family, strategy):
    """Hybrids on four workers (the session's client4, which the families' own modules start): CFG over Ulysses for
    MiniMax-H3's packed stream, Ulysses over Ring for LTX-2's two streams (13 audio rows: uneven shards), and CFG
    over PipeFusion's stages for LTX-2 (every step warm-up: exact; the stale steps' error is measured below)."""
    _check_against_serial(client4, files, serial_run, family, strategy)


def test_minimax_h3_pipefusion_is_exact_in_warmup_and_beats_naive_patch(files, client2, serial_run):
    """PipeFusion over MiniMax-H3's packed stream (2 stages, its patches runs of the [audio | video] rows), per step
    as under a stock sampler: all warm-up it equals the serial run; after one warm-up step each step reads the
    other patches' K/V as the previous step left them, nearer the serial run than naive patch's halves, which never
    see each other."""
    serial = serial_run("minimax_h3", STEPS)
    runs = {name: client2.run(h3_job(files["minimax_h3"], StrategySpec(**strategy), sampler="dpmpp_2m"))
            for name, strategy in (("warm", dict(pipefusion_degree=2, warmup_steps=STEPS)),
                                   ("stale", dict(pipefusion_degree=2, warmup_steps=1)),
                                   ("naive", dict(naive_patch_degree=2)))}
    for k, stream in enumerate(("latent", "audio")):
        err = {name: rel_err(getattr(run, stream), getattr(serial, stream)) for name, run in runs.items()}
        print(f"\nMiniMax-H3 Parallel Sampler {stream}, {STEPS} dpmpp_2m steps: pp2 all warm-up {err['warm']:.1e}, "
              f"pp2 1 warm-up step {err['stale']:.1e}, naive patch 2 {err['naive']:.1e}")
        assert err["warm"] <= EXACT_RTOL
        assert 10 * EXACT_RTOL < err["stale"] < err["naive"] / 2  # the stale K/V was read, and helps


PIPEFUSION_STEPS = 6  # euler: the sampler's own noise (euler_ancestral's) would hide what the stale K/V costs


def test_ltx2_pipefusion_is_exact_in_warmup_and_beats_naive_patch(files, client1, client2):
    """PipeFusion over LTX-2's two streams (2 stages of one block, patches runs of the video rows, the audio rows
    with patch 0; strategies/two_stream_pipefusion.py), per step as under a stock sampler: all warm-up it equals the
    serial run; after one warm-up step each step's four stream attentions read the other patches' K/V as the
    previous step left them, nearer the serial run than naive patch's halves (each with its share of the audio
    rows), which never see each other. Measured (6 euler steps, cfg 3; video, audio rel. L2 vs 1 worker): pp2 all
    warm-up ~1e-7; pp2 with 1 warm-up step 0.042, 0.061; naive patch 2 0.193, 0.161."""
    make = functools.partial(ltx_job, files["ltx2"], sampler="euler", steps=PIPEFUSION_STEPS)
    serial = client1.run(make())
    runs = {name: client2.run(make(StrategySpec(**strategy)))
            for name, strategy in (("warm", dict(pipefusion_degree=2, warmup_steps=PIPEFUSION_STEPS)),
                                   ("stale", dict(pipefusion_degree=2, warmup_steps=1)),
                                   ("naive", dict(naive_patch_degree=2)))}
    for stream in ("latent", "audio"):
        err = {name: rel_err(getattr(run, stream), getattr(serial, stream)) for name, run in runs.items()}
        print(f"\nLTX-2.3 Parallel Sampler {stream}, {PIPEFUSION_STEPS} euler steps: pp2 all warm-up "
              f"{err['warm']:.1e}, pp2 1 warm-up step {err['stale']:.1e}, naive patch 2 {err['naive']:.1e}")
        assert err["warm"] <= EXACT_RTOL  # whole-call passes through the stages: the serial call's sums
        assert 10 * EXACT_RTOL < err["stale"] < err["naive"] / 2  # the stale K/V was read, and helps


# -- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, change, sentence", [
    ("ltx2", dict(strategy=StrategySpec(patch_degree=2)),
     r"^Parallel Sampler runs LTX-2\.3 128-wide x 2 on CFG, Ulysses, Ring, tensor parallelism, PipeFusion and naive "
     r"patch \(and sharded weights\), not on displaced patch parallelism yet; set patch_degree to 1\.$"),
    ("ltx2", dict(strategy=StrategySpec(pipefusion_degree=2, ring_degree=2)),
     r"^Parallel Sampler runs LTX-2\.3 128-wide x 2's PipeFusion on whole stages \(beside CFG\), not inside "
     r"Ulysses, Ring or tensor parallelism yet; set ulysses_degree, ring_degree and tensor_degree to 1, or "
     r"pipefusion_degree to 1\.$"),
    ("ltx2", dict(strategy=StrategySpec(batch_degree=2)),
     r"^batch parallelism does not cut LTX-2\.3 128-wide x 2's audio latent yet; set batch_degree to 1"),
    ("minimax_h3", dict(strategy=StrategySpec(cache="first_block")),
     r"^the step cache does not run on MiniMax-H3 96-wide's audio-video steps yet; set the Strategy Selector's "
     r"cache to off\.$"),
    ("minimax_h3", dict(batch=2), r"^the latent holds 2 videos but MiniMax-H3 96-wide runs one video per prompt, "
                                  r"as ComfyUI's model does; set the empty latent's batch size to 1\.$"),
])
def test_what_the_loop_cannot_run_is_refused_in_one_sentence(files, family, change, sentence):
    make = h3_job if family == "minimax_h3" else ltx_job
    strategy = change.get("strategy", StrategySpec())
    job = make(files[family], strategy, batch=change["batch"]) if "batch" in change else make(files[family], strategy)
    with pytest.raises(ConfigError, match=sentence) as refused:
        validate_job(job, strategy.world_size)
    assert ". " not in str(refused.value)


def test_a_job_without_its_audio_latent_is_refused(files):
    """The audio half of the latent is what both families denoise beside the video: a job that lacks it stops before
    any work, naming the node that makes the whole latent."""
    for family, make, node in (("minimax_h3", h3_job, "EmptyMiniMaxH3LatentAV"), ("ltx2", ltx_job,
                                                                                 "LTXVConcatAVLatent")):
        job = dataclasses.replace(make(files[family]), audio=None)
        with pytest.raises(ConfigError, match=node):
            validate_job(job, 1)


# -- the node: Parallel Sampler's LATENT in and out ----------------------------------------------------------------

class NestedTensor:
    """comfy.nested_tensor.NestedTensor as ComfyUI 2026's AV latents hold it: its streams, unbind(), is_nested."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors


def test_parallel_sampler_node_takes_and_returns_the_nested_latent(files, client2, serial_run, monkeypatch):
    """EmptyMiniMaxH3LatentAV's NestedTensor through Parallel Sampler (a text-only prompt's token tags, as
    MiniMax-H3's text encoder always attaches them): the workers' own loop runs it (no per-call routing), split by
    Ulysses over two workers, and the node returns KSampler's LATENT, the same NestedTensor class over both
    streams, equal to the 1-worker run (which equals KSampler's loop: the tests above)."""
    from test_nodes import FakeHost  # first: it stands in comfy_api.latest, which the node modules import

    from nodes import convert, route, sampler as sampler_node

    import parallel_runtime.runtime.client as client_module

    monkeypatch.setattr(client_module, "get_client", lambda devices, p2p="auto": client2)
    job = h3_job(files["minimax_h3"], sampler="dpmpp_2m")
    tags = {"minimax_token_tags": torch.ones(h3t.TEXT_LEN, dtype=torch.long)}
    positive, negative = [[job.positive.cond, dict(tags)]], [[job.negative.cond, dict(tags)]]
    latent = {"samples": NestedTensor([job.latent, job.audio])}
    assert route.worker_loop_gap(None, CFG, "dpmpp_2m", "simple", positive, negative, latent, True) is None
    handle = convert.model_handle(files["minimax_h3"], "default", "cpu:2",
                                  convert.strategy_choice("manual", ulysses_degree=2))
    out, summary = sampler_node.sample(handle, SEED, STEPS, CFG, "dpmpp_2m", "simple", positive, negative, latent,
                                       host=FakeHost())
    assert type(out["samples"]) is NestedTensor and "ulysses2" in summary
    (video, audio), serial = out["samples"].unbind(), serial_run("minimax_h3", STEPS)
    errors = rel_err(video, serial.latent), rel_err(audio, serial.audio)
    print(f"\nParallel Sampler node, MiniMax-H3 on ulysses2 vs the 1-worker run: video {errors[0]:.1e}, audio "
          f"{errors[1]:.1e}")
    assert max(errors) <= EXACT_RTOL


def test_cancel_stops_the_loop_at_the_next_step(files):
    """A cancel during step 1 stops the audio-video loop before step 3 (each step's vote is read one step later, as
    in every loop of the Denoiser), raising Cancelled with no result: one rank in-process."""
    from parallel_runtime.distributed.comm import Comm
    from parallel_runtime.distributed.topology import Topology
    from parallel_runtime.errors import Cancelled
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.strategies.av_sampling import AudioVideoDenoiser

    context, steps_done = AttentionContext(), []
    adapter = h3t.build_adapter(files["minimax_h3"], context)
    denoiser = AudioVideoDenoiser(adapter, Topology(), Comm(Topology()), context)
    with pytest.raises(Cancelled), torch.no_grad():
        denoiser.run(h3_job(files["minimax_h3"]), progress=lambda i, n: steps_done.append(i),
                     cancel_requested=lambda: len(steps_done) >= 1)
    assert steps_done == [1, 2]  # asked after step 1: step 2's vote sees it, step 3 does not start


def test_parallel_sampler_on_load_parallel_dits_model(files, h3_host, client2, serial_run, monkeypatch):
    """The MODEL of Load Parallel DiT as ComfyUI 2026 builds it for the file (the fake host of test_model_path_2026
    with its MiniMaxH3 class: test_minimax_h3_door), under Parallel Sampler: the prompt goes through the diffusion
    model's preprocess_text_embeds as MiniMaxH3.extra_conds sends it, the workers' loop runs the NestedTensor, and
    the result equals the 1-worker run."""
    from test_nodes import FakeHost  # first: it stands in comfy_api.latest, which the node modules import

    import test_model_path_2026 as host_2026
    from nodes import sampler as sampler_node

    class Host(FakeHost):
        def fixed_latent(self, model, latent):  # comfy.sample.fix_empty_latent_channels: a nested latent as it is
            return latent

    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda devices, *a, **k: client2)
    model = host_2026._model(files["minimax_h3"], "cpu:2", ulysses_degree=2)
    # The fake patcher keeps wrappers by (kind, key); ComfyUI's ModelPatcher as {kind: {key: [wrapper]}}.
    model.wrappers = {kind: {key: [fn]} for (kind, key), fn in model.wrappers.items()}
    job = h3_job(files["minimax_h3"], sampler="dpmpp_2m")
    tags = {"minimax_token_tags": torch.ones(h3t.TEXT_LEN, dtype=torch.long)}
    out, summary = sampler_node.sample(model, SEED, STEPS, CFG, "dpmpp_2m", "simple", [[job.positive.cond, tags]],
                                       [[job.negative.cond, tags]], {"samples": NestedTensor([job.latent, job.audio])},
                                       host=Host())
    (video, audio), serial = out["samples"].unbind(), serial_run("minimax_h3", STEPS)
    errors = rel_err(video, serial.latent), rel_err(audio, serial.audio)
    print(f"\nParallel Sampler on Load Parallel DiT's MODEL (ComfyUI 2026's MiniMaxH3), ulysses2 vs the 1-worker run: "
          f"video {errors[0]:.1e}, audio {errors[1]:.1e} ({summary})")
    assert "one runtime job per model call" not in summary  # the workers' own loop, not ComfyUI's sampler
    assert max(errors) <= EXACT_RTOL
