"""Attention between two token streams that are each split over the sequence-parallel ranks.

An audio-video model (LTX-2) holds two sequences, video tokens and audio tokens, and every rank owns a shard of
each. Self-attention of either stream is the ordinary strategy over that stream's shard lengths; the
audio-to-video and video-to-audio cross-attentions take queries from one stream and keys/values from the other,
whose shards have other lengths. Both strategies carry over unchanged in kind: Ulysses moves the queries and the
keys/values in separate all-to-alls (each with its own stream's split sizes), so every member attends its head
slice of all queries over all keys; Ring keeps the queries and passes the other stream's K/V blocks around. The
composition is the one `Denoiser._sequence_attention` builds for one stream: Ring over the Ulysses groups.
"""
from __future__ import annotations

import torch

from ...distributed.comm import Comm, Group
from .bias import ring_blocks
from .gqa import ulysses_kv_split
from .local import LocalAttention
from .ring import RingAttention
from .ulysses import UlyssesAttention


class UlyssesCrossAttention:
    """Ulysses for queries and keys of different streams: `q_lengths[j]` / `kv_lengths[j]` are member j's rows
    of the query and key streams."""

    def __init__(self, comm: Comm, group: Group, q_lengths: list[int], kv_lengths: list[int], inner):
        self.comm, self.group, self.inner = comm, group, inner
        self.q_lengths, self.kv_lengths = q_lengths, kv_lengths

    def _scatter_heads(self, t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[B, S, (k,) H, D] rows of mine -> [B, sum(lengths), (k,) H/U, D]: member j's rows, my head slice."""
        u = self.group.size
        b, s = t.shape[:2]
        inner_shape = t.shape[2:-2]
        h, d = t.shape[-2:]
        x = t.reshape(b, s, *inner_shape, u, h // u, d).movedim(-3, 0).movedim(2, 1).contiguous()  # [U, S, B, ...]
        out = x.new_empty((sum(lengths), b, *inner_shape, h // u, d))
        self.comm.all_to_all(out, x.reshape(u * s, b, *inner_shape, h // u, d), lengths, [s] * u, self.group,
                             op="ulysses")
        return out.movedim(1, 0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 masked: bool = True) -> torch.Tensor:
        u = self.group.size
        b, s, h, d = q.shape
        queries = self._scatter_heads(q, self.q_lengths)
        repeat, _ = ulysses_kv_split(h, k.shape[2], u)  # grouped-query K/V: only the kv heads each member reads
        kv = torch.stack([k, v], dim=2)
        kv = self._scatter_heads(kv.repeat_interleave(repeat, dim=3) if repeat > 1 else kv, self.kv_lengths)
        out = self.inner(queries, kv[:, :, 0], kv[:, :, 1], layer, masked=masked)
        back = out.permute(1, 0, 2, 3).contiguous()  # [total queries, B, H/U, D], member j's rows contiguous
        mine = back.new_empty((u * s, b, h // u, d))
        self.comm.all_to_all(mine, back, [s] * u, self.q_lengths, self.group, op="ulysses")
        return mine.reshape(u, s, b, h // u, d).permute(2, 1, 0, 3, 4).reshape(b, s, h, d)


def stream_attention(comm: Comm, ulysses: int, ring_index: int, q_shards: list[int], kv_shards: list[int],
                     bias=None, rows: list[torch.Tensor] | None = None):
    """The attention of queries from a stream split as `q_shards` over keys from one split as `kv_shards` (per
    sequence-parallel rank, in the order shard r * ulysses + u): Ring over Ulysses groups, as for one stream.
    Self-attention of a stream is the case q_shards == kv_shards. `bias` (self-attention only): an object with
    AttentionBias' `block(rows, cols)`, cut by bias.ring_blocks with `rows[j]`, shard j's token indices."""
    ring_group, uly_group = comm.group("ring"), comm.group("ulysses")
    rings = len(kv_shards) // ulysses
    kv_lengths = [sum(kv_shards[r * ulysses:(r + 1) * ulysses]) for r in range(rings)]
    blocks = ring_blocks(bias, rows, ulysses, ring_index) if bias is not None else None
    attention = (RingAttention(comm, ring_group, kv_lengths, blocks) if ring_group.size > 1
                 else LocalAttention(blocks[0] if blocks else None))
    if uly_group.size > 1:
        q_mine = q_shards[ring_index * ulysses:(ring_index + 1) * ulysses]
        kv_mine = kv_shards[ring_index * ulysses:(ring_index + 1) * ulysses]
        # Equal splits (a stream's self-attention): one all-to-all of stacked q/k/v instead of two.
        attention = (UlyssesAttention(comm, uly_group, q_mine, attention) if q_mine == kv_mine
                     else UlyssesCrossAttention(comm, uly_group, q_mine, kv_mine, attention))
    return attention
