"""Grouped-query attention under the sequence strategies: K/V go to the strategy with their own (fewer) heads.

Ulysses gives each member the kv heads its q heads read, in the one all-to-all that carries its q heads; Ring passes
the unrepeated K/V blocks; only the kernel expands them. Each strategy runs here on ranks that are threads of this
process (tests/loopback.py: the real Comm over a loopback torch.distributed, its byte counters included) and must
equal one attention over the whole sequence with K/V repeated to the q heads, and send exactly traffic.py's GQA
figure, which is below the repeated one.
"""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from loopback import Fabric, loopback_comm, on_ranks
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.planning.traffic import Shapes, _ulysses_layer
from parallel_runtime.strategies.attention import (AttentionBias, LocalAttention, RingAttention, UlyssesAttention,
                                                   attention, attention_with_lse)
from parallel_runtime.strategies.attention.gqa import expand_kv, ulysses_kv_split
from parallel_runtime.strategies.attention.streams import UlyssesCrossAttention

pytestmark = pytest.mark.timeout(120)

HEADS, HEAD_DIM = 8, 16
# Rows per shard (sequence-parallel order ring * U + ulysses): uneven, as text rows rarely divide.
SHARDS = {2: [7, 5], 4: [4, 3, 5, 2]}
# Exact strategies reorder the same sums (the ring's blocks merged by log-sum-exp): fp32 round-off, ~1e-7; a wrong
# kv head for a q head shows at 1e-1.
EXACT_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_thread_per_rank):  # conftest's: the ranks are threads already; 2 cores
    yield


