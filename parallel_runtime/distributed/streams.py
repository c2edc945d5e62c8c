"""Where a rank's device is, seen without stopping it.

On CUDA the host runs ahead of the device: kernels and NCCL calls return once queued, and a transfer's `wait()`
only orders the current stream behind it. A `StreamMark` is a point in the current stream (an event): the host
can ask whether the device got there (`reached`, which never blocks) or wait for that one stream (`wait`). Neither
waits for the device's other streams, as torch.cuda.synchronize would: NCCL runs its transfers on streams of its
own, and a send still in flight there is nothing the next step of the compute stream needs. On the CPU work runs
as it is called, so a mark is reached as it is made.
"""
from __future__ import annotations

import torch


class StreamMark:
    __slots__ = ("event",)

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def reached(self) -> bool:
        """Whether the device has run everything queued on the stream before the mark (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the device reached the mark (that stream's work only)."""
        if self.event is not None:
            self.event.synchronize()
