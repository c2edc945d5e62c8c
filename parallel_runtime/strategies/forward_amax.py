"""Which ranks a quantized layer's input amax spans: those holding a part of the same forward pass.

A rank's nvfp4 kernel layers take their input scale from the amax of the whole pass (weights/input_amax.py), as
ComfyUI's single device does. The pass is split over every dimension but PipeFusion's stages (which run other
blocks): the Ulysses x Ring shards, naive and displaced patches, tensor-parallel slices (a row-parallel layer's input
columns) and, where one device batches the positive and negative into one pass (one token layout: ComfyUI's
calc_cond_batch, the Denoiser's Branches), the CFG branches. Max is associative, so the amax is reduced over each
such dimension's existing group in turn: no process group (no NCCL communicator) is added for it.

Cost per forward pass: one all-reduce of one float32 per split dimension (one for Ulysses-2 or Ring-2, two for
CFG-2 x Ulysses-2) for each distinct input of such a layer, i.e. one per layer ComfyUI holds (q, k and v of one
input share one, as ComfyUI's fused qkv does): 19 per step on the demo model in nvfp4, about 300 on Flux.1 dev
(0.4 ms each over gloo on a loaded 2-core CPU); none where the rank holds the whole pass.

PipeFusion runs one patch at a time after warm-up, where a single device would see the whole latent, which no
rank has: there each patch's amax is over that patch's tokens (and the stage's Ulysses group), as if the patch were
the image, one more approximation beside its stale K/V; warm-up steps run the whole image and equal serial.
Displaced patch parallelism reduces over its patches in its warm-up steps (which then equal serial); after them each
patch's amax is its own (`skip=("patch",)`), like PipeFusion's: a reduce there would queue behind the step's K/V
all-gathers on the same communicator and undo their overlap.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..distributed.comm import Comm
from ..spec import Job

# "sp": Ring x Ulysses, one group; "batch": one device's pass holds the whole batch (batch parallel cuts it)
SPLIT_DIMS = ("sp", "naive_patch", "patch", "tensor", "batch")


def forward_amax_reduce(comm: Comm, job: Job, prompt_tokens: int = 0,
                        skip: tuple[str, ...] = ()) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The all-reduce (max) over the ranks of this rank's forward pass, for the model's InputAmax; None where
    this rank holds all of it. `prompt_tokens`: the family's prompt padding (two prompts that pad to one length
    batch together, Conditioning.signature)."""
    negative = job.negative
    batched = negative is None or negative.signature(prompt_tokens) == job.positive.signature(prompt_tokens)
    groups = [comm.group(d) for d in SPLIT_DIMS + (("cfg",) if batched else ()) if d not in skip]
    groups = [g for g in groups if g.size > 1]
    if not groups:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        for group in groups:
            amax = comm.all_reduce_max(amax, group, op="input_amax")
        return amax

    return reduce
