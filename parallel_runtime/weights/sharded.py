"""A block whose weights a rank holds only 1/N of (shard_weights): its tensors' bytes, laid end to end, cut in N.

Every tensor a block holds (parameters and buffers: float weights, fp8 weights and their scales, GGUF blocks,
ComfyUI layouts' data and block scales) is bytes; laid end to end they form one flat buffer, and a rank keeps its
1/N slice of it (`shard_bytes`, a buffer of the block, so the worker's weight count sees it). Gathering the slices
of a replica group gives the flat buffer back, and the block's tensors become views into it, in their own dtypes
and shapes; releasing puts empty tensors in their place. The compact layers keep their data as tensors and read
them at each call (nothing derived from them is cached), so the same layer objects run on gathered views, and a
LoRA installed per call on a layer (patches.PatchedPerCall) stays installed across gathers; a LoRA baked into a
float or fp8 weight is baked into the ranks' slices once, when applied (`store`), so the gathers bring it.

Why bytes and not torch's FSDP2 (`fully_shard`), which runs on gloo as on NCCL: fully_shard shards parameters
only, while GGUF blocks and ComfyUI layouts are buffers, kept whole on every rank; it gathers in each module's
pre-forward hook, so a rank that skips a block (SkipLayerGuidance in one CFG branch) would leave its peers waiting
in that block's all-gather; and each parameter group gathers on its own, where one flat buffer is one collective
per block. The gather schedule (`strategies/sharded_weights.py`) walks every block in order whatever runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every tensor starts at a multiple, so its bytes view as any dtype (and vector loads align)


@dataclass(frozen=True)
class _Slot:
    module: torch.nn.Module
    name: str
    parameter: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShardedBlock:
    """One block's tensors as this rank's slice of their bytes (`index` of `degree`), gathered on demand."""

    def __init__(self, block: torch.nn.Module, index: int, degree: int):
        self.block, self.index, self.degree = block, index, degree
        self.slots: list[_Slot] = []
        offset = 0
        for module in block.modules():
            for table, parameter in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is None or t.numel() == 0 or (module is block and name == "shard_bytes"):
                        continue
                    self.slots.append(_Slot(module, name, parameter, t.dtype, tuple(t.shape), offset, t.nbytes))
                    offset = _aligned(offset + t.nbytes)
        self.chunk = -(-max(offset, 1) // (degree * ALIGN)) * ALIGN  # equal slices: all_gather_into_tensor
        first = self.slots[0] if self.slots else None
        self.device = getattr(first.module, first.name).device if first else torch.device("cpu")
        flat = self._flatten()
        # Kept here and as a buffer of the block (so the worker's byte count and a move to a device see it).
        self.kept = flat[index * self.chunk:(index + 1) * self.chunk].clone()
        block.register_buffer("shard_bytes", self.kept, persistent=False)
        del flat
        self.release()

    @property
    def names(self) -> dict[str, _Slot]:
        """Each sharded tensor's name within the block ("attn.to_q.weight")."""
        owner = {id(m): n for n, m in self.block.named_modules()}
        return {f"{owner[id(s.module)]}.{s.name}".lstrip("."): s for s in self.slots}

    def _flatten(self) -> torch.Tensor:
        flat = torch.zeros(self.chunk * self.degree, dtype=torch.uint8, device=self.device)
        for s in self.slots:
            t = getattr(s.module, s.name).detach().contiguous().reshape(-1)
            flat[s.offset:s.offset + s.nbytes].copy_(t.view(torch.uint8))
        return flat

    def empty_flat(self) -> torch.Tensor:
        """A buffer the group's slices gather into."""
        return torch.empty(self.chunk * self.degree, dtype=torch.uint8, device=self.device)

    def install(self, flat: torch.Tensor) -> None:
        """The block's tensors as views into the gathered `flat` bytes."""
        for s in self.slots:
            self._put(s, flat[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))

    def store(self, slot: _Slot, value: torch.Tensor) -> None:
        """Make `value` (one of the block's tensors, cast into its dtype as copy_ casts) what the gathers bring: the
        part of its bytes that lies in this rank's slice is written there. A LoRA changes the kept bytes once, when
        applied, so no gather re-reads the file or re-patches."""
        start, stop = self.index * self.chunk, (self.index + 1) * self.chunk
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.nbytes)
        if lo >= hi:
            return
        cast = torch.empty(slot.shape, dtype=slot.dtype, device=self.kept.device).copy_(value)
        self.kept[lo - start:hi - start].copy_(cast.reshape(-1).view(torch.uint8)[lo - slot.offset:hi - slot.offset])

    def release(self) -> None:
        """Empty tensors in the block's tensors' places (their dtype and device kept, so nothing that asks a
        module where it computes is misled)."""
        for s in self.slots:
            self._put(s, torch.empty(0, dtype=s.dtype, device=self.device))

    @staticmethod
    def _put(s: _Slot, value: torch.Tensor) -> None:
        if s.parameter:
            s.module._parameters[s.name] = torch.nn.Parameter(value, requires_grad=False)
        else:
            s.module._buffers[s.name] = value

    @property
    def whole_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)
