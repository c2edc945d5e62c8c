"""Ulysses attention: trade a sequence shard for a head shard around the attention kernel.

Each rank holds all heads for its slice of tokens. One all-to-all turns that into a slice of heads for
the tokens of the whole Ulysses group, the inner attention runs on full sequences, and a second
all-to-all turns the result back. Shards may have different lengths (text tokens rarely divide evenly),
which all_to_all_single's split sizes handle.
"""
from __future__ import annotations

import torch

from ...runtime.comm import Comm, Group


class UlyssesAttention:
    def __init__(self, comm: Comm, group: Group, seq_lengths: list[int], inner):
        """`seq_lengths[j]` is the local sequence length of Ulysses member j (this call's q/k/v)."""
        self.comm, self.group, self.seq_lengths, self.inner = comm, group, seq_lengths, inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 masked: bool = True) -> torch.Tensor:
        u = self.group.size
        b, s, h, d = q.shape
        hu = h // u
        # [B, S, 3, U, H/U, D] -> [U, S, B, 3, H/U, D]: chunk j of dim 0 goes to member j.
        qkv = torch.stack([q, k, v], dim=2).reshape(b, s, 3, u, hu, d).permute(3, 1, 0, 2, 4, 5).contiguous()
        total = sum(self.seq_lengths)
        gathered = qkv.new_empty((total, b, 3, hu, d))
        self.comm.all_to_all(gathered, qkv.reshape(u * s, b, 3, hu, d), self.seq_lengths, [s] * u,
                             self.group, op="ulysses")
        gathered = gathered.permute(1, 0, 2, 3, 4)  # [B, total, 3, H/U, D]
        # [B, total, H/U, D]; the queries are the group's rows in member order, which the inner bias is cut for.
        out = self.inner(gathered[:, :, 0], gathered[:, :, 1], gathered[:, :, 2], layer, masked=masked)
        back = out.permute(1, 0, 2, 3).contiguous()  # [total, B, H/U, D], rows of member j contiguous
        mine = back.new_empty((u * s, b, hu, d))
        self.comm.all_to_all(mine, back, [s] * u, self.seq_lengths, self.group, op="ulysses")
        return mine.reshape(u, s, b, hu, d).permute(2, 1, 0, 3, 4).reshape(b, s, h, d)
