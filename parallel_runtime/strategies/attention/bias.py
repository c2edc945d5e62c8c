"""ComfyUI's attention mask as the attention strategies read it.

A Flux-family model call may carry `attention_mask`: an additive bias [B, L, L] over the joint sequence
[text, image] (StyleModelApply's attn_bias strength sets one for Redux's image tokens; masked text
conditioning another), which ComfyUI adds to every joint attention's scores. The strategies never see the
whole sequence at once, so `AttentionBias` cuts the block each attention call needs: its queries' rows and
its keys' columns, in the canonical order the TokenLayout's positions name.

A bias whose rows fall in a few groups, each of which adds the same thing to every query of the group or only
differs on a few rows (LTX-2's guide attention: one key vector for every video query), is handed to the kernels as
`RowGroups`: each group of query rows with its own bias, broadcast over the group where it is one row, so nothing of
the size queries x keys is built for it.
"""
from __future__ import annotations

import torch


class AttentionBias:
    """One forward pass's attention mask on this rank: `full` [1 or B, L, L] on the worker's device, in the
    model's dtype (ComfyUI casts the mask to it before the model sees it)."""

    def __init__(self, full: torch.Tensor):
        self.full = full

    def block(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """The bias [B, 1, len(rows), len(cols)] (every column where `cols` is None), broadcast over heads."""
        out = self.full.index_select(1, rows)
        if cols is not None:
            out = out.index_select(2, cols)
        return out.unsqueeze(1).contiguous()


class RowGroups:
    """One bias block given per group of query rows: `groups` = ((row indices into the block's queries, bias
    [1, 1, 1 or len(rows), keys] or None), ...), every row in exactly one group. The kernels run each group apart
    (local.attention, local.attention_with_lse) and put the rows back in place."""

    def __init__(self, groups):
        self.groups = tuple((rows, bias) for rows, bias in groups if len(rows))


def ring_blocks(bias, rows: list[torch.Tensor], ulysses: int, ring_index: int) -> list:
    """`bias`'s blocks for one ring member's attention (an AttentionBias, or any object with its `block`): shard j's
    canonical positions are `rows[j]` (sequence-parallel order r * ulysses + u); a Ulysses group attends its members'
    rows in member order, as queries and as the keys of the ring block it starts with, so block k is this ring
    member's group rows over ring member k's."""
    rings = len(rows) // ulysses
    members = [torch.cat(rows[r * ulysses:(r + 1) * ulysses]) for r in range(rings)]
    return [bias.block(members[ring_index], keys) for keys in members]
