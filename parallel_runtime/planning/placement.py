"""Placement: where a plan's traffic crosses hosts, and the link it crosses.

Ranks run on hosts as the runtime lays them out: `hosts[rank]` names the host, the ranks of one host are
contiguous (the local host's first), and a rank's coordinates are Topology's (DIMS outermost -> innermost). A
group of some dimension whose ranks sit on more than one host sends that dimension's traffic over the link
between them (`host_links`, keyed by the sorted host pair, measured once per pair).

Heavy dimensions exchange activations at every block, so across a slow link they set the step's pace:

* tensor: two all-reduces of the hidden rows per block;
* ulysses: two all_to_alls of q/k/v and the attention output per attention layer;
* ring: R-1 K/V hops per attention layer;
* patch (displaced patch parallel): an all-gather of every rank's fresh K/V per attention layer (overlapped with
  the rest of the block, but as many bytes as Ring's hops).

Light dimensions exchange little, or rarely: batch (nothing until the result), cfg (one denoised tensor per step),
pipefusion (one hidden tensor per stage boundary per patch: send/recv between neighbours) and naive_patch (its
patches never see each other: only the result, and the tensor all-reduces its ranks would run anyway).
"""
from __future__ import annotations

import math
from collections import Counter

from ..distributed.topology import DIMS, Topology
from ..errors import ConfigError
from ..spec import StrategySpec
from .costmodel import LinkTiming

HEAVY_DIMS = ("tensor", "ulysses", "ring", "patch")
LIGHT_DIMS = ("batch", "cfg", "pipefusion", "naive_patch")

# The ranks each of traffic.py's ops runs among: its dimension's groups, or the groups spanning several.
OP_DIMS = {
    "tensor": ("tensor",), "ulysses": ("ulysses",), "ring": ("ring",), "patch": ("patch",), "cfg": ("cfg",),
    "pipefusion": ("pipefusion",), "pipefusion_x": ("pipefusion",),
    "result": ("naive_patch", "patch", "ring", "ulysses"),  # the all-gather of x over the group that split it
    "weights": ("batch", "cfg", "naive_patch", "patch", "ring", "ulysses"),  # shard_weights' replica groups
}


def _groups(topology: Topology, dims: tuple[str, ...]) -> list[list[int]]:
    return topology.groups(dims[0]) if len(dims) == 1 else topology.spanning_groups(dims)


def _check_hosts(topology: Topology, hosts: tuple[str, ...]) -> None:
    if len(hosts) != topology.world_size:
        raise ConfigError(f"the runtime names the host of {len(hosts)} rank(s) but the plan has "
                          f"{topology.world_size}; give one host per device.")


def crossing_groups(topology: Topology, hosts: tuple[str, ...]) -> list[tuple[str, list[int], tuple[str, ...]]]:
    """(dim, ranks, hosts it spans, sorted) for every group of a dimension whose ranks sit on more than one host;
    on two hosts the spanned hosts are the pair that keys `host_links`."""
    if not hosts:
        return []
    _check_hosts(topology, hosts)
    out = []
    for dim in DIMS:
        if getattr(topology, dim) == 1:
            continue
        for ranks in topology.groups(dim):
            spanned = tuple(sorted({hosts[r] for r in ranks}))
            if len(spanned) > 1:
                out.append((dim, ranks, spanned))
    return out


def slowest_link(spanned: tuple[str, ...], host_links: dict) -> tuple[tuple[str, str], LinkTiming]:
    """The pair of `spanned` hosts with the lowest measured bandwidth, and its link: a collective over them waits
    for it."""
    pairs = [(a, b) for i, a in enumerate(spanned) for b in spanned[i + 1:]]
    missing = [p for p in pairs if p not in host_links]
    if missing:
        a, b = missing[0]
        raise ConfigError(f"no measured link between hosts {a} and {b}; measure it (the agents' link probe) before "
                          f"planning across them.")
    pair = min(pairs, key=lambda p: (host_links[p].bandwidth, -host_links[p].latency_s))
    return pair, host_links[pair]


