"""PipeFusion's stage planning, for every family: which blocks each pipeline rank runs and which parameters it
loads. Pure arithmetic on a family's per-block parameter counts; it imports nothing of the project's, so the
model seam, the cost model and the strategies all plan from here."""
from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

PIPELINE_MEMORY_SLACK = 1.15  # no PipeFusion rank holds more than this x its fair share of the weights


def balanced_stages(counts: tuple, stages: int, speeds: tuple[float, ...] = ()) -> list[list[range]]:
    """The blocks of each PipeFusion rank, as the chunks it runs in pipeline order.

    `counts` is a family's `parameter_counts`: (per block, every stage's, the first's, the last's). Every
    block does about the same work per token, but blocks differ in weights (a Flux double block holds 2.4x
    a single one; SD3.5 Medium's first blocks carry a second attention; the first stage holds SD3's position
    table). One contiguous chunk per rank cannot balance both for such mixes, so ranks may hold two chunks
    (interleaved virtual stages: rank r runs chunks r and r + stages, and a patch passes every rank twice).
    Layouts whose busiest rank holds at most PIPELINE_MEMORY_SLACK x the fair share of the weights come
    first, then the least work on the busiest rank, then fewer hops; if none fits, the fewest bytes.

    `speeds` (one per stage, from the job's device_weights): unequal stages, blocks in proportion to each stage's
    speed, one contiguous chunk each (a fast stage may hold more than its fair share of the weights, up to
    PIPELINE_MEMORY_SLACK x its speed's share).
    """
    per_block, always, first, last = counts
    return [list(rank) for rank in _balanced_stages((tuple(per_block), always, first, last), stages, tuple(speeds))]


@functools.lru_cache(maxsize=64)
def _balanced_stages(counts: tuple, stages: int, speeds: tuple[float, ...]) -> tuple[tuple[range, ...], ...]:
    """balanced_stages, once per family shape and stage count: the cost model and `auto` ask for the same split
    once per candidate strategy, and a few thousand scored layouts each time took most of a projection's time."""
    per_block, always, first, last = counts
    # The first and last stage's own modules ride with the first and last block, wherever those land.
    memory = list(per_block)
    memory[0] += first
    memory[-1] += last
    if len(set(speeds)) > 1:
        return tuple((chunk,) for chunk in split_stages([1.0] * len(memory), stages, memory=memory, speeds=speeds))
    fair = (sum(memory) + always) / stages

    def score(ranks: list[list[range]]) -> tuple:
        work = max(sum(len(chunk) for chunk in rank) for rank in ranks)
        held = max(always + sum(memory[i] for chunk in rank for i in chunk) for rank in ranks) / fair
        fits = held <= PIPELINE_MEMORY_SLACK + 1e-9
        return (not fits, work if fits else held, len(ranks[0]))

    layouts = [layout for chunks in (1, 2) for layout in _stage_layouts(memory, stages, chunks)]
    return tuple(tuple(rank) for rank in min(layouts, key=score))


def _stage_layouts(memory: list[int], stages: int, chunks: int, exhaustive: int = 20000) -> list[list[list[range]]]:
    """Candidate layouts with `chunks` interleaved chunks per rank: the work-balancing DP's split under the
    memory cap, plus every split when there are few enough (the DP balances virtual stages, not the pairs
    of them a rank holds, so on a handful of blocks it can miss the split that fits)."""
    n, virtual = len(memory), chunks * stages
    if virtual > n:
        return []
    splits = [split_stages([1.0] * n, virtual, memory=memory)]
    if chunks > 1 and math.comb(n - 1, virtual - 1) <= exhaustive:
        for cuts in itertools.combinations(range(1, n), virtual - 1):
            bounds = (0, *cuts, n)
            splits.append([range(bounds[k], bounds[k + 1]) for k in range(virtual)])
    return [[[split[c * stages + r] for c in range(chunks)] for r in range(stages)] for split in splits]


def prefix_ownership(block_lists: tuple[str, ...], counts: tuple[int, ...], chunks: list[range],
                     *prefix_groups: tuple[str, ...]) -> Callable[[str], bool]:
    """Predicate over diffusers parameter names: the blocks in `chunks` (indices into the concatenation of
    `block_lists`, of lengths `counts`) plus every name starting with one of `prefix_groups`' prefixes."""
    names = [f"{attr}.{i}" for attr, n in zip(block_lists, counts) for i in range(n)]
    prefixes = tuple(f"{names[i]}." for chunk in chunks for i in chunk) + tuple(p for g in prefix_groups for p in g)
    return lambda name: name.startswith(prefixes)


