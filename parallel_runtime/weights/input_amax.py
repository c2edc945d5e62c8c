"""The amax behind a quantized layer's per-tensor input scale, taken over every token of the forward pass.

On the kernel path comfy-kitchen's nvfp4 layout quantizes a layer's input with one global scale, amax(|x|) / (448 x
6), unless the file stores the layer's `input_scale` (ComfyUI passes that one when present). On ComfyUI's single
device x holds every token of the forward pass; on a rank it holds only the rank's share (its Ulysses / Ring shard,
its patch, its CFG branch of a batch one device would run whole), so an amax of its own rows quantizes differently:
one forward pass of a tiny nvfp4 model at Ulysses-2 was 0.16 off one worker's (8e-3 with this hook: round-off).

`InputAmax` is the hook between the two, one per loaded model (its Storage hands it to the layers): the strategy
that splits the pass sets `reduce`, an all-reduce (max) over the ranks holding the rest of it, and a layer asks
for the amax of its input. Unset (serial, or a rank that holds the whole pass) it answers None and the layer leaves
the scale to comfy-kitchen, exactly as before. The weights never import the runtime: `reduce` is a plain callable.
fp8 (scale 1 without a stored one), mxfp8 (per 32-value block) and int8 (per row) quantize each token alone and
need none of this.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch


class InputAmax:
    """amax(|x|) of a layer's input over the whole forward pass, through the strategy's `reduce`."""

    def __init__(self) -> None:
        self._reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._last: tuple | None = None  # (weakref to an input, its version, its reduced amax)

    @property
    def reduce(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._reduce

    @reduce.setter
    def reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self._reduce, self._last = reduce, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The amax in x's dtype (what comfy-kitchen divides), or None while nothing splits the pass. An input
        several layers read unchanged (q, k and v of one tensor: ComfyUI's fused qkv) is reduced once."""
        if self._reduce is None:
            return None
        last = self._last
        if last is not None and last[0]() is x and not x.is_inference() and last[1] == x._version:
            return last[2]
        local = x.abs().amax() if x.numel() else x.new_zeros(())  # a rank may hold no rows of a stream
        # Max is exact in any dtype: reduced in float32 (every backend has it), back in x's dtype.
        amax = self._reduce(local.float()).to(x.dtype)
        if not x.is_inference():  # inference tensors have no version to tell an in-place change
            self._last = (weakref.ref(x), x._version, amax)
        return amax
