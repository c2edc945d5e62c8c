"""Batch parallel (strategies/batch.py): each group of ranks denoises its share of the latent's images, and every
image equals its serial self. Both doors: Parallel Sampler's job and a stock sampler's model call."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_conditioning, make_job, rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.batch import batch_shares, group_speeds

# A batch group runs the same arithmetic on fewer images: only how BLAS blocks a smaller batch differs (the
# EXACT_RTOL of tests/test_parallel.py; measured 0 to 4e-7).
EXACT_RTOL = 1e-4


def test_batch_shares_follow_the_groups_speeds():
    """Contiguous rows, at least one image a group, each next image where it finishes soonest."""
    def counts(images, speeds):
        return [len(r) for r in batch_shares(images, speeds)]

    assert counts(4, (1, 1)) == [2, 2] and counts(3, (1, 1)) == [2, 1] and counts(5, (1, 1, 1)) == [2, 2, 1]
    assert counts(8, (3, 1)) == [6, 2] and counts(3, (1, 2)) == [1, 2] and counts(2, (9, 1)) == [1, 1]
    assert batch_shares(5, (1, 1)) == [range(0, 3), range(3, 5)]
    # A group's speed is its ranks' weights summed (batch outermost: ranks 0-1 are group 0 under batch2 x ulysses2).
    assert group_speeds(S(batch_degree=2, ulysses_degree=2, device_weights=(3, 3, 1, 1))) == (6.0, 2.0)
    assert group_speeds(S(batch_degree=2)) == (1.0, 1.0)


def _images_job(path, strategy, images, **kw) -> Job:
    """`images` different latents under one prompt each (a batch of prompts: the conditioning cut per group)."""
    torch.manual_seed(5)
    job = make_job(path, strategy, steps=4, **kw)
    prompts = [make_conditioning(10 + k) for k in range(images)]
    positive = dataclasses.replace(job.positive, cond=torch.cat([p.cond for p in prompts]),
                                   pooled=torch.cat([p.pooled for p in prompts]))
    return dataclasses.replace(job, latent=torch.randn(images, 16, 16, 16) * 0.1, positive=positive)


@pytest.mark.parametrize("images,sampler,weights", [(4, "euler", ()), (3, "euler_ancestral", ()), (4, "euler", (3, 1))],
                         ids=["batch4", "batch3-uneven-ancestral", "batch4-weighted-3:1"])
def test_batch_degree_2_equals_serial_per_image(tiny_path, client1, client2, images, sampler, weights):
    """Each image as serial gives it: its rows of the whole batch's noise (and ancestral noise), its prompt row."""
    serial = client1.run(_images_job(tiny_path, S(), images, sampler=sampler)).latent
    result = client2.run(_images_job(tiny_path, S(batch_degree=2, device_weights=weights), images, sampler=sampler))
    assert result.latent.shape == serial.shape
    assert max(rel_err(result.latent[k], serial[k]) for k in range(images)) <= EXACT_RTOL
    assert rel_err(serial[0], serial[1]) > 0.1  # the images differ, so a swapped or repeated row would show


def test_batch_2_times_ulysses_2_on_four_workers_equals_serial(tiny_path, client1, client4):
    serial = client1.run(_images_job(tiny_path, S(), 4)).latent
    result = client4.run(_images_job(tiny_path, S(batch_degree=2, ulysses_degree=2), 4))
    assert max(rel_err(result.latent[k], serial[k]) for k in range(4)) <= EXACT_RTOL


def test_batch_degree_2_splits_a_stock_samplers_model_call(tiny_path, client1, client2):
    """A model call of 3 images x (cond, uncond): each group takes its images of both chunks, and the output rows
    come back in the call's order."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, 16, 16, generator=g)
    t = torch.linspace(0.3, 0.8, 6)  # a timestep per row, so rows put back in the wrong place would show
    job = Job(ModelSpec(tiny_path), S(), SamplingSpec(steps=1), x, make_conditioning(1), make_conditioning(2),
              timestep=t)
    serial = client1.run(job).latent
    result = client2.run(dataclasses.replace(job, strategy=S(batch_degree=2))).latent
    assert result.shape == serial.shape == (6, 16, 16, 16)
    assert rel_err(result, serial) <= EXACT_RTOL


def test_batch_degree_above_the_images_is_one_sentence_before_work(tiny_path, client2):
    with pytest.raises(ConfigError, match=r"batch_degree=2 splits images, but the latent holds 1; set the Empty "
                                          r"Latent's batch_size to 2 or more, or lower batch_degree"):
        client2.run(make_job(tiny_path, S(batch_degree=2)))


def test_batch_group_cuts_a_controlnet_hint_of_several_images():
    """A hint of B images is tiled to the whole batch (broadcast_image_to) and cut to the group's rows; one image
    serves every row."""
    from types import SimpleNamespace

    from parallel_runtime.strategies.control import _batched

    tokens = torch.arange(3.0).reshape(3, 1, 1)  # hint images 0, 1, 2 of a batch of 4: the 4th reuses image 0
    group = SimpleNamespace(batch=2, whole_batch=4, batch_rows=slice(2, 4), count=2)
    assert _batched(tokens, group).flatten().tolist() == [2.0, 0.0, 2.0, 0.0]  # rows 2, 3, once per branch
    one = SimpleNamespace(batch=2, whole_batch=4, batch_rows=slice(2, 4), count=1)
    assert _batched(tokens[:1], one).flatten().tolist() == [0.0, 0.0]


def test_batch_groups_take_the_step_caches_decisions_of_the_whole_batch(tiny_path, client1, client2):
    """The First-Block Cache's change is measured over the whole batch, as serial measures it in one pass: both
    groups skip serial's steps, having read serial's change of each step (a group's own images alone differ from
    it by 1e-2 or more), and every image equals serial's cached image."""
    cache = dict(cache="first_block", cache_threshold=0.65)
    serial = client1.run(_images_job(tiny_path, S(**cache), 3))
    result = client2.run(_images_job(tiny_path, S(batch_degree=2, **cache), 3))
    skipped = serial.stats[0]["cache_skipped"]
    assert skipped and [stats["cache_skipped"] for stats in result.stats] == [skipped, skipped]
    reference = serial.stats[0]["cache_changes"]
    for stats in result.stats:
        for (step, change), (ref_step, ref) in zip(stats["cache_changes"], reference, strict=True):
            assert step == ref_step and abs(change - ref) < 1e-5 * ref  # float32 sums of other row orders: ~1e-7
    assert max(rel_err(result.latent[k], serial.latent[k]) for k in range(3)) <= EXACT_RTOL