def links_by_op(strategy: StrategySpec, hosts: tuple[str, ...], host_links: dict) -> dict[str, LinkTiming]:
    """{op: the link its traffic crosses} for each of traffic.py's ops some group of which spans hosts (the slowest
    link any of its groups crosses: collectives run in step); ops missing here stay on the local link."""
    if not hosts or len(set(hosts)) == 1:
        return {}
    topology = Topology.from_strategy(strategy)
    _check_hosts(topology, hosts)
    out = {}
    for op, dims in OP_DIMS.items():
        if math.prod(getattr(topology, d) for d in dims) == 1:
            continue
        spans = {tuple(sorted({hosts[r] for r in ranks})) for ranks in _groups(topology, dims)}
        crossing = [slowest_link(s, host_links)[1] for s in spans if len(s) > 1]
        if crossing:
            out[op] = min(crossing, key=lambda link: (link.bandwidth, -link.latency_s))
    return out


def heavy_crossings(strategy: StrategySpec, hosts: tuple[str, ...], host_links: dict,
                    slower_than: float | None = None) -> dict[str, tuple[tuple[str, str], LinkTiming]]:
    """{heavy dim: (host pair, link)} for each heavy dimension whose groups cross hosts, on its slowest crossing
    link; with `slower_than` (bytes/s), only links slower than that."""
    out = {}
    for dim, _, spanned in crossing_groups(Topology.from_strategy(strategy), hosts):
        if dim not in HEAVY_DIMS:
            continue
        pair, link = slowest_link(spanned, host_links)
        if slower_than is not None and link.bandwidth >= slower_than:
            continue
        if dim not in out or link.bandwidth < out[dim][1].bandwidth:
            out[dim] = (pair, link)
    return out


def rate_text(bandwidth: float) -> str:
    """Bytes/s as a person reads a link: Gbit/s from 1 Gbit/s on, else MB/s."""
    if bandwidth * 8 >= 1e9:
        return f"{bandwidth * 8 / 1e9:.3g} Gbit/s"
    return f"{bandwidth / 1e6:.3g} MB/s"


def link_text(pair: tuple[str, str], link: LinkTiming) -> str:
    return f"the {pair[0]}↔{pair[1]} link measured {rate_text(link.bandwidth)}"


def placement_warning(strategy: StrategySpec, hosts: tuple[str, ...], host_links: dict) -> str | None:
    """One sentence when a heavy dimension's groups cross hosts (which, over which link, and a plan that keeps
    them inside a host); None when nothing heavy crosses."""
    crossing = heavy_crossings(strategy, hosts, host_links)
    if not crossing:
        return None
    dims = [d for d in HEAVY_DIMS if d in crossing]
    pair, link = min(crossing.values(), key=lambda pl: pl[1].bandwidth)
    heavy = math.prod(getattr(strategy, f"{d}_degree") for d in HEAVY_DIMS)
    counts = Counter(hosts)  # insertion order: the hosts as the ranks run on them
    per_host = ", ".join(f"{h} {n}" for h, n in counts.items())
    inside = math.gcd(heavy, *counts.values())  # the largest heavy group every host can hold whole
    text = (f"{strategy.label()} sends {' and '.join(dims)} traffic (every block) across hosts, where "
            f"{link_text(pair, link)}")
    if len(set(counts.values())) > 1 or any(heavy % n for n in counts.values()):
        text += f"; the hosts' device counts ({per_host}) do not divide its {heavy}-rank groups evenly"
    return text + f"; {_fix(strategy, heavy // inside)}."


def _fix(strategy: StrategySpec, factor: int) -> str:
    """A plan that keeps the heavy groups inside each host: `factor` of their degree moved to a light dimension
    across hosts (the outer heavy dims give it up first, tensor last: it is the heaviest)."""
    degrees = {d: getattr(strategy, f"{d}_degree") for d in HEAVY_DIMS}
    left = factor
    for dim in ("patch", "ring", "ulysses", "tensor"):
        take = math.gcd(degrees[dim], left)
        degrees[dim] //= take
        left //= take
    inner = " × ".join(f"{d}_degree={n}" for d, n in degrees.items() if n > 1)
    light = []
    if strategy.cfg_degree * factor == 2:
        light.append("cfg_degree=2 (cfg > 1)")
    light.append(f"batch_degree={strategy.batch_degree * factor} (a batch of {strategy.batch_degree * factor}+ "
                 f"images)")
    light.append(f"pipefusion_degree={strategy.pipefusion_degree * factor}")
    across = ", ".join(light[:-1]) + f" or {light[-1]}"
    return (f"use {across} across hosts" + (f" × {inner} inside each" if inner else "")
            + ", so only light traffic crosses the link")
