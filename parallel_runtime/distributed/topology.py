"""Topology: how the world's ranks are laid out over the parallel dimensions.

world = batch x cfg x pipefusion x naive_patch x patch x ring x ulysses x tensor, with `tensor` innermost
(fastest-varying) because it all-reduces twice per block and so should sit on the closest devices, then
`ulysses` (its all-to-all moves the most bytes of the sequence splits), `cfg` because it exchanges one small
tensor per step, and `batch` outermost because its groups exchange nothing until the result. For 8 ranks with cfg=2, pipefusion=2,
ulysses=2 the layout is:

    rank:        0 1 2 3 4 5 6 7
    cfg:         0 0 0 0 1 1 1 1
    pipefusion:  0 0 1 1 0 0 1 1
    ulysses:     0 1 0 1 0 1 0 1

All validation of a strategy against devices, model and latent lives here, so a bad request fails
before any worker does work.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..spec import StrategySpec

DIMS = ("batch", "cfg", "pipefusion", "naive_patch", "patch", "ring", "ulysses", "tensor")  # outermost -> innermost
# The dimensions whose ranks hold different rows of one step's activations (branches, batch, sequence): every other
# rank holds the same rows (tensor ranks: replicated hidden states) or other blocks of them (pipeline stages). A
# statistic of the whole step sums over these and no others (the step cache's decision).
STEP_ROW_DIMS = tuple(d for d in DIMS if d not in ("pipefusion", "tensor"))


@dataclass(frozen=True)
class Topology:
    batch: int = 1
    cfg: int = 1
    pipefusion: int = 1
    naive_patch: int = 1
    patch: int = 1
    ring: int = 1
    ulysses: int = 1
    tensor: int = 1
    # Whether block weights are sharded over each replica group (its own process groups, made only then).
    shard_weights: bool = False

    @classmethod
    def from_strategy(cls, s: StrategySpec) -> "Topology":
        return cls(batch=s.batch_degree, cfg=s.cfg_degree, pipefusion=s.pipefusion_degree, naive_patch=s.naive_patch_degree,
                   patch=s.patch_degree, ring=s.ring_degree, ulysses=s.ulysses_degree, tensor=s.tensor_degree,
                   shard_weights=s.sharded)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.degrees:
            n *= d
        return n

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks that each hold a shard of the token sequence."""
        return self.ring * self.ulysses

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, deg in reversed(list(zip(DIMS, self.degrees))):
            out[name] = rank % deg
            rank //= deg
        return {d: out[d] for d in DIMS}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for name, deg in zip(DIMS, self.degrees):
            rank = rank * deg + coords.get(name, 0)
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks that differ only in `dim`, in a fixed order all ranks agree on."""
        others = [d for d in DIMS if d != dim]
        out = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in others)):
            base = dict(zip(others, fixed))
            out.append([self.rank_of(**base, **{dim: i}) for i in range(getattr(self, dim))])
        return out

    def spanning_groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only in `dims` (all of them together), in a fixed order all ranks agree
        on."""
        fixed_dims = [d for d in DIMS if d not in dims]
        out = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in fixed_dims)):
            base = dict(zip(fixed_dims, fixed))
            out.append([r for r in range(self.world_size)
                        if all(self.coords(r)[d] == base[d] for d in fixed_dims)])
        return out

    def sp_groups(self) -> list[list[int]]:
        """Groups spanning ring x ulysses (the whole sequence-parallel group)."""
        out = []
        for b, c, p, n, d, t in itertools.product(range(self.batch), range(self.cfg), range(self.pipefusion),
                                                  range(self.naive_patch), range(self.patch), range(self.tensor)):
            out.append([self.rank_of(batch=b, cfg=c, pipefusion=p, naive_patch=n, patch=d, ring=r, ulysses=u, tensor=t)
                        for r in range(self.ring) for u in range(self.ulysses)])
        return out

    def replica_groups(self) -> list[list[int]]:
        """Groups of ranks that hold the same blocks (same PipeFusion stage and tensor rank): what shard_weights
        splits each block's bytes over."""
        return [[r for r in range(self.world_size) if (self.coords(r)["pipefusion"], self.coords(r)["tensor"]) == key]
                for key in itertools.product(range(self.pipefusion), range(self.tensor))]

    def sp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["ring"] * self.ulysses + c["ulysses"]


DEGREES = ("batch_degree", "cfg_degree", "pipefusion_degree", "ulysses_degree", "ring_degree", "naive_patch_degree", "patch_degree",
           "tensor_degree")


