"""SkipLayerGuidance on the workers: ComfyUI's patches_replace skips ((kind, index) keys, Job.skip_blocks) run as
the block's output being its input, under every exact strategy, for one model call of a stock sampler.

The reference is diffusers' Flux with those blocks swapped for their input; skipping nothing, or the wrong block,
is off by O(1e-1).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import diffusers_flux_call, make_conditioning, rel_err
from parallel_runtime.models.families.pixart import PixArtConfig
from parallel_runtime.models.families.sd3 import SD3Config
from parallel_runtime.models.registry import family_of
from parallel_runtime.models.tiny import TINY
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

EXACT_RTOL = 1e-4  # exact strategies reorder float32 sums (~1e-7 per op)
SKIP = (("double_block", 1), ("single_block", 0))  # TINY: 2 double + 2 single blocks


def call(path: str, strategy: S = S(), skip=SKIP) -> Job:
    x = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(4))
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x, make_conditioning(1), make_conditioning(2),
               timestep=torch.full((2,), 0.6), skip_blocks=skip)


def test_one_worker_equals_diffusers_with_the_blocks_skipped(tiny_path, client1):
    out = client1.run(call(tiny_path)).latent
    # One float32 forward in another op order (our attention processor vs diffusers'): ~1e-6.
    assert rel_err(out, diffusers_flux_call(tiny_path, call(tiny_path), skip=SKIP)) < 1e-5
    assert rel_err(out, client1.run(call(tiny_path, skip=())).latent) > 1e-2  # the skip changed something


def test_a_skip_does_not_outlive_its_job(tiny_path, client1):
    client1.run(call(tiny_path))
    plain = client1.run(call(tiny_path, skip=())).latent
    assert rel_err(plain, diffusers_flux_call(tiny_path, call(tiny_path))) < 1e-5


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_exact_strategies_equal_one_worker(tiny_path, client1, client2, strategy):
    """PipeFusion-2 holds one block list per stage here: each stage skips its own."""
    serial = client1.run(call(tiny_path)).latent
    assert rel_err(client2.run(call(tiny_path, strategy)).latent, serial) < EXACT_RTOL


def test_keys_map_onto_each_familys_block_list():
    flux = family_of(TINY)
    # Single blocks follow the double ones; indices past a list, and kinds ComfyUI's model lacks, change nothing.
    assert flux.replaced_blocks(TINY, [("double_block", 1), ("single_block", 0), ("single_block", 9),
                                       ("triple_block", 0)]) == {1, 2}
    sd3 = SD3Config(hidden_size=128, num_layers=4, pos_embed_max_size=16, context_dim=32, pooled_dim=16)
    assert family_of(sd3).replaced_blocks(sd3, [("double_block", 3), ("single_block", 0)]) == {3}
    pixart = PixArtConfig(hidden_size=144, num_layers=2, micro_condition=False, caption_channels=32)
    assert family_of(pixart).replaced_blocks(pixart, [("double_block", 0)]) == frozenset()  # ComfyUI's reads none


def test_skipping_every_block_leaves_the_embedding_and_head(tiny_path, client1):
    everything = tuple(("double_block", i) for i in range(2)) + tuple(("single_block", i) for i in range(2))
    job = dataclasses.replace(call(tiny_path), skip_blocks=everything)
    assert rel_err(client1.run(job).latent, diffusers_flux_call(tiny_path, job, skip=everything)) < 1e-5
