"""Ulysses attention: trade a sequence shard for a head shard around the attention kernel.

Each rank holds all heads for its slice of tokens. One all-to-all turns that into a slice of heads for
the tokens of the whole Ulysses group, the inner attention runs on full sequences, and a second
all-to-all turns the result back. Shards may have different lengths (text tokens rarely divide evenly),
which all_to_all_single's split sizes handle.

Under device weights (a fast card beside a slow one) the head slices differ too (`head_counts`): a member's
attention work is its heads x the whole sequence, so giving it heads in proportion to its speed balances the
attention as the uneven sequence shards balance the rest of the block. Slices of different widths cannot share
one tensor layout, so that path sends each member its flattened piece (element splits).
"""
from __future__ import annotations

import torch

from ...distributed.comm import Comm, Group


class UlyssesAttention:
    def __init__(self, comm: Comm, group: Group, seq_lengths: list[int], inner,
                 head_counts: list[int] | None = None):
        """`seq_lengths[j]` is the local sequence length of Ulysses member j (this call's q/k/v); `head_counts[j]`
        the heads member j attends over (None: the heads divided equally)."""
        self.comm, self.group, self.seq_lengths, self.inner = comm, group, seq_lengths, inner
        self.head_counts = head_counts

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 masked: bool = True) -> torch.Tensor:
        if self.head_counts is not None and len(set(self.head_counts)) > 1:
            return self._uneven_heads(q, k, v, layer, masked)
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

    def _uneven_heads(self, q, k, v, layer: int, masked: bool) -> torch.Tensor:
        """The same two all-to-alls with member j taking head_counts[j] heads."""
        heads, seqs, me = self.head_counts, self.seq_lengths, self.group.index
        b, s, h, d = q.shape
        qkv = torch.stack([q, k, v], dim=2).permute(1, 0, 2, 3, 4)  # [S, B, 3, H, D]
        pieces = qkv.split(heads, dim=3)  # member j's heads of my rows
        send = torch.cat([p.reshape(-1) for p in pieces])
        got = send.new_empty(sum(seqs) * b * 3 * heads[me] * d)
        self.comm.all_to_all(got, send, [n * b * 3 * heads[me] * d for n in seqs], [p.numel() for p in pieces],
                             self.group, op="ulysses")
        gathered = got.view(sum(seqs), b, 3, heads[me], d).permute(1, 0, 2, 3, 4)  # [B, total, 3, h_me, D]
        out = self.inner(gathered[:, :, 0], gathered[:, :, 1], gathered[:, :, 2], layer, masked=masked)
        back = out.permute(1, 0, 2, 3).contiguous()  # [total, B, h_me, D], rows of member j contiguous
        mine = back.new_empty(s * b * d * h)
        self.comm.all_to_all(mine, back.reshape(-1), [s * b * n * d for n in heads],
                             [n * b * heads[me] * d for n in seqs], self.group, op="ulysses")
        parts = [p.view(s, b, n, d) for p, n in zip(mine.split([s * b * n * d for n in heads]), heads)]
        return torch.cat(parts, dim=2).permute(1, 0, 2, 3)  # [B, S, H, D]