def validate_strategy(s: StrategySpec, *, world_size: int, heads: int | None = None,
                      num_blocks: int | None = None, latent_hw: tuple[int, int] | None = None,
                      cfg_scale: float | None = None, steps: int | None = None, patch: int = 2,
                      mlp_hidden: int | None = None, batch: int | None = None) -> None:
    """Raise ConfigError (one sentence naming the fix) for any request the runtime cannot split; `patch`: the
    family's latent pixels per token side (2 for Flux's 2x2 patches, 1 for FLUX.2; a token is 16 px in both);
    `batch`: the latent's images (one chunk's rows of a model call)."""
    _check_degrees(s, world_size)
    if batch is not None and s.batch_degree > batch:
        raise ConfigError(f"batch_degree={s.batch_degree} splits images, but the latent holds {batch}; set the Empty "
                          f"Latent's batch_size to {s.batch_degree} or more, or lower batch_degree (auto picks it only "
                          f"where the batch is large enough).")
    _check_combinations(s)
    _check_weights(s)
    if heads is not None:
        _check_heads(s, heads)
    if mlp_hidden is not None and mlp_hidden % s.tensor_degree:
        raise ConfigError(f"tensor_degree={s.tensor_degree} does not divide the model's MLP width of {mlp_hidden}; "
                          f"pick a divisor of both it and the head count.")
    if num_blocks is not None and s.cache != "off" and num_blocks < 2:
        raise ConfigError(f"cache={s.cache!r} needs a model of 2 or more blocks (it runs the first and skips the rest); "
                          f"set cache off.")
    if num_blocks is not None and s.pipefusion_degree > num_blocks:
        raise ConfigError(f"pipefusion_degree={s.pipefusion_degree} exceeds the model's {num_blocks} transformer blocks; "
                          f"use at most {num_blocks} stages.")
    if cfg_scale is not None and s.cfg_degree == 2 and abs(cfg_scale - 1.0) < 1e-9:
        raise ConfigError("cfg_degree=2 needs cfg > 1 (at cfg 1 there is no uncond branch to run); "
                          "set cfg_degree=1 or raise cfg.")
    if steps is not None and steps < 1:
        raise ConfigError(f"steps={steps}; set steps to 1 or more.")
    if latent_hw is not None:
        _check_latent(s, latent_hw, patch)


def _check_degrees(s: StrategySpec, world_size: int) -> None:
    for name in DEGREES:
        v = getattr(s, name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} is not a positive integer; set it to 1 or more.")
    if s.num_pipeline_patch < 0 or s.warmup_steps < 0:
        raise ConfigError("num_pipeline_patch and warmup_steps must be 0 or more; set them to 0 (auto) or a positive number.")
    if s.cfg_degree > 2:
        raise ConfigError(f"cfg_degree={s.cfg_degree} but there are only two CFG branches (cond, uncond); set cfg_degree to 1 or 2.")
    if s.world_size != world_size:
        used = [f"{name.removesuffix('_degree')} {getattr(s, name)}" for name in DEGREES if getattr(s, name) > 1]
        raise ConfigError(f"{' x '.join(used) or 'serial'} = {s.world_size} ranks, but the loader has {world_size} "
                          f"device(s); choose degrees whose product is {world_size}, or change the devices.")


def _check_combinations(s: StrategySpec) -> None:
    if s.naive_patch_degree > 1 and (s.pipefusion_degree > 1 or s.ulysses_degree > 1 or s.ring_degree > 1
                                     or s.patch_degree > 1):
        raise ConfigError("naive_patch is a baseline that cannot be combined with pipefusion, patch, ulysses or ring; "
                          "set those degrees to 1 or naive_patch_degree to 1.")
    if s.patch_degree > 1 and (s.pipefusion_degree > 1 or s.ulysses_degree > 1 or s.ring_degree > 1):
        raise ConfigError("displaced patch parallel splits the sequence itself, so it combines with cfg and tensor "
                          "parallel only; set pipefusion, ulysses and ring degrees to 1 or patch_degree to 1.")
    if s.sharded and s.shard_group == 1:
        held = "each PipeFusion stage already holds only its blocks" if s.pipefusion_degree > 1 else \
            "each tensor rank already holds only its part of every block" if s.tensor_degree > 1 else "one device holds the model"
        raise ConfigError(f"shard_weights needs ranks that hold the same blocks (CFG, Ulysses, Ring or patch ranks), but "
                          f"in {s.label()} {held}; set shard_weights off, or add such a degree.")
    if (s.pipefusion_degree > 1 or s.patch_degree > 1) and s.warmup_steps < 1:
        what = "PipeFusion" if s.pipefusion_degree > 1 else "Displaced patch parallel"
        raise ConfigError(f"{what} needs warmup_steps >= 1 to fill its KV buffers; set warmup_steps to 1 or more.")


