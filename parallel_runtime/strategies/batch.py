"""Batch parallel: each group of ranks with one `batch` coordinate denoises its share of the latent's images.

An image's denoise reads no other image (ComfyUI's samplers work elementwise over the batch; a DiT attends within
one image), so the groups exchange nothing per step: each runs the job on its rows, with every other degree inside
the group, and the rows are gathered once at the end. What ComfyUI derives from the whole batch is derived from
the whole batch and then cut, so every image equals its serial self to fp32 round-off:
- the starting noise: prepare_noise's draw for the whole batch (`batch_index` included), cut to the rows;
- an ancestral sampler's noise of each step: drawn at the whole batch's shape (RegionSampler.batch_rows);
- conditionings of 1 or B rows: repeated to the batch as comfy.utils.repeat_to_batch_size does, then cut;
- ControlNet hints: tiled to the batch as broadcast_image_to does, then cut (Branches.batch_rows);
- an nvfp4 layer's input amax, which one device takes over the whole batch: reduced over the batch group too
  (forward_amax.SPLIT_DIMS).

A model call of a stock sampler is cut the same way, per chunk: ComfyUI's cond and uncond chunks each hold the batch.

Shares follow the groups' speeds (their ranks' device_weights, summed): contiguous rows, at least one image per
group, each next image to the group that would finish it soonest, so 3 images on a fast and a slow card go 2 and 1,
and 8 images on cards of speeds 3 and 1 go 6 and 2.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..distributed.comm import Comm
from ..distributed.topology import Topology
from ..sampling.noise import prepare_noise
from ..spec import Conditioning, Job, StrategySpec


def batch_shares(batch: int, speeds: Sequence[float]) -> list[range]:
    """Each group's contiguous rows of `batch` images, in proportion to its `speed` (every group gets at least one
    image: validate_strategy refuses a batch smaller than the groups)."""
    counts = [1] * len(speeds)
    for _ in range(batch - len(speeds)):
        soonest = min(range(len(speeds)), key=lambda g: (counts[g] + 1) / speeds[g])
        counts[soonest] += 1
    starts = [sum(counts[:g]) for g in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def group_speeds(s: StrategySpec) -> tuple[float, ...]:
    """Each batch group's speed: the sum of its ranks' device_weights (all equal without them)."""
    if not s.balanced:
        return (1.0,) * s.batch_degree
    t = Topology.from_strategy(s)
    return tuple(sum(s.device_weights[r] for r in range(t.world_size) if t.coords(r)["batch"] == g)
                 for g in range(s.batch_degree))


def repeat_to_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    """comfy.utils.repeat_to_batch_size: a conditioning tensor tiled (or cut) to the latent's batch."""
    if t.shape[0] > batch:
        return t[:batch]
    if t.shape[0] < batch:
        return t.repeat(-(-batch // t.shape[0]), *([1] * (t.ndim - 1)))[:batch]
    return t


def _cut(t: torch.Tensor | None, rows: range, batch: int) -> torch.Tensor | None:
    """A conditioning tensor's rows for these images: one row stays (every image reads it); more are repeated to
    the batch first, as comfy.utils.repeat_to_batch_size does."""
    if t is None or t.shape[0] == 1:
        return t
    return repeat_to_batch(t, batch)[rows.start:rows.stop]


def _cut_conditioning(c: Conditioning | None, rows: range, batch: int) -> Conditioning | None:
    if c is None:
        return None
    return dataclasses.replace(
        c, cond=_cut(c.cond, rows, batch), pooled=_cut(c.pooled, rows, batch),
        references=tuple(_cut(r, rows, batch) for r in c.references), concat=_cut(c.concat, rows, batch),
        attention_mask=_cut(c.attention_mask, rows, batch), clip_vision=_cut(c.clip_vision, rows, batch),
        glyph=_cut(c.glyph, rows, batch), camera=_cut(c.camera, rows, batch),
        vace=_cut(c.vace, rows, batch), llama=_cut(c.llama, rows, batch), pose=_cut(c.pose, rows, batch),
        face=_cut(c.face, rows, batch))


def call_rows(job: Job, rows: range) -> torch.Tensor:
    """The rows of a job's latent that hold these images: the images themselves, or of a model call each chunk's."""
    chunks = job.latent.shape[0] // job.batch
    return torch.cat([torch.arange(k * job.batch + rows.start, k * job.batch + rows.stop) for k in range(chunks)])


def cut_job(job: Job, rows: range) -> Job:
    """The job of one batch group: its images' latent rows, timesteps and conditionings, the whole batch's noise
    cut to them (`extra["batch_rows"]`: start, stop and the whole batch)."""
    index = call_rows(job, rows)
    timestep = job.timestep[index] if job.timestep is not None and job.timestep.shape[0] > 1 else job.timestep
    extra = dict(job.extra, batch_rows=[rows.start, rows.stop, job.batch])
    return dataclasses.replace(job, latent=job.latent[index], timestep=timestep, extra=extra,
                               positive=_cut_conditioning(job.positive, rows, job.batch),
                               negative=_cut_conditioning(job.negative, rows, job.batch))


def job_noise(job: Job) -> torch.Tensor:
    """comfy.sample.prepare_noise for the job's images: drawn for the whole batch, then cut to this job's rows."""
    rows = job.batch_rows
    if rows is None:
        return prepare_noise(job.latent, job.sampling.seed, job.extra.get("batch_index"))
    whole = job.latent.new_empty((job.images, *job.latent.shape[1:]))  # its shape and dtype are what count
    return prepare_noise(whole, job.sampling.seed, job.extra.get("batch_index"))[rows]


def gather_batch(comm: Comm, part: torch.Tensor, job: Job, shares: list[range], group: int) -> torch.Tensor:
    """Every group's result rows (a group result rank's `part`) in the whole job's order, on each group result
    rank: the shares may differ by an image, so each part is padded to the largest for the all-gather."""
    chunks = part.shape[0] // len(shares[group])
    largest = max(len(r) for r in shares) * chunks
    padded = part.new_zeros((largest, *part.shape[1:]))
    padded[:part.shape[0]] = part
    parts = comm.all_gather(padded.contiguous(), comm.group("batch"), op="batch")
    out = part.new_empty((job.latent.shape[0], *part.shape[1:]))
    for rows, got in zip(shares, parts):
        out[call_rows(job, rows)] = got[:len(rows) * chunks]
    return out


def largest_share(s: StrategySpec, batch: int) -> int:
    """The most images one batch group denoises: what sets its time and memory (the whole batch without batch
    parallel)."""
    if s.batch_degree == 1 or batch < s.batch_degree:
        return batch
    return max(len(r) for r in batch_shares(batch, group_speeds(s)))
