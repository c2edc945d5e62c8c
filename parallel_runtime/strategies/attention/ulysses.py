"""Ulysses attention: trade a sequence shard for a head shard around the attention kernel.

Each rank holds all heads for its slice of tokens. One all-to-all turns that into a slice of heads for
the tokens of the whole Ulysses group, the inner attention runs on full sequences, and a second
all-to-all turns the result back. Shards may have different lengths (text tokens rarely divide evenly),
which all_to_all_single's split sizes handle.

Under device weights (a fast card beside a slow one) the head slices differ too (`head_counts`): a member's
attention work is its heads x the whole sequence, so giving it heads in proportion to its speed balances the
attention as the uneven sequence shards balance the rest of the block. Slices of different widths cannot share
one tensor layout, so that path sends each member its flattened piece (element splits).

Grouped-query attention (gqa.py): K/V arrive with their own, fewer heads, and each member receives only the kv heads
its q heads read (`ulysses_kv_split`), in the same single all-to-all as its q heads.
"""
from __future__ import annotations

import torch

from ...distributed.comm import Comm, Group
from .gqa import expand_kv, ulysses_kv_split


class UlyssesAttention:
    def __init__(self, comm: Comm, group: Group, seq_lengths: list[int], inner,
                 head_counts: list[int] | None = None):
        """`seq_lengths[j]` is the local sequence length of Ulysses member j (this call's q/k/v); `head_counts[j]`
        the heads member j attends over (None: the heads divided equally)."""
        self.comm, self.group, self.seq_lengths, self.inner = comm, group, seq_lengths, inner
        self.head_counts = head_counts

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 masked: bool = True) -> torch.Tensor:
        """q [B, S, H, D] and k, v [B, S, G, D] (G divides H: grouped-query attention) of this member's rows."""
        if self.head_counts is not None and len(set(self.head_counts)) > 1:
            # Uneven q slices straddle the kv groups unevenly: K/V go repeated to the q heads on this path.
            return self._uneven_heads(q, expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2]), layer, masked)
        u = self.group.size
        b, s, h, d = q.shape
        hu = h // u
        repeat, g = ulysses_kv_split(h, k.shape[2], u)
        k, v = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (k, v))
        # Member j's piece: its hu q heads, then its g kv heads of k and of v, side by side on the heads axis, so one
        # all-to-all carries all three. [U, S, B, hu + 2g, D]: chunk j of dim 0 goes to member j.
        width = hu + 2 * g
        qkv = q.new_empty((u, s, b, width, d))
        for t, heads in ((q, slice(0, hu)), (k, slice(hu, hu + g)), (v, slice(hu + g, width))):
            qkv[:, :, :, heads] = t.reshape(b, s, u, -1, d).permute(2, 1, 0, 3, 4)
        total = sum(self.seq_lengths)
        gathered = qkv.new_empty((total, b, width, d))
        self.comm.all_to_all(gathered, qkv.reshape(u * s, b, width, d), self.seq_lengths, [s] * u,
                             self.group, op="ulysses")
        gathered = gathered.permute(1, 0, 2, 3)  # [B, total, hu + 2g, D]
        # The queries are the group's rows in member order, which the inner bias is cut for.
        out = self.inner(gathered[:, :, :hu], gathered[:, :, hu:hu + g], gathered[:, :, hu + g:], layer,
                         masked=masked)
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