def _check_weights(s: StrategySpec) -> None:
    w = s.device_weights
    if not w:
        return
    if len(w) != s.world_size:
        raise ConfigError(f"device_weights lists {len(w)} weight(s) for {s.world_size} device(s); give one positive "
                          f"number per device, such as {','.join(['1'] * s.world_size)}.")
    if not all(math.isfinite(x) and x > 0 for x in w):
        raise ConfigError(f"device_weights {','.join(f'{x:g}' for x in w)} must all be positive numbers; "
                          f"give each device its relative speed, such as 3,2.")


def _check_heads(s: StrategySpec, heads: int) -> None:
    if heads % s.tensor_degree:
        raise ConfigError(f"tensor_degree={s.tensor_degree} does not divide the model's {heads} attention heads; "
                          f"pick a divisor of {heads} ({', '.join(str(d) for d in _divisors(heads))}).")
    local = heads // s.tensor_degree
    if local % s.ulysses_degree:
        what = f"the {local} heads each tensor-parallel rank holds" if s.tensor_degree > 1 else f"the model's {heads} attention heads"
        raise ConfigError(f"ulysses_degree={s.ulysses_degree} does not divide {what}; "
                          f"pick a divisor of {local} ({', '.join(str(d) for d in _divisors(local))}).")


def _check_latent(s: StrategySpec, latent_hw: tuple[int, int], patch: int) -> None:
    h, w = latent_hw
    if h % patch or w % patch:
        raise ConfigError(f"latent {h}x{w} is not a multiple of the model's {patch}x{patch} patch; use a width and "
                          f"height that are multiples of 16 pixels.")
    rows, cols = h // patch, w // patch
    tokens = rows * cols
    sp = s.ring_degree * s.ulysses_degree * s.naive_patch_degree * s.patch_degree
    if s.pipefusion_degree > 1:
        # Patches are near-equal token runs (any count at any size), each split over the Ulysses ranks.
        if s.patches > tokens:
            raise ConfigError(f"num_pipeline_patch={s.patches} exceeds the latent's {tokens} image tokens "
                              f"({rows * 16}x{cols * 16} px); use at most {tokens} patches.")
        tokens //= s.patches
    if tokens < sp:  # shards may differ by a row, but none may be empty
        raise ConfigError(f"the latent's {tokens} image tokens{' per pipeline patch' if s.pipefusion_degree > 1 else ''} "
                          f"({rows * 16}x{cols * 16} px) are fewer than the {sp} ranks splitting them; generate a larger "
                          f"image or lower the degrees.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def latent_plane(spatial) -> tuple[int, int]:
    """A latent's spatial size (H, W) or (T, H, W) as the (rows, columns) the strategies cut: a video's frames
    stack their rows (its tokens run frame after frame, row after row)."""
    *rows, cols = spatial
    return math.prod(rows), cols


def fit_to_latent(s: StrategySpec, latent_hw: tuple[int, int], patch: int = 2) -> tuple[StrategySpec, str | None]:
    """The strategy for one model call whose latent may be smaller than the job's (an area conditioning crops the
    latent per cond): `s` where it fits, else the same devices as a pipeline of whole-image stages (PipeFusion
    with one patch: exact, splits no token) beside the same CFG split, and a sentence saying so. Stock KSampler
    raises nothing for a small area, so neither may the parallel MODEL."""
    try:
        validate_strategy(s, world_size=s.world_size, latent_hw=latent_hw, patch=patch)
        return s, None
    except ConfigError:
        pass
    stages = s.world_size // s.cfg_degree
    fallback = StrategySpec(cfg_degree=s.cfg_degree, pipefusion_degree=stages, num_pipeline_patch=1,
                            warmup_steps=max(1, s.warmup_steps))
    # Splits no token, so only a latent no strategy takes fails here (an odd size), with that one's sentence.
    validate_strategy(fallback, world_size=fallback.world_size, latent_hw=latent_hw, patch=patch)
    h, w = latent_hw
    return fallback, (f"a {w // patch * 16}x{h // patch * 16} px area is too small for {s.label()}, so its calls run as "
                      f"{fallback.label()} (whole-image pipeline stages: exact, slower)")


def stage_speeds(s: StrategySpec) -> tuple[float, ...]:
    """Each PipeFusion stage's speed under the job's device_weights (empty where they are equal): the devices of a
    stage share its work, so their weights add up; every CFG branch runs the same stages, so the slower branch's
    sum counts."""
    if s.pipefusion_degree == 1 or not s.balanced:
        return ()
    t = Topology.from_strategy(s)
    speeds = []
    for stage in range(t.pipefusion):
        per_branch = [sum(s.device_weights[r] for r in range(t.world_size)
                          if t.coords(r)["pipefusion"] == stage and t.coords(r)["cfg"] == c) for c in range(t.cfg)]
        speeds.append(min(per_branch))
    return tuple(speeds) if len(set(speeds)) > 1 else ()
