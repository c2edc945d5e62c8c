"""Ring attention: each rank keeps its queries while K/V blocks travel around the ring.

After `ring` steps every query has seen every key; the partial attentions are merged exactly with the
log-sum-exp rule, so the result equals full attention up to float round-off. The next block's transfer
is posted before the current block's attention runs, so communication overlaps compute. The blocks keep K/V's own
heads (fewer than q's under grouped-query attention, gqa.py): the kernel expands them, never the ring.
"""
from __future__ import annotations

import torch

from ...distributed.comm import Comm, Group
from .local import attention_with_lse, dead_queries, merge_partials


class RingAttention:
    def __init__(self, comm: Comm, group: Group, kv_lengths: list[int], biases: list[torch.Tensor] | None = None):
        """`kv_lengths[j]` is the sequence length of the K/V block that ring member j starts with; `biases[j]`
        the attention mask's block for this member's queries and member j's keys (None: unmasked)."""
        self.comm, self.group, self.kv_lengths, self.biases = comm, group, kv_lengths, biases
        # Which queries each block masks entirely: fixed for the call, so found once rather than once per layer.
        self.dead = [dead_queries(b) for b in biases] if biases is not None else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 masked: bool = True) -> torch.Tensor:
        n, me = self.group.size, self.group.index
        kv = torch.stack([k, v]).contiguous()  # one message per hop instead of two
        out = lse = None
        for step in range(n):
            pending = None
            if step + 1 < n:
                src = (me - step - 1) % n  # owner of the block that arrives next
                incoming = kv.new_empty((2, kv.shape[1], self.kv_lengths[src], *kv.shape[3:]))
                pending = self.comm.ring_exchange(kv, incoming, self.group, op="ring")
            owner = (me - step) % n
            bias, dead = (self.biases[owner], self.dead[owner]) if self.biases is not None and masked else (None, None)
            block_out, block_lse = attention_with_lse(q, kv[0], kv[1], bias=bias, dead=dead)
            out, lse = merge_partials(out, lse, block_out, block_lse)
            if pending is not None:
                for w in pending:
                    w.wait()
                kv = incoming
        return out.to(q.dtype)
