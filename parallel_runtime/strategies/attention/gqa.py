"""Grouped-query attention (GQA): fewer key/value heads than query heads, handed to the strategies as they are.

A GQA family (HiDream O1: 32 q / 8 kv heads; Lumina 2: 24 / 8) gives its attention q [B, S, H, D] and k, v
[B, S, G, D] with G dividing H; kv head j serves q heads [j H/G, (j + 1) H/G) (the pairing of SDPA's
`enable_gqa`, which is repeat_interleave). The strategies move K/V with their G heads (Ulysses' all-to-all, Ring's
hops, stale buffers) and the kernel alone expands them (`expand_kv`, or a kernel that reads G heads itself), so
nothing carries the H/G-fold copies across a link or through memory. A family with G = H is the case group 1.

Ulysses splits the heads over its U members: member j attends q heads [j H/U, (j + 1) H/U), and needs exactly the
kv heads those read (`ulysses_kv_split`).
"""
from __future__ import annotations

import torch


def kv_group(q_heads: int, kv_heads: int) -> int:
    """q heads per kv head: H / G, which must be whole."""
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} key/value heads evenly")
    return q_heads // kv_heads


def expand_kv(t: torch.Tensor, q_heads: int, dim: int = 2) -> torch.Tensor:
    """k or v with its heads (dimension `dim`) repeated to `q_heads`, kv head j before q heads [j g, (j + 1) g):
    right before a kernel that reads one kv head per q head (t itself where the counts already match)."""
    group = kv_group(q_heads, t.shape[dim])
    return t if group == 1 else t.repeat_interleave(group, dim=dim)


def ulysses_kv_split(q_heads: int, kv_heads: int, members: int) -> tuple[int, int]:
    """(repeat, per_member) for Ulysses over `members`: repeat the kv heads `repeat`-fold (repeat_interleave), then
    give member j the contiguous `per_member` of them at [j per_member, (j + 1) per_member); those are exactly the
    kv heads its q heads [j H/U, (j + 1) H/U) read, in the same GQA pairing (its q heads / per_member apiece).

    - U divides G: no repeat; member j takes G/U kv heads.
    - G divides U (U > G): each member's q slice lies inside one kv group (H/U divides H/G), so it takes that single
      kv head; repeating G heads U/G-fold lines them up, one per member (U/G copies leave a rank, never H/G).
    - otherwise (Lumina 2's 8 kv heads over U = 3): a q slice straddles kv groups unevenly, so the heads are
      repeated to the q heads first (the plain split; as many bytes as before GQA was carried)."""
    kv_group(q_heads, kv_heads)
    if q_heads % members:
        raise ValueError(f"{members} Ulysses members cannot split {q_heads} query heads")
    if kv_heads % members == 0:
        repeat = 1
    elif members % kv_heads == 0:
        repeat = members // kv_heads
    else:
        repeat = q_heads // kv_heads
    return repeat, kv_heads * repeat // members