def split_stages(compute: list[float], stages: int, memory: list[int] | None = None,
                 memory_slack: float = PIPELINE_MEMORY_SLACK, speeds: tuple[float, ...] = ()) -> list[range]:
    """Contiguous block ranges, one per stage: the slowest stage as fast as possible, while no stage holds
    more than `memory_slack` x its fair share of parameter bytes.

    Compute and memory disagree for Flux: a double-stream block carries 2.4x a single-stream block's
    parameters (two weight sets) but does the same work per token. Balancing bytes alone leaves the
    single-block stages ~1.8x slower; balancing work alone puts ~1.3x the fair share of weights on one
    device. If no split meets the memory cap, the cap becomes the smallest achievable one. With `speeds` stage k's
    time is its work / speeds[k] and its cap scales with its share of the speed (never below the equal share);
    of the splits tied on the slowest stage, the one nearest the speeds' shares (`_closest_to_speeds`).
    """
    n = len(compute)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages")
    memory = list(memory) if memory is not None else [1] * n
    speed = list(speeds) if speeds else [1.0] * stages
    share = [max(1.0 / stages, v / sum(speed)) for v in speed]  # of the weights, per stage

    def best(cost: list[float], cap_on: list[int] | None, cap: float,
             divisor: list[float]) -> tuple[float, list[int]] | None:
        """Min over contiguous splits of the max segment `cost` / its stage's divisor, segments' `cap_on` sums <=
        cap x their stage's share."""
        prefix_c, prefix_m = _prefix(cost), _prefix(cap_on or [0] * n)

        def segment(k: int, j: int, i: int) -> float | None:
            if prefix_m[i] - prefix_m[j] > cap * share[k]:
                return None
            return (prefix_c[i] - prefix_c[j]) / divisor[k]

        return _best_split(n, stages, segment, max)

    cap = memory_slack * sum(memory)  # x each stage's share
    found = best(compute, memory, cap, speed)
    if found is None:
        smallest, _ = best([float(m) for m in memory], None, float("inf"), share)
        cap = smallest * (1 + 1e-9)  # mem / share x share can round above mem
        found = best(compute, memory, cap, speed)
    bounds = found[1]
    if speeds:
        bounds = _closest_to_speeds(compute, memory, [cap * v for v in share], speed, found[0]) or bounds
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


def _closest_to_speeds(compute: list[float], memory: list[int], caps: list[float], speeds: list[float],
                       slowest: float) -> list[int] | None:
    """Among the splits whose slowest stage takes `slowest` (the optimum) within the memory `caps`, the cut points
    of the one whose stages' work is closest to their speeds' shares (least summed distance).

    Whole blocks rarely split in exact proportion, so many splits tie on the slowest stage: 6 blocks at speeds
    1 : 1 : 2 take 4 units as 1 + 1 + 4 and as 1 + 2 + 3. The proportional one is the one to keep: it stays best
    when a measured speed is a little off, and when stages share a device (two workers pinned to one core, the
    bench's emulation of a slow card) it is the only one that balances the device: a pipeline stage that waits
    leaves the core to its neighbour, so there the core's total work counts (1 + 4 puts 4 blocks on the lone core
    and 2 on the shared one; 1 + 2 + 3 puts 3 on each), see `patch_period`."""
    n, stages = len(compute), len(speeds)
    total, speed_sum = sum(compute), sum(speeds)
    prefix_c, prefix_m = _prefix(compute), _prefix(memory)
    limit = slowest * (1 + 1e-9)

    def segment(k: int, j: int, i: int) -> float | None:
        work = prefix_c[i] - prefix_c[j]
        if work / speeds[k] > limit or prefix_m[i] - prefix_m[j] > caps[k]:
            return None
        return abs(work - total * speeds[k] / speed_sum)

    found = _best_split(n, stages, segment, lambda a, b: a + b, tolerance=1e-12)
    return found and found[1]


def _prefix(values) -> list:
    sums = [0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


def _best_split(n: int, stages: int, segment: Callable[[int, int, int], float | None],
                combine: Callable[[float, float], float], tolerance: float = 0.0) -> tuple[float, list[int]] | None:
    """The cut points [0, ..., n] of n blocks into `stages` contiguous stages that minimise `combine` over the stages
    of `segment(k, j, i)` (stage k taking blocks j..i-1; None where it may not), with that minimum; None if no split
    is allowed. Dynamic programming over (stages, blocks); a later split replaces an earlier one only when better
    by more than `tolerance`, so ties keep the first found."""
    inf = float("inf")
    # value[k][i]: best combined cost of the first i blocks in k stages; cut[k][i]: where its last stage starts.
    value = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    value[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if value[k - 1][j] == inf:
                    continue
                cost = segment(k - 1, j, i)
                if cost is None:
                    continue
                v = combine(value[k - 1][j], cost)
                if v < value[k][i] - tolerance:
                    value[k][i], cut[k][i] = v, j
    if value[stages][n] == inf:
        return None
    cuts, i = [], n
    for k in range(stages, 0, -1):
        cuts.append(i)
        i = cut[k][i]
    return value[stages][n], [0] + cuts[::-1]


def patch_period(work: list[float], speeds: list[float], devices: list | None = None) -> float:
    """A pipeline's time per patch once it is full: the busiest device's work over its speed. `work[r]` is what
    rank r runs per patch (blocks), `speeds[r]` its measured speed (all ranks running at once, as measure_speeds
    times them), `devices[r]` the device it runs on, where several ranks share one (workers pinned to one core;
    None: its own). Ranks on one device pool their speeds: while one waits for its input the other has the whole
    device, so the device's total work over its total measured speed is what bounds the pipeline, not each rank's
    work over its own share."""
    pools: dict = {}
    for r, (w, v) in enumerate(zip(work, speeds)):
        key = devices[r] if devices and devices[r] is not None else ("rank", r)
        pool = pools.setdefault(key, [0.0, 0.0])
        pool[0] += w
        pool[1] += v
    return max(w / v for w, v in pools.values())
