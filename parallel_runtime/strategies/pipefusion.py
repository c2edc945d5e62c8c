"""PipeFusion: patch-level pipeline parallelism with stale activations (xDiT, Fang et al. 2024).

The transformer's blocks are split into contiguous stages, one per pipeline rank, and the latent into
`M` patches of token rows. After `warmup_steps` synchronous steps on the whole latent, stage 0 feeds
patch after patch; while a patch flows down the stages the next one follows, and the last stage applies
the sampler update to each patch as it leaves, sending it straight back to stage 0 for the next step —
the pipeline is never flushed between steps.

A patch's queries must still attend over the whole image. Each attention layer therefore keeps a
full-sequence K/V buffer (`StaleKVCache`): the current patch writes fresh rows and reads the other rows
as the previous step left them. Diffusion inputs change little between adjacent steps, so the stale
rows cost little accuracy; the warmup steps fill the buffers with exact values.
"""
from __future__ import annotations

import torch


class StaleKVCache:
    """Per-layer K/V buffers over the full sequence [text, image] of one stage."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.buffers: dict[int, torch.Tensor] = {}

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        buf = self.buffers.get(layer)
        if buf is None:
            buf = self.buffers[layer] = k.new_zeros((2, k.shape[0], self.seq_len, *k.shape[2:]))
        buf[0].index_copy_(1, positions, k)
        buf[1].index_copy_(1, positions, v)
        return buf[0], buf[1]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class StaleKVAttention:
    """Write this call's fresh K/V rows into the buffer, attend over the whole (partly stale) buffer."""

    def __init__(self, cache: StaleKVCache, inner):
        self.cache, self.inner = cache, inner
        self.positions: torch.Tensor | None = None  # global rows of the current call's K/V; set per patch

    def __call__(self, q, k, v, layer: int):
        k_all, v_all = self.cache.update(layer, self.positions, k, v)
        return self.inner(q, k_all, v_all, layer)


def split_stages(compute: list[float], stages: int, memory: list[int] | None = None,
                 memory_slack: float = 1.15) -> list[range]:
    """Contiguous block ranges, one per stage: the slowest stage as fast as possible, while no stage holds
    more than `memory_slack` x its fair share of parameter bytes.

    Compute and memory disagree for Flux: a double-stream block carries 2.4x a single-stream block's
    parameters (two weight sets) but does the same work per token. Balancing bytes alone leaves the
    single-block stages ~1.8x slower; balancing work alone puts ~1.3x the fair share of weights on one
    device. If no split meets the memory cap, the cap becomes the smallest achievable one.
    """
    n = len(compute)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages")
    memory = list(memory) if memory is not None else [1] * n

    def best(cost: list[float], cap_on: list[int] | None, cap: float) -> tuple[float, list[int]] | None:
        """Min over contiguous splits of the max segment `cost`, segments' `cap_on` sums <= cap (DP)."""
        prefix_c, prefix_m = [0.0], [0]
        for c, m in zip(cost, cap_on or [0] * n):
            prefix_c.append(prefix_c[-1] + c)
            prefix_m.append(prefix_m[-1] + m)
        inf = float("inf")
        # value[k][i]: best max-cost of splitting the first i blocks into k stages; cut[k][i]: last cut.
        value = [[inf] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        value[0][0] = 0.0
        for k in range(1, stages + 1):
            for i in range(k, n + 1):
                for j in range(k - 1, i):
                    if value[k - 1][j] == inf or prefix_m[i] - prefix_m[j] > cap:
                        continue
                    v = max(value[k - 1][j], prefix_c[i] - prefix_c[j])
                    if v < value[k][i]:
                        value[k][i], cut[k][i] = v, j
        if value[stages][n] == inf:
            return None
        cuts, i = [], n
        for k in range(stages, 0, -1):
            cuts.append(i)
            i = cut[k][i]
        return value[stages][n], [0] + cuts[::-1]

    cap = memory_slack * sum(memory) / stages
    found = best(compute, memory, cap)
    if found is None:
        smallest, _ = best([float(m) for m in memory], None, float("inf"))
        found = best(compute, memory, smallest)
    bounds = found[1]
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]
