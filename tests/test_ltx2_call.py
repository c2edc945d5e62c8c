"""LTX-2's model call on the runtime: a stock sampler's call (video x in Job.latent, audio x in Job.audio, per-frame
video sigmas with the first frame a conditioning frame at 0, the audio at its own sigma in Job.audio_timestep)
equals the family's serial forward at one worker and under CFG, Ulysses, Ring, tensor parallelism and sharded weights
on two."""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from test_ltx2 import AUDIO_FRAMES, CONFIGS, EXACT_RTOL, PROMPT, H, T, W, paths, serial_call  # noqa: F401
from test_ltx2_comfyui import comfyui_call

pytestmark = pytest.mark.timeout(300)

VIDEO_SIGMA, AUDIO_SIGMA, FPS = 0.8, 0.6, 25.0


def call_job(path: str, name: str, strategy, seed: int = 11):
    """cond and uncond chunks of one call, as LTXAVModel receives them (sigmas; prompt rows of both connectors)."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec

    config, g = CONFIGS[name], torch.Generator().manual_seed(seed)
    width = 2 * config.caption_channels if config.caption_channels else (
        config.cross_attention_dim + config.audio_cross_attention_dim)
    pos, neg = (Conditioning(torch.randn(1, PROMPT, width, generator=g), torch.zeros(1, 0)) for _ in "pn")
    timestep = torch.full((2, T), VIDEO_SIGMA)
    timestep[:, 0] = 0.0  # LTXVImgToVideo's first frame: its noise mask is 0
    video = torch.randn(2, config.in_channels, T, H, W, generator=g)
    audio = torch.randn(2, config.audio_in_channels // 16, AUDIO_FRAMES, 16, generator=g)  # 16 mel bins
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), video, pos, neg, timestep=timestep, audio=audio,
               audio_timestep=torch.full((2,), AUDIO_SIGMA), extra={"frame_rate": FPS})


def call_inputs(name: str, job) -> dict:
    """The call as test_ltx2's forward inputs: packed tokens, each connector's prompt rows, per-token timesteps in
    the model's units (sigma x 1000) and each sample's largest."""
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    config = CONFIGS[name]
    cut = config.caption_channels or config.cross_attention_dim
    context = torch.cat([job.positive.cond, job.negative.cond])
    video_t = (job.timestep * 1000)[:, :, None].expand(-1, T, H * W).flatten(1)
    audio_t = (job.audio_timestep * 1000)[:, None].expand(-1, AUDIO_FRAMES)
    x = dict(video=LTX2Adapter.pack(job.latent), audio=LTX2Adapter.pack_audio(job.audio),
             video_context=context[..., :cut], audio_context=context[..., cut:], video_t=video_t, audio_t=audio_t,
             sigma=video_t.amax(dim=1), audio_sigma=audio_t.amax(dim=1))
    return x


def in_call_shapes(job, v: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    return LTX2Adapter.unpack(v, T, H, W), LTX2Adapter.unpack_audio(a, job.audio.shape[1])


def serial_reference(path: str, name: str, job) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's forward on one rank over the same inputs (test_ltx2.serial_call), in the call's shapes."""
    return in_call_shapes(job, *serial_call(path, call_inputs(name, job), fps=FPS))


