"""Analytic communication volume of each strategy: bytes every rank sends and receives in one job.

Written from what the strategies move, not from the counters, so the benchmark can check the counters
(`comm.Traffic`, which only counts bytes that leave or reach *other* ranks) against first principles.

Symbols: B latent batch, b = B x branches evaluated in one forward (2 when cfg > 1 runs both branches on
one rank), T text tokens, N image tokens, H = heads x head_dim, e bytes per activation element (the
weight dtype), G/heads the share of H that K and V have (grouped-query attention: G key/value heads under more
query heads; 1 where G = heads), C = 64 packed latent channels (16 x 2 x 2) of the float32 sampler state x, L attention
layers (blocks) per step, S steps. Where the prompt is cross-attended (PixArt) it never travels: T counts
as 0. Image-only self-attention layers (SD3.5 Medium's second attention) move N rows only.

Per attention layer, per rank:

* Ulysses (degree U, member j holds s_j = its text rows + N/(U*R) image rows, the group's rows sum to
  S_g): all_to_all #1 sends q,k,v of its rows for the other members' heads and receives their rows of
  its own heads; all_to_all #2 returns attention outputs. Each member gets H/U of the q width and K_u of k's and
  of v's: the kv heads its q heads read (gqa.ulysses_kv_split: G/U of the kv heads where U divides G, the one
  kv head of its q slice where G divides U; H/U, as q's, without GQA):
      sent = b e [(H/U + 2 K_u) (U-1) s_j + H/U (S_g - s_j)]   recv = b e [(H/U + 2 K_u) (S_g - s_j) + H/U (U-1) s_j]
  (no GQA, even split: sent = recv = 4 b e H S_g (U-1)/U^2).
* Ring (degree R): R-1 hops, each sending the K/V block it holds ([2, b, rows, K_u heads' width]: its own kv
  heads, never repeated to the q heads) to the next member and receiving the previous member's:
  sent = recv = 2 b e K_u sum of R-1 blocks' rows (K_u = H G/heads without Ulysses).
* PipeFusion (P ranks, M patches, w warm-up steps): every chunk of blocks but the pipeline's last
  sends, per forward, its [text ; image] hidden rows, b (t_j + n N/(M U R)) H e for a forward over n
  patches (n = M in warm-up steps, else M forwards of n = 1), and the next chunk's rank receives them; a
  rank holding two interleaved chunks does this twice per patch (image rows only where the prompt is
  cross-attended: stage 0 sends it, b T H e, to every other stage once per job). After every step but the
  last stage returns the updated x rows to stage 0: B (N/(U R)) C 4 bytes per step. Under Ring (degree R) each
  ring member's stale K/V buffer holds its Ulysses group's rows of every patch, and each attention layer of
  every forward passes these whole buffers around the ring (the Ring hops above, with whole-buffer blocks).
* Displaced patch (degree K): every attention layer all-gathers each rank's fresh K/V rows (their own kv heads),
  padded to the longest shard r_max: sent = recv = (K-1) 2 b e H (G/heads) r_max (its own rows counted once per
  other member).
* Tensor parallel (degree P): each block's row-wise layers (attention's out-projection, the MLP's down
  projection; one fused projection in Flux's single blocks) all-reduce their [b, rows, H] partial sums, rows
  being the rank's sequence shard (prompt rows where the layer reads them): sent = recv = 2 (P-1)/P b e H rows
  per all-reduce (a ring all-reduce). Ulysses and Ring inside a tensor rank move H/P of the width. The
  modulation all-gathers (b x 6H per block) and Wan's norm statistics (b x rows x 4 bytes) are left out: under
  1% of a block's all-reduces from a few hundred rows on. So are the prompt-side reductions outside the blocks:
  Kandinsky 5's / 6's text blocks (two all-reduces of the prompt's rows per text block and pass: 4% of Kandinsky 5's
  bench traffic) and HiDream O1's vocab-parallel prompt lookup (one per step: 2% of its bench traffic).
* CFG parallel: each step the rank that ran the head all-gathers its denoised rows with its peer branch:
  sent = recv = B (rows) C 4.
* Result: one all-gather of the full x (B N C 4 bytes from each other member) over the sequence-parallel
  (or naive-patch) group at the end of the job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..distributed.topology import Topology
from ..spec import StrategySpec
from ..strategies.attention.gqa import ulysses_kv_split

X_BYTES = 4  # the sampler state x is float32 on every device


@dataclass(frozen=True)
class Shapes:
    """Everything the byte counts depend on."""

    image_tokens: int  # N = (H/16)(W/16) for Flux
    text_tokens: int  # T
    hidden: int  # H
    heads: int
    num_blocks: int  # blocks per full forward (Flux: double + single)
    kv_heads: int = 0  # key/value heads (grouped-query attention: fewer than `heads`); 0: as many as `heads`
    # Per PipeFusion rank, the block ranges of each chunk it runs (see the family's pipeline_stages);
    # () = one even contiguous chunk per rank.
    stage_blocks: tuple[tuple[range, ...], ...] = ()
    batch: int = 1  # latent batch B
    x_channels: int = 64  # C: latent channels x patch area (16 x 2 x 2 for Flux)
    act_bytes: int = 4  # e: 4 for fp32 weights, 2 for bf16/fp16
    # Per block, its self-attention layers: True where the prompt rows join (joint attention), False for
    # image-only attention (SD3.5 Medium's attn2, PixArt's self-attention beside its cross-attention);
    # () = one joint layer per block.
    attention_layers: tuple[tuple[bool, ...], ...] = ()
    # Per block, its all-reduces under tensor parallelism (BlockKind.tensor_reductions): True where the prompt
    # rows are summed too; () = two joint ones per block.
    tensor_layers: tuple[tuple[bool, ...], ...] = ()
    # Per block, the bytes a rank holds of it unsharded (shard_weights gathers the rest): () = not counted.
    block_bytes: tuple[int, ...] = ()

    def layers(self, blocks) -> list[bool]:
        """Per self-attention layer of `blocks` (indices), whether the prompt rows join it."""
        table = self.attention_layers or ((True,),) * self.num_blocks
        return [joint for i in blocks for joint in table[i]]

    def reductions(self, blocks) -> list[bool]:
        """Per tensor-parallel all-reduce of `blocks` (indices), whether the prompt rows are summed too."""
        table = self.tensor_layers or ((True, True),) * self.num_blocks
        return [joint for i in blocks for joint in table[i]]

    @property
    def text_in_stream(self) -> bool:
        """Whether prompt rows travel with the image rows (joint attention) or stay put on every rank."""
        return any(self.layers(range(self.num_blocks)))

    def attention_widths(self, tensor: int = 1, ulysses: int = 1) -> tuple[int, int]:
        """(q width, width of k and of v) per row of one Ulysses member's attention: see `attention_widths`."""
        return attention_widths(self.hidden, self.heads, self.kv_heads or self.heads, tensor, ulysses)