def test_each_ulysses_member_gets_exactly_the_kv_heads_its_q_heads_read():
    assert ulysses_kv_split(32, 8, 2) == (1, 4)  # HiDream O1: 4 of the 8 kv heads per member
    assert ulysses_kv_split(32, 8, 8) == (1, 1)
    assert ulysses_kv_split(32, 8, 16) == (2, 1)  # U > G: each member's one kv head
    assert ulysses_kv_split(4, 2, 4) == (2, 1)  # the bench O1's 2 kv heads over 4 members
    assert ulysses_kv_split(24, 8, 3) == (3, 8)  # Lumina 2 over 3: q slices straddle groups, sent repeated
    assert ulysses_kv_split(24, 24, 4) == (1, 6)  # no GQA: the plain split
    for h in range(1, 17):
        for g in (d for d in range(1, h + 1) if h % d == 0):
            for u in (d for d in range(1, h + 1) if h % d == 0):
                repeat, per = ulysses_kv_split(h, g, u)
                hq = h // u
                assert (g * repeat) % u == 0 and hq % per == 0, (h, g, u)
                sent = [x // repeat for x in range(g * repeat)]  # repeat_interleave's source head of each head
                for j in range(u):
                    got = sent[j * per:(j + 1) * per]
                    # local q head i reads local kv head i // (hq / per): the global pairing, q // (h / g)
                    assert [got[i // (hq // per)] for i in range(hq)] == [(j * hq + i) // (h // g) for i in range(hq)]


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("biased", [False, True], ids=["plain", "masked"])
def test_kernels_expand_kv_heads_as_repeating_them_does(kv_heads, biased):
    """The CPU kernels read the groups themselves (torch >= 2.5): the same numbers as K/V repeated, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(2, 2, 11, kv_heads, HEAD_DIM, generator=g)
    bias = _two_pass_bias(9, 11)[None, None] if biased else None
    kr, vr = expand_kv(k, HEADS), expand_kv(v, HEADS)
    assert torch.equal(attention(q, k, v, bias), attention(q, kr, vr, bias))
    for kernel in ("flash_cpu", "math"):
        out, lse = attention_with_lse(q, k, v, kernel=kernel, bias=bias)
        want_out, want_lse = attention_with_lse(q, kr, vr, kernel=kernel, bias=bias)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert rel_err(attention(q, k, v, bias), attention_with_lse(q, k, v, kernel="math", bias=bias)[0]) < EXACT_RTOL


def _two_pass_bias(rows: int, cols: int, prefix: int = 5) -> torch.Tensor:
    """HiDream O1's kind of mask [rows, cols]: the first `prefix` rows causal among themselves, the rest open."""
    q, k = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    return torch.zeros(rows, cols).masked_fill(~((q >= prefix) | (k <= q)), float("-inf"))


def _whole(kv_heads: int, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, rows, HEADS, HEAD_DIM, generator=g), torch.randn(1, rows, kv_heads, HEAD_DIM, generator=g),
            torch.randn(1, rows, kv_heads, HEAD_DIM, generator=g))


def _sequence_parallel(topology: Topology, kv_heads: int, masked: bool, head_counts=None):
    """Every rank's output rows (concatenated in sequence order), every rank's bytes by op, and the serial attention,
    under Ring over Ulysses groups as Denoiser._sequence_attention builds it."""
    u, r = topology.ulysses, topology.ring
    shards = SHARDS[u * r]
    q, k, v = _whole(kv_heads, sum(shards))
    bias = AttentionBias(_two_pass_bias(sum(shards), sum(shards))[None]) if masked else None
    starts = [sum(shards[:j]) for j in range(len(shards) + 1)]
    fabric = Fabric(topology.world_size)

    def rank(rk: int):
        comm = loopback_comm(fabric, topology, rk, "cpu")
        c = topology.coords(rk)
        me = c["ring"] * u + c["ulysses"]
        members = [torch.arange(starts[m * u], starts[(m + 1) * u]) for m in range(r)]  # each ring member's rows
        blocks = [bias.block(members[c["ring"]], keys) for keys in members] if masked else None
        inner = (RingAttention(comm, comm.group("ring"), [len(m) for m in members], blocks) if r > 1
                 else LocalAttention(blocks[0] if masked else None))
        att = (UlyssesAttention(comm, comm.group("ulysses"), shards[c["ring"] * u:(c["ring"] + 1) * u], inner,
                                head_counts) if u > 1 else inner)
        rows = slice(starts[me], starts[me + 1])
        with torch.no_grad():
            out = att(q[:, rows], k[:, rows], v[:, rows], 0)
        return me, out, {op: tuple(x) for op, x in comm.traffic.by_op.items()}

    try:
        results = sorted(on_ranks(fabric, rank), key=lambda x: x[0])
    finally:
        fabric.close()
    serial = attention(q, expand_kv(k, HEADS), expand_kv(v, HEADS), bias.full[:, None] if masked else None)
    return torch.cat([out for _, out, _ in results], dim=1), [traffic for _, _, traffic in results], serial


def _analytic(topology: Topology, kv_heads: int) -> list[dict]:
    """traffic.py's bytes per rank for one attention layer of these shards: {op: (sent, recv)}."""
    u, r = topology.ulysses, topology.ring
    shards = SHARDS[u * r]
    q_width, kv_width = Shapes(0, 0, HEADS * HEAD_DIM, HEADS, 1, kv_heads=kv_heads).attention_widths(1, u)
    out = []
    for rk in range(topology.world_size):
        c = topology.coords(rk)
        ops = {}
        if u > 1:
            ops["ulysses"] = _ulysses_layer(1, 4, (q_width, kv_width), u, shards[c["ring"] * u:(c["ring"] + 1) * u],
                                            c["ulysses"])
        if r > 1:  # R - 1 hops of the K/V block held: its own, then the previous members'
            blocks = [sum(shards[m * u:(m + 1) * u]) for m in range(r)]
            me = c["ring"]
            ops["ring"] = tuple(sum(2 * 4 * kv_width * blocks[(me - hop - d) % r] for hop in range(r - 1))
                                for d in (0, 1))
        out.append(ops)
    return out


STRATEGIES = {"ulysses2": Topology(ulysses=2), "ring2": Topology(ring=2), "ulysses2xring2": Topology(ulysses=2, ring=2),
              "ulysses4": Topology(ulysses=4)}


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sequence_strategies_move_unrepeated_kv_and_equal_serial(name, kv_heads):
    """Ulysses-2 (U divides G, or the one kv head of G = 1), Ulysses-4 over 2 kv heads (U > G), Ring-2, and both on
    four ranks, with the two-pass mask: serial's numbers, and each rank sends and receives traffic.py's figure."""
    topology = STRATEGIES[name]
    got, traffic, serial = _sequence_parallel(topology, kv_heads, masked=True)
    err = rel_err(got, serial)
    assert err < EXACT_RTOL, err
    assert traffic == _analytic(topology, kv_heads)
    if kv_heads < HEADS:  # fewer bytes than K/V repeated to the q heads, on every rank
        repeated = _analytic(topology, HEADS)
        assert all(sum(map(sum, t.values())) < sum(map(sum, w.values())) for t, w in zip(traffic, repeated))


def test_ulysses_ring_bytes_shrink_by_the_gqa_figures():
    """HiDream O1's release heads (32 q / 8 kv of 128): Ulysses-2's first all-to-all carries (16 + 2 x 4) / (3 x 16) =
    1/2 of the repeated bytes, both together (16 + 8 + 16) / 64 = 5/8; Ring's K/V blocks 8 / 32 = 1/4."""
    o1, repeated = Shapes(0, 0, 4096, 32, 36, kv_heads=8), Shapes(0, 0, 4096, 32, 36)
    assert o1.attention_widths(1, 2) == (2048, 512) and repeated.attention_widths(1, 2) == (2048, 2048)
    gqa, rep = _ulysses_layer(1, 2, o1.attention_widths(1, 2), 2, [100, 100], 0), _ulysses_layer(
        1, 2, repeated.attention_widths(1, 2), 2, [100, 100], 0)
    assert gqa[0] * 8 == rep[0] * 5
    assert o1.attention_widths(1, 1)[1] * 4 == repeated.attention_widths(1, 1)[1]
    assert o1.attention_widths(2, 1) == (2048, 512)  # tensor-2: each rank's 16 q heads over their 4 kv heads
    assert o1.attention_widths(1, 16) == (256, 128)  # U = 16 > 8 kv heads: one kv head per member


def test_uneven_ulysses_heads_fall_back_to_repeated_kv():
    """Device weights' unequal head slices (5 + 3 of 8 q heads over 2 kv heads: q head 4 of member 0 reads kv head 1,
    as member 1's three do) go repeated, as before GQA: still serial's numbers."""
    topology = Topology(ulysses=2)
    got, traffic, serial = _sequence_parallel(topology, 2, masked=True, head_counts=[5, 3])
    assert rel_err(got, serial) < EXACT_RTOL
    assert traffic[0]["ulysses"][0] > _analytic(topology, 2)[0]["ulysses"][0]  # more than the GQA split


def test_cross_stream_ulysses_sends_each_member_its_kv_heads():
    """Queries of one stream over another's keys (LTX-2's a2v kind) with 2 kv heads over Ulysses-2: serial's
    numbers; the K/V all-to-all carries 1 kv head per member, not 4."""
    topology, q_rows, kv_rows = Topology(ulysses=2), [6, 5], [4, 7]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, sum(q_rows), HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(2, 1, sum(kv_rows), 2, HEAD_DIM, generator=g)
    fabric = Fabric(2)

    def rank(rk: int):
        comm = loopback_comm(fabric, topology, rk, "cpu")
        att = UlyssesCrossAttention(comm, comm.group("ulysses"), q_rows, kv_rows, LocalAttention())
        qs, ks = slice(sum(q_rows[:rk]), sum(q_rows[:rk + 1])), slice(sum(kv_rows[:rk]), sum(kv_rows[:rk + 1]))
        with torch.no_grad():
            return att(q[:, qs], k[:, ks], v[:, ks], 0), comm.traffic.by_op["ulysses"][0]

    try:
        results = on_ranks(fabric, rank)
    finally:
        fabric.close()
    got = torch.cat([out for out, _ in results], dim=1)
    assert rel_err(got, attention(q, expand_kv(k, HEADS), expand_kv(v, HEADS))) < EXACT_RTOL
    # rank 0: q (4 heads) of 6 rows and its output back over 5 rows, K/V (1 head each) of 4 rows, fp32
    assert results[0][1] == 4 * HEAD_DIM * (4 * 6 + 4 * 5 + 2 * 1 * 4)


def test_memory_plan_keeps_stale_kv_on_the_kv_heads():
    """The cost model's stale K/V of PipeFusion (over Ulysses) and displaced patch at HiDream O1's release shapes:
    8 of 32 heads' width, a quarter of what buffers of repeated K/V would hold."""
    import dataclasses

    from parallel_runtime.bench.models import RELEASE_SHAPES
    from parallel_runtime.planning.costmodel import rank_memory
    from parallel_runtime.spec import StrategySpec as S

    o1 = RELEASE_SHAPES["hidream_o1"][0]
    repeated = dataclasses.replace(o1, num_kv_heads=o1.num_heads)
    kw = dict(text_tokens=128, image_tokens=4096, batch=1, cfg=1.0, weight_bytes=2, act_bytes=2)
    for strategy in (S(pipefusion_degree=2, num_pipeline_patch=4, ulysses_degree=2), S(patch_degree=2)):
        gqa, rep = rank_memory(strategy, o1, **kw)["kv"], rank_memory(strategy, repeated, **kw)["kv"]
        assert gqa > 0 and 4 * gqa == rep, strategy.label()