@pytest.mark.parametrize("name", CONFIGS)
def test_model_call_one_worker_equals_the_serial_forward(paths, client1, name):
    from parallel_runtime.spec import StrategySpec

    job = call_job(paths[name], name, StrategySpec())
    want_v, want_a = serial_reference(paths[name], name, job)
    result = client1.run(job)
    assert result.latent.shape == job.latent.shape and result.audio.shape == job.audio.shape
    assert want_v.abs().mean() > 0.1 and want_a.abs().mean() > 0.1  # outputs of O(1): a real comparison
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\n{name} model call, 1 worker: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL, errors  # the same forward in the worker: fp32 round-off
    # ... and ComfyUI 2026's model call on the same file (test_ltx2_comfyui.comfyui_call), the issue's parity
    comfy_v, comfy_a = in_call_shapes(job, *comfyui_call(paths[name], name, call_inputs(name, job), fps=FPS))
    errors = rel_err(result.latent, comfy_v), rel_err(result.audio, comfy_a)
    print(f"{name} model call, 1 worker vs ComfyUI's LTXAVModel: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL, errors  # fp32, another op order: ~1e-6


@pytest.mark.parametrize("strategy", [dict(cfg_degree=2), dict(ulysses_degree=2), dict(ring_degree=2),
                                      dict(tensor_degree=2), dict(ulysses_degree=2, shard_weights=True),
                                      dict(pipefusion_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "ulysses2_sharded", "pipefusion2"])
def test_model_call_exact_strategies_equal_the_serial_forward(paths, client2, strategy):
    """Both streams split over two ranks (72 video rows, 13 audio rows: 7 + 6), the chunks over the CFG pair, or
    the heads and MLP units of all six attentions and both MLPs over the tensor pair; and PipeFusion's two stages of
    one block each on a call of the schedule's warm-up (the whole call as one token set: exact)."""
    from parallel_runtime.spec import StrategySpec

    name = "ltx2.3"
    job = call_job(paths[name], name, StrategySpec(**strategy))
    want_v, want_a = serial_reference(paths[name], name, job)
    result = client2.run(job)
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\n{StrategySpec.label(StrategySpec(**strategy))} model call: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL, errors  # exact strategies reorder sums: fp32 round-off


def test_model_call_inputs_it_cannot_run_are_refused_in_one_sentence(paths):
    """validate_job (the client's check before sending anything): a wrong audio latent, audio timesteps of another
    length, displaced patch parallelism and PipeFusion inside Ulysses (not run over two streams yet) each get one
    sentence naming the fix."""
    import dataclasses

    from parallel_runtime.errors import ConfigError
    from parallel_runtime.spec import StrategySpec
    from parallel_runtime.validate import validate_job

    job = call_job(paths["ltx2.3"], "ltx2.3", StrategySpec())
    validate_job(job, 1)  # the call itself is accepted
    cases = {r"audio latent has shape \(2, 1, 13, 8\).*LTXVConcatAVLatent": dict(audio=job.audio[..., :8]),
             r"audio timestep has shape \(2, 5\)": dict(audio_timestep=torch.zeros(2, 5)),
             r"not on displaced patch parallelism yet; set patch_degree to 1\.$": dict(
                 strategy=StrategySpec(patch_degree=2)),
             r"PipeFusion on whole stages \(beside CFG\), not inside Ulysses.*or pipefusion_degree to 1\.$": dict(
                 strategy=StrategySpec(pipefusion_degree=2, ulysses_degree=2))}
    for message, change in cases.items():
        with pytest.raises(ConfigError, match=message) as refused:
            validate_job(dataclasses.replace(job, **change), change["strategy"].world_size if "strategy" in change
                         else 1)
        assert str(refused.value).count(". ") == 0  # one sentence


def test_model_call_pipefusion_reads_the_previous_calls_kv_as_the_reference_does(paths, client2):
    """Two calls of a host's schedule on PipeFusion-2 (2 patches, 1 warm-up call): the first runs whole (exact) and
    fills every stage's buffers; the second runs patch by patch and equals test_ltx2's PipeFusion reference (the
    family on one rank with a full K/V buffer per stream attention: each patch writes its fresh rows and reads the
    rest as they stand, the audio rows with patch 0), whatever the stages, to fp32 round-off. Measured: 0.0
    (bit-equal)."""
    import dataclasses

    from parallel_runtime.strategies.attention import LocalAttention
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.strategies.pipefusion import StaleKVAttention, StaleKVCache
    from parallel_runtime.spec import StrategySpec
    from test_ltx2 import shards

    name, path, nv = "ltx2.3", paths["ltx2.3"], T * H * W
    strategy = StrategySpec(pipefusion_degree=2, warmup_steps=1)
    first = dataclasses.replace(call_job(path, name, strategy), call_step=0, call_slot=0)
    second = dataclasses.replace(call_job(path, name, strategy, seed=12), call_step=1, call_slot=0)
    results = [client2.run(first), client2.run(second)]

    caches = {k: StaleKVAttention(StaleKVCache(n), LocalAttention()) for k, n in
              (("video", nv), ("audio", AUDIO_FRAMES), ("a2v", AUDIO_FRAMES), ("v2a", nv))}
    context = AttentionContext(attention=caches["video"], streams={k: caches[k] for k in ("audio", "a2v", "v2a")})

    def reference_pass(x, video_rows, audio_rows):
        for key, attention in caches.items():  # the rows whose fresh K/V the pass writes, by key stream
            attention.positions = video_rows if key in ("video", "v2a") else audio_rows
        return serial_call(path, x, video_rows, audio_rows, context, fps=FPS)

    want = [reference_pass(call_inputs(name, first), torch.arange(nv), torch.arange(AUDIO_FRAMES))]
    x = call_inputs(name, second)
    v, a = torch.empty_like(x["video"][..., :CONFIGS[name].in_channels]), torch.empty_like(x["audio"])
    for p, rows in enumerate(shards(nv, 2)):
        audio_rows = torch.arange(AUDIO_FRAMES) if p == 0 else torch.arange(0)
        v[:, rows], a[:, audio_rows] = reference_pass(x, rows, audio_rows)
    want.append((v, a))
    for k, (result, job, (want_v, want_a)) in enumerate(zip(results, (first, second), want)):
        want_v, want_a = in_call_shapes(job, want_v, want_a)
        errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
        print(f"\nPipeFusion-2 model call {k} vs the stale-K/V reference: video {errors[0]:.1e}, audio {errors[1]:.1e}")
        assert max(errors) < EXACT_RTOL, errors  # the same buffers and passes, another stage split: fp32 round-off
    fresh = in_call_shapes(second, *serial_call(path, x, fps=FPS))
    assert rel_err(results[1].latent, fresh[0]) > 10 * EXACT_RTOL  # the second call did read stale K/V
