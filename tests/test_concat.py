"""Concat-conditioned Flux models (Fill: 80 extra input channels, Canny/Depth: 16): ComfyUI's c_concat rides with
each branch's conditioning, is packed with the latent's tokens and split with them under every strategy.

The reference is diffusers' own FluxTransformer2DModel fed ComfyUI's way: the c_concat channels concatenated to
the input-scaled latent before patchify, so a wrong channel order, a mis-sliced shard of the concat rows or a
branch's concat given to the other branch all show as O(1e-1) errors.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import diffusers_flux_call, make_conditioning, rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.registry import read_model
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.weights.checkpoint import open_checkpoint

pytestmark = pytest.mark.timeout(600)

# Exact strategies only reorder float32 sums (~1e-7 per op over a few blocks); a wrong concat row is ~1e-1.
EXACT_RTOL = 1e-4
H, W = 12, 16  # latent; 6 x 8 = 48 tokens: uneven shards at no degree, but rows of 8 cut by Ulysses/Ring
VARIANTS = {"fill": 80, "canny": 16}


def config_of(extra: int):
    return dataclasses.replace(TINY, in_channels=4 * (16 + extra), out_channels=64)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    extra = VARIANTS[request.param]
    path = write_checkpoint(str(tmp_path_factory.mktemp(request.param) / f"flux-{request.param}.safetensors"),
                            config_of(extra), seed=4)
    return request.param, extra, path


def branches(extra: int):
    """(positive, negative), each with its own concat image: a mix-up between branches is visible."""
    g = torch.Generator().manual_seed(9)
    pos, neg = make_conditioning(1, 7), make_conditioning(2, 7)
    return (dataclasses.replace(pos, concat=torch.randn(1, extra, H, W, generator=g)),
            dataclasses.replace(neg, concat=torch.randn(1, extra, H, W, generator=g)))


def call_job(path: str, extra: int, strategy: S) -> Job:
    """One stock-sampler model call: [cond chunk; uncond chunk] of input-scaled x at the model's timestep."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, H, W, generator=g)
    pos, neg = branches(extra)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x, pos, neg, timestep=torch.full((2,), 0.7))


def test_config_reads_the_concat_channels(variant):
    name, extra, path = variant
    with open_checkpoint(path) as reader:
        _, _, config = read_model(reader)
    assert (config.concat_channels, config.latent_channels) == (extra, 16)
    assert config.title == {"fill": "Flux.1 Fill dev", "canny": "Flux.1 Canny/Depth dev"}[name]


def test_one_worker_equals_diffusers_on_comfyuis_concatenated_input(variant, client1):
    _, extra, path = variant
    job = call_job(path, extra, S())
    out = client1.run(job).latent
    assert out.shape == (2, 16, H, W)  # the output keeps the latent's 16 channels
    # One float32 forward in another op order (our attention processor vs diffusers'): ~1e-6.
    assert rel_err(out, diffusers_flux_call(path, job)) < 1e-5


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_model_call_exact_strategies_equal_one_worker(variant, client1, client2, strategy):
    """A call without a schedule step is PipeFusion's warm-up (the whole image, exact)."""
    _, extra, path = variant
    serial = client1.run(call_job(path, extra, S())).latent
    assert rel_err(client2.run(call_job(path, extra, strategy)).latent, serial) < EXACT_RTOL


def denoise_job(path: str, extra: int, strategy: S) -> Job:
    pos, neg = branches(extra)
    return Job(ModelSpec(path), strategy, SamplingSpec(seed=5, steps=4, cfg=2.5), torch.zeros(1, 16, H, W),
               pos, neg)


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=4)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_all_warmup"])
def test_parallel_sampler_exact_strategies_equal_one_worker(variant, client1, client2, strategy):
    _, extra, path = variant
    serial = client1.run(denoise_job(path, extra, S())).latent
    assert rel_err(client2.run(denoise_job(path, extra, strategy)).latent, serial) < EXACT_RTOL


def test_concat_changes_the_result(variant, client1):
    """The concat image is read at all: another image gives another prediction."""
    _, extra, path = variant
    job = call_job(path, extra, S())
    other = dataclasses.replace(job, positive=dataclasses.replace(job.positive, concat=job.positive.concat * 0))
    first, second = client1.run(job).latent, client1.run(other).latent
    assert rel_err(second[:1], first[:1]) > 1e-2 and rel_err(second[1:], first[1:]) < 1e-6


def test_bad_concat_is_one_sentence_before_work(variant, tiny_path, client1):
    _, extra, path = variant
    job = call_job(path, extra, S())
    with pytest.raises(ConfigError, match=r"reads \d+ image channels beside the latent, and the positive "
                                          r"conditioning carries none; feed it through InpaintModelConditioning"):
        client1.run(dataclasses.replace(job, positive=dataclasses.replace(job.positive, concat=None)))
    wrong = dataclasses.replace(job.negative, concat=job.negative.concat[:, :-1])
    with pytest.raises(ConfigError, match=rf"negative conditioning's concat image has shape \(1, {extra - 1}, {H}, "
                                          rf"{W}\) but this model needs \[batch, {extra}, {H}, {W}\]"):
        client1.run(dataclasses.replace(job, negative=wrong))
    plain = dataclasses.replace(job, model=ModelSpec(tiny_path))
    with pytest.raises(ConfigError, match=r"carries \d+ concat channels \(an inpaint or control image\), which this "
                                          r"Flux.1 dev model does not read"):
        client1.run(plain)