def attention_widths(hidden: int, heads: int, kv_heads: int, tensor: int = 1, ulysses: int = 1) -> tuple[int, int]:
    """(q width, width of k and of v) per row of one Ulysses member's attention on a tensor rank's share of the
    heads: H/(P U), and the kv heads that member receives (gqa.ulysses_kv_split) x the head size (hidden / heads)."""
    if kv_heads == heads or heads % (tensor * ulysses) or kv_heads % tensor:
        # No GQA, or a split validation refuses (auto may still rank it; counted as K/V repeated to the q heads).
        return (hidden // (tensor * ulysses),) * 2
    head_dim = hidden // heads
    _, per_member = ulysses_kv_split(heads // tensor, kv_heads // tensor, ulysses)
    return heads // tensor // ulysses * head_dim, per_member * head_dim


def shapes_of(config, *, image_tokens: int, text_tokens: int, pipefusion: int = 1, batch: int = 1,
              act_bytes: int = 4, weight_bytes: float = 0.0) -> Shapes:
    """The byte counts' inputs for a family's config, PipeFusion stages split as the workers split them;
    `weight_bytes` per parameter: the blocks' bytes that shard_weights gathers (0: not counted)."""
    from ..models.registry import family_of, token_patch

    stages = (tuple(tuple(chunks) for chunks in family_of(config).pipeline_stages(config, pipefusion))
              if pipefusion > 1 else ())
    patch = getattr(config, "patch_size", None)
    if not isinstance(patch, tuple):  # an image family: the adapter's patch (Qwen-Image 2.1, FLUX.2: 1)
        patch = token_patch(config)
    return Shapes(image_tokens=image_tokens, text_tokens=text_tokens, hidden=config.hidden_size,
                  heads=config.num_heads, kv_heads=getattr(config, "num_kv_heads", 0), num_blocks=config.num_blocks, stage_blocks=stages, batch=batch,
                  act_bytes=act_bytes, attention_layers=config.attention_layers,
                  tensor_layers=tuple(tuple(r == "joint" for r in kind.tensor_reductions)
                                      for kind in config.block_kinds),
                  x_channels=config.latent_channels * _patch_cells(patch),
                  block_bytes=tuple(int(n * weight_bytes) for n in family_of(config).parameter_counts(config)[0])
                  if weight_bytes else ())


def _patch_cells(patch) -> int:
    """Latent cells per token: p x p for an image patch, t x p x p for a video's (Wan's (1, 2, 2))."""
    return math.prod(patch) if isinstance(patch, tuple) else patch * patch


@dataclass
class RankTraffic:
    """Per-op totals for one rank over a whole job: {op: [sent, recv, messages]}."""

    rank: int
    ops: dict = field(default_factory=dict)

    def add(self, op: str, sent: int, recv: int, messages: int = 1) -> None:
        entry = self.ops.setdefault(op, [0, 0, 0])
        entry[0] += int(sent)
        entry[1] += int(recv)
        entry[2] += messages

    def add_times(self, times: int, step) -> None:
        """`times` repeats of what `step(traffic)` adds: steps alike are counted once and multiplied (a release-size
        plan's job walks every layer of every step: auto ranks dozens of plans at 20-50 steps)."""
        one = RankTraffic(self.rank)
        step(one)
        for op, (sent, recv, messages) in one.ops.items():
            self.add(op, times * sent, times * recv, times * messages)

    @property
    def sent(self) -> int:
        return sum(v[0] for v in self.ops.values())

    @property
    def recv(self) -> int:
        return sum(v[1] for v in self.ops.values())

    def by_op(self) -> dict[str, list[int]]:
        """Same shape as the runtime's counters: {op: [sent, recv]}."""
        return {k: [v[0], v[1]] for k, v in self.ops.items()}


def text_share(text_len: int, shards: int, i: int) -> int:
    """Rows of shard i of `text_len` (text or image rows): an uneven split, the first `extra` shards holding one
    more row, as TokenLayout cuts them."""
    base, extra = divmod(text_len, shards)
    return base + (1 if i < extra else 0)


def branches_per_forward(strategy: StrategySpec, cfg: float) -> int:
    uses_uncond = abs(cfg - 1.0) > 1e-9
    return 2 if uses_uncond and strategy.cfg_degree == 1 else 1


def even_stage_blocks(num_blocks: int, stages: int) -> tuple[tuple[range, ...], ...]:
    base, extra = divmod(num_blocks, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return tuple((range(bounds[i], bounds[i + 1]),) for i in range(stages))


def _ulysses_layer(b: int, e: int, widths: tuple[int, int], u: int, rows: list[int], me: int) -> tuple[int, int]:
    """Bytes of the two all_to_alls of one Ulysses attention layer for member `me`; `widths`: (q, kv) per row of one
    member's heads (Shapes.attention_widths). The first carries q, k and v, the second the output (q's width)."""
    s, total = rows[me], sum(rows)
    q, kv = widths
    forward, back = b * e * (q + 2 * kv), b * e * q
    sent = forward * (u - 1) * s + back * (total - s)
    recv = forward * (total - s) + back * (u - 1) * s
    return sent, recv


def job_traffic(strategy: StrategySpec, shapes: Shapes, *, steps: int, cfg: float) -> list[RankTraffic]:
    """What every rank of `strategy` sends and receives over a job of `steps` steps."""
    topo = Topology.from_strategy(strategy)
    out = [RankTraffic(r) for r in range(topo.world_size)]
    if topo.world_size == 1:
        return out
    n, h, e = shapes.image_tokens, shapes.hidden, shapes.act_bytes
    t = shapes.text_tokens if shapes.text_in_stream else 0
    bb = shapes.batch
    b = bb * branches_per_forward(strategy, cfg)
    x_row = bb * shapes.x_channels * X_BYTES  # bytes of one token row of x (all latent batch items)
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        rt = out[rank]
        if strategy.sharded:
            _weight_gathers(rt, strategy, topo, c, shapes, steps)
        if topo.pipefusion > 1:
            _pipefusion(rt, strategy, topo, c, shapes, b, x_row, steps)
            continue
        if topo.patch > 1:
            _displaced_patch(rt, topo, c, shapes, b, x_row, steps)
            continue
        if topo.naive_patch > 1:
            k = topo.naive_patch
            own = text_share(n, k, c["naive_patch"])

            def naive_step(st: RankTraffic) -> None:  # every rank keeps the whole prompt beside its patch
                _tensor_forward(st, topo.tensor, shapes, b, t, own)
                if topo.cfg > 1:
                    st.add("cfg", x_row * own, x_row * own)

            rt.add_times(steps, naive_step)
            rt.add("result", (k - 1) * x_row * n, (k - 1) * x_row * n)
            continue
        u, r = topo.ulysses, topo.ring
        sp = u * r
        me_r, me_u = c["ring"], c["ulysses"]
        widths = shapes.attention_widths(topo.tensor, u)  # one member's q and kv width

        def sequence_step(st: RankTraffic) -> None:
            for joint in shapes.layers(range(shapes.num_blocks)):
                # rows of sp rank j = ring*U + ulysses; image-only layers leave the prompt rows out
                rows = [(text_share(t, sp, j) if joint else 0) + text_share(n, sp, j) for j in range(sp)]
                if u > 1:
                    sent, recv = _ulysses_layer(b, e, widths, u, rows[me_r * u:(me_r + 1) * u], me_u)
                    st.add("ulysses", sent, recv, 2)
                if r > 1:  # the K/V rows each member starts with: its Ulysses group's
                    _ring_layer(st, 2 * b * e * widths[1], [sum(rows[q * u:(q + 1) * u]) for q in range(r)], me_r)
            _tensor_forward(st, topo.tensor, shapes, b, text_share(t, sp, me_r * u + me_u),
                            text_share(n, sp, me_r * u + me_u))
            if topo.cfg > 1:
                own = text_share(n, sp, me_r * u + me_u)
                st.add("cfg", x_row * own, x_row * own)

        rt.add_times(steps, sequence_step)
        if sp > 1:
            rt.add("result", (sp - 1) * x_row * n, (sp - 1) * x_row * n)
    return out


def _weight_gathers(rt: RankTraffic, strategy: StrategySpec, topo, c: dict, shapes: Shapes, steps: int) -> None:
    """shard_weights: each forward pass gathers every block this rank runs from its replica group (it receives the
    other members' slices, sends its own to each), plus the first block once more, the last pass's prefetch
    (strategies/sharded_weights.py). PipeFusion stages run their blocks once per warm-up step and once per patch
    after it; a tensor rank holds 1/P of each block."""
    g = strategy.shard_group
    if g == 1 or not shapes.block_bytes:
        return
    if topo.pipefusion > 1:
        stages = shapes.stage_blocks or even_stage_blocks(shapes.num_blocks, topo.pipefusion)
        blocks = [i for r in stages[c["pipefusion"]] for i in r]
        warm = min(strategy.warmup_steps, steps)
        passes = warm + (steps - warm) * strategy.patches
    else:
        blocks, passes = list(range(shapes.num_blocks)), steps
    piece = [shapes.block_bytes[i] / topo.tensor / g for i in blocks]  # one member's slice of each block
    total = passes * sum(piece) + piece[0]
    rt.add("weights", int(total * (g - 1)), int(total * (g - 1)), passes * len(blocks) + 1)


def _ring_layer(rt: RankTraffic, unit: int, block_rows: list[int], me: int) -> None:
    """One Ring attention layer's R-1 hops for member `me`: at each it sends the K/V block it holds (`unit` bytes
    per row; member q starts with block_rows[q] rows) and receives the previous member's."""
    r = len(block_rows)
    for hop in range(r - 1):
        rt.add("ring", unit * block_rows[(me - hop) % r], unit * block_rows[(me - hop - 1) % r])


def _tensor_forward(rt: RankTraffic, tp: int, shapes: Shapes, b: int, text_rows: int, image_rows: int,
                    blocks: range | None = None) -> None:
    """One forward's tensor-parallel all-reduces over `blocks` (all) on a rank holding these rows."""
    if tp == 1:
        return
    unit = 2 * (tp - 1) * b * shapes.act_bytes * shapes.hidden // tp
    for joint in shapes.reductions(blocks if blocks is not None else range(shapes.num_blocks)):
        rows = (text_rows if joint else 0) + image_rows
        rt.add("tensor", unit * rows, unit * rows)


def _displaced_patch(rt: RankTraffic, topo: Topology, c: dict, shapes: Shapes, b: int, x_row: int,
                     steps: int) -> None:
    n, e, k = shapes.image_tokens, shapes.act_bytes, topo.patch
    kv = shapes.attention_widths(topo.tensor)[1]  # a tensor rank's kv heads' width
    t = shapes.text_tokens if shapes.text_in_stream else 0

    def patch_step(st: RankTraffic) -> None:
        for joint in shapes.layers(range(shapes.num_blocks)):
            longest = max((text_share(t, k, j) if joint else 0) + text_share(n, k, j) for j in range(k))
            st.add("patch", (k - 1) * 2 * b * e * kv * longest, (k - 1) * 2 * b * e * kv * longest)
        _tensor_forward(st, topo.tensor, shapes, b, text_share(t, k, c["patch"]), text_share(n, k, c["patch"]))
        if topo.cfg > 1:
            own = text_share(n, k, c["patch"])
            st.add("cfg", x_row * own, x_row * own)

    rt.add_times(steps, patch_step)
    rt.add("result", (k - 1) * x_row * n, (k - 1) * x_row * n)


def _pipefusion(rt: RankTraffic, s: StrategySpec, topo: Topology, c: dict, shapes: Shapes, b: int, x_row: int,
                steps: int) -> None:
    n, h, e = shapes.image_tokens, shapes.hidden, shapes.act_bytes
    t = shapes.text_tokens if shapes.text_in_stream else 0
    p, u, r, m, tp = topo.pipefusion, topo.ulysses, topo.ring, s.patches, topo.tensor
    sp = u * r
    stage_blocks = shapes.stage_blocks or even_stage_blocks(shapes.num_blocks, p)
    stage, me_r = c["pipefusion"], c["ring"]
    me = me_r * u + c["ulysses"]  # this rank's shard: sequence-parallel order ring * U + ulysses
    group = range(me_r * u, (me_r + 1) * u)  # the shards of its Ulysses group
    chunks = stage_blocks[stage]
    last = stage == p - 1
    texts = [text_share(t, sp, j) for j in range(sp)]
    per_patch = [text_share(n // m, sp, j) for j in range(sp)]  # image rows of one patch held by shard j
    widths = shapes.attention_widths(tp, u)  # one Ulysses member's q and kv width
    if not shapes.text_in_stream:  # a cross-attended prompt goes from stage 0 to every other stage once
        prompt = b * shapes.text_tokens * h * e
        rt.add("pipefusion", prompt * (p - 1) if stage == 0 else 0, 0 if stage == 0 else prompt, 1)

    def step(st: RankTraffic, warm: bool, more: bool) -> None:
        """One step: warm (synchronous, all patches in one forward) or not; `more`: another step follows."""
        forwards = [m] if warm else [1] * m  # patches per forward
        for n_p in forwards:
            for k, blocks in enumerate(chunks):  # a patch passes each of this rank's chunks
                for joint in (shapes.layers(blocks) if sp > 1 else ()):
                    if u > 1:
                        rows = [(texts[j] if joint else 0) + n_p * per_patch[j] for j in group]
                        sent, recv = _ulysses_layer(b, e, widths, u, rows, c["ulysses"])
                        st.add("ulysses", sent, recv, 2)
                    if r > 1:  # Ring passes each member's whole stale buffer: its shards' rows of every patch
                        buffers = [sum((texts[j] if joint else 0) + m * per_patch[j] for j in range(q * u, (q + 1) * u))
                                   for q in range(r)]
                        _ring_layer(st, 2 * b * e * widths[1], buffers, me_r)
                _tensor_forward(st, tp, shapes, b, texts[me], n_p * per_patch[me], blocks)
                hidden = b * (texts[me] + n_p * per_patch[me]) * h * e
                if not (last and k == len(chunks) - 1):
                    st.add("pipefusion", hidden, 0)
                if not (stage == 0 and k == 0):
                    st.add("pipefusion", 0, hidden)
            x_bytes = x_row * n_p * per_patch[me]
            if last and topo.cfg > 1:
                st.add("cfg", x_bytes, x_bytes)
            if more:
                if last:
                    st.add("pipefusion_x", x_bytes, 0)
                if stage == 0:
                    st.add("pipefusion_x", 0, x_bytes)

    # steps of one kind alike: warm-up steps, then the stale ones; the last step sends x nowhere
    kinds = [(i < s.warmup_steps, i + 1 < steps) for i in range(steps)]
    for kind in dict.fromkeys(kinds):
        rt.add_times(kinds.count(kind), lambda st, kind=kind: step(st, *kind))
    if last and sp > 1:
        rt.add("result", (sp - 1) * x_row * n, (sp - 1) * x_row * n)


def per_step(traffic: list[RankTraffic], steps: int) -> list[dict]:
    """{sent, recv} bytes per rank per step (job totals / steps, the result gather included)."""
    return [{"sent": rt.sent / steps, "recv": rt.recv / steps} for rt in traffic]


def compare(measured: list[dict], analytic: list[RankTraffic], tolerance: float = 0.10) -> tuple[bool, float]:
    """Measured runtime counters (per rank: {"sent", "recv", ...}) vs analytic totals.

    Returns (ok, worst relative difference over ranks and directions); a direction the formula says is
    zero must measure zero.
    """
    worst = 0.0
    for got, want in zip(measured, analytic):
        for key, expected in (("sent", want.sent), ("recv", want.recv)):
            actual = got.get(key, 0)
            if expected == 0:
                diff = 0.0 if actual == 0 else float("inf")
            else:
                diff = abs(actual - expected) / expected
            worst = max(worst, diff)
    if len(measured) != len(analytic):
        return False, float("inf")
    return worst <= tolerance, worst
