"""mode=auto: pick the degrees for a job from the cost model, calibrated on the machine at hand.

Every StrategySpec that fits the device count, the model (heads, blocks), the latent (divisibility) and
cfg is projected with `costmodel.project`; those that do not fit in memory are dropped (a model that does
not fit replicated therefore ends up on PipeFusion stages), and the fastest projected job wins. Naive
patch parallelism is a quality baseline, never a choice. PipeFusion (stale activations, not bit-exact)
must beat the best exact strategy by more than `EXACT_PREFERENCE` to be picked when both fit.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ..distributed.devices import pinned_cores, resolve_dtype, runtime_devices
from ..distributed.stages import patch_period
from ..distributed.topology import Topology, latent_plane, stage_speeds, validate_strategy
from ..errors import ConfigError
from ..models.registry import family_of, prompt_rows, token_patch
from ..spec import StrategySpec
from ..strategies.batch import largest_share
from . import costmodel, placement
from .memory import CPU_USABLE, CPU_WORKER_OVERHEAD, CUDA_USABLE, weight_bytes

EXACT_PREFERENCE = 0.03  # PipeFusion must be >3% faster than the best exact strategy to be chosen
DEFAULT_TEXT_TOKENS = 256  # T5 tokens of a typical Flux prompt as ComfyUI encodes it
DEFAULT_STEPS = 20


@dataclass
class Candidate:
    strategy: StrategySpec
    projection: costmodel.Projection
    memory: dict
    fits: bool
    # Heavy dims whose groups cross a host link slower than the local one (placement.heavy_crossings), and the job's
    # projection had every link been the local one: what says a plan lost because it crossed.
    slow_crossing: tuple[str, ...] = ()
    one_link_job_s: float | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_strategies(world: int, cfg: float, *, heads: int, num_blocks: int, latent_hw: tuple[int, int],
                         warmup_steps: int = 1, patch: int = 2, mlp_hidden: int | None = None,
                         tensor: bool = False, batch: int = 1) -> list[StrategySpec]:
    """Every valid (batch x cfg x pipefusion x ring x ulysses x tensor) split of `world`, PipeFusion with M = P and
    2P; tensor splits only where the family splits its layers (`tensor`), batch groups only as many as the
    latent's `batch` has images."""
    out = []
    uses_uncond = abs(cfg - 1.0) > 1e-9
    for bd, c, p, r, t in itertools.product(_divisors(world), (1, 2), _divisors(world), _divisors(world),
                                            _divisors(world)):
        if world % (bd * c * p * r * t) or (t > 1 and not tensor) or bd > batch:
            continue
        u = world // (bd * c * p * r * t)
        if c == 2 and not uses_uncond:
            continue
        for m in ((p, 2 * p) if p > 1 else (0,)):
            s = StrategySpec(batch_degree=bd, cfg_degree=c, pipefusion_degree=p, ulysses_degree=u, ring_degree=r,
                             tensor_degree=t, num_pipeline_patch=m if p > 1 else 0, warmup_steps=warmup_steps)
            try:
                validate_strategy(s, world_size=world, heads=heads, num_blocks=num_blocks, latent_hw=latent_hw,
                                  cfg_scale=cfg, patch=patch, mlp_hidden=mlp_hidden, batch=batch)
            except ConfigError:
                continue
            out.append(s)
    return out


def image_tokens(config, h: int, w: int) -> int:
    """Image tokens of an h x w latent plane: (h / patch) x (w / patch) for the family's patch."""
    p = token_patch(config)
    return (h // p) * (w // p)


def device_memory_budget(devices: list[str]) -> int:
    """Bytes one worker may use: free GPU memory, or the host's available memory shared by CPU workers."""
    if devices[0].startswith("cuda"):
        return min(int(torch.cuda.mem_get_info(torch.device(d))[0] * CUDA_USABLE) for d in devices)
    import psutil

    cpu_workers = sum(d == "cpu" for d in devices)
    return int(psutil.virtual_memory().available * CPU_USABLE / max(cpu_workers, 1)) - CPU_WORKER_OVERHEAD


def rank_candidates(config, latent_shape: tuple, cfg: float, devices: list[str], calib: costmodel.Calibration, *,
                    text_len: int, steps: int, weight_dtype: str = "default", memory_budget_bytes: int | None = None,
                    warmup_steps: int = 1, per_call: bool = False, speeds: tuple[float, ...] = (),
                    shared: tuple = (), hosts: tuple[str, ...] = (), host_links: dict | None = None) -> list[Candidate]:
    """All candidates, projected and checked against memory, fastest first. `speeds`: each device's relative speed
    (measured or the user's device_weights); where they differ every split is projected both equal and balanced
    (device_weights = speeds), and the balanced twin is offered only where it is projected faster. `shared`: per
    rank, the device it runs on where ranks share one (a pinned core: devices.pinned_cores), else None. `hosts`:
    per rank, the host it runs on (contiguous, as the runtime places them); each op whose groups span hosts is
    projected on the slowest `host_links` link it crosses, and on equal projections a plan that keeps the heavy
    dims off links slower than the local one ranks first."""
    b, _, h, w = latent_shape
    world = len(devices)
    text_len = prompt_rows(config, text_len)  # the rows the workers run (FLUX.2 pads its prompt to 512)
    e = weight_bytes(weight_dtype, devices[0])
    budget = device_memory_budget(devices) if memory_budget_bytes is None else memory_budget_bytes
    layout = costmodel.param_layout(config)
    host_links = host_links or {}
    local_bw = calib.link.bandwidth if calib.link is not None else float("inf")

    def projected(s: StrategySpec) -> tuple[costmodel.Projection, costmodel.Projection]:
        """`s` on its links across hosts, and on the local link alone."""
        one_link = costmodel.project(s, config, calib, cfg=cfg, steps=steps, batch=b, act_bytes=e, per_call=per_call)
        links = placement.links_by_op(s, hosts, host_links)
        if not links:
            return one_link, one_link
        return costmodel.project(s, config, calib, cfg=cfg, steps=steps, batch=b, act_bytes=e, per_call=per_call,
                                 links=links), one_link

    def candidate(s: StrategySpec, proj, one_link, mem) -> Candidate:
        slow = tuple(placement.heavy_crossings(s, hosts, host_links, slower_than=local_bw))
        return Candidate(s, proj, mem, mem["total"] <= budget, slow, one_link.job_s)

    out = []
    from ..validate import av_sampling_problem, is_av_family

    tensor = bool(family_of(config).tensor_plan_for(config))
    av_family = is_av_family(config)
    for s in candidate_strategies(world, cfg, heads=config.num_heads,
                                  num_blocks=config.num_blocks, latent_hw=(h, w),
                                  warmup_steps=warmup_steps, patch=token_patch(config),
                                  mlp_hidden=getattr(config, "mlp_hidden", None), tensor=tensor, batch=b):
        if av_family and av_sampling_problem(config, s):  # what an audio-video job cannot run (validate)
            continue
        mem = costmodel.rank_memory(s, config, text_tokens=text_len, image_tokens=image_tokens(config, h, w), batch=b,
                                    cfg=cfg, weight_bytes=e, act_bytes=e, layout=layout)
        proj, one_link = projected(s)
        if mem["total"] > budget and s.shard_group > 1:
            # Too big replicated: the same split with the blocks sharded over its replicas, if that fits (its
            # gathers are in the projection), is a candidate in its place.
            s = dataclasses.replace(s, shard_weights=True)
            mem = costmodel.rank_memory(s, config, text_tokens=text_len, image_tokens=image_tokens(config, h, w),
                                        batch=b, cfg=cfg, weight_bytes=e, act_bytes=e, layout=layout)
            proj, one_link = projected(s)
        if len(set(speeds)) > 1:
            balanced = dataclasses.replace(s, device_weights=tuple(speeds))
            gain = _slowdown(balanced, config, speeds, shared)
            on_speeds = dataclasses.replace(_on_speeds(proj, gain), strategy=balanced)
            slowdown = _slowdown(s, config, speeds, shared)
            proj, one_link, balanced_one_link = (_on_speeds(proj, slowdown), _on_speeds(one_link, slowdown),
                                                 _on_speeds(one_link, gain))
            if on_speeds.job_s < proj.job_s:  # a balance that does not gain is not offered
                out.append(candidate(balanced, on_speeds, balanced_one_link, mem))
        out.append(candidate(s, proj, one_link, mem))
    out.sort(key=rank_key)
    return out


def rank_key(c: Candidate) -> tuple:
    """Fastest projected first; on a tie, the plan whose heavy traffic stays off slow host links."""
    return c.projection.job_s, len(c.slow_crossing)


def balance_gain(s: StrategySpec, config, speeds: tuple[float, ...], shared: tuple = ()) -> float:
    """The projected compute speed-up of `s` with shares by `speeds` over equal shares on those devices (what
    rank_candidates weighs before offering the balanced twin; `shared` as there)."""
    balanced = dataclasses.replace(s, device_weights=tuple(speeds))
    equal = dataclasses.replace(s, device_weights=())
    return _slowdown(equal, config, speeds, shared) / _slowdown(balanced, config, speeds, shared)


def _slowdown(s: StrategySpec, config, speeds: tuple[float, ...], shared: tuple) -> float:
    """How much longer `s`'s compute takes on devices of these speeds than on equal devices of their mean speed
    (what the calibration measured). Every collective waits for the slowest rank: with equal shares that is the
    slowest device (mean / min), with shares in proportion to speed every rank finishes together (1). Coarse
    where heads bound a split; PipeFusion's stages are whole blocks, so its figure comes from the stages the
    workers will run (`_pipeline_slowdown`)."""
    if s.pipefusion_degree > 1:
        return _pipeline_slowdown(s, config, speeds, shared)
    return 1.0 if s.balanced else (sum(speeds) / len(speeds)) / min(speeds)


def _pipeline_slowdown(s: StrategySpec, config, speeds: tuple[float, ...], shared: tuple) -> float:
    """A full pipeline's time per patch (stages.patch_period) at the stages `s`'s workers run (by stage speed where
    `s` is balanced), over that of the equal stages on equal devices of the mean speed. Each rank runs its stage's
    blocks, shared with the other ranks of its stage and branch (by device weight where `s` is balanced)."""
    t = Topology.from_strategy(s)
    family = family_of(config)
    ranks = range(t.world_size)

    def rank_work(stages: list, weights: tuple[float, ...]) -> list[float]:
        work = []
        for r in ranks:
            mine = t.coords(r)
            mates = [q for q in ranks if all(t.coords(q)[d] == mine[d] for d in ("pipefusion", "cfg"))]
            blocks = sum(len(chunk) for chunk in stages[mine["pipefusion"]])
            work.append(blocks * weights[r] / sum(weights[q] for q in mates))
        return work

    equal = family.pipeline_stages(config, t.pipefusion)
    ones = (1.0,) * t.world_size
    if s.balanced:
        work = rank_work(family.pipeline_stages(config, t.pipefusion, stage_speeds(s)), s.device_weights)
    else:
        work = rank_work(equal, ones)
    mean = sum(speeds) / len(speeds)
    return (patch_period(work, list(speeds), list(shared) or None)
            / patch_period(rank_work(equal, ones), [mean] * t.world_size))


def _on_speeds(proj: costmodel.Projection, factor: float) -> costmodel.Projection:
    """A projection made for equal devices (calibrated on their mean speed) with its compute `factor` x longer."""
    extra = proj.compute_s * (factor - 1.0)
    step_s = proj.step_s + extra
    return dataclasses.replace(proj, step_s=step_s, compute_s=proj.compute_s * factor,
                               job_s=proj.job_s * (step_s / proj.step_s if proj.step_s > 0 else 1.0))


def pick(candidates: list[Candidate]) -> Candidate | None:
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None
    best = fitting[0]
    # An exact plan whose heavy traffic crosses a slow host link is not preferred over a faster one that keeps it
    # inside the hosts.
    exact = [c for c in fitting if c.strategy.pipefusion_degree == 1 and not c.slow_crossing]
    if best.strategy.pipefusion_degree > 1 and exact:
        if exact[0].projection.job_s <= best.projection.job_s * (1 + EXACT_PREFERENCE):
            best = exact[0]
    return best


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def describe_choice(best: Candidate, candidates: list[Candidate], serial_job_s: float, cfg: float,
                    calib: costmodel.Calibration, budget: int, batch: int = 1, hosts: tuple[str, ...] = (),
                    host_links: dict | None = None) -> str:
    s, proj = best.strategy, best.projection
    label = _strategy_text(s)
    speedup = serial_job_s / proj.job_s if proj.job_s > 0 else float("nan")
    parts = [f"{label}: {speedup:.2f}x projected over one device ({proj.describe()})"]
    notes = []
    if abs(cfg - 1.0) <= 1e-9:
        notes.append("cfg parallel skipped: cfg=1")
    replicated = [c for c in candidates if c.strategy.pipefusion_degree == 1]
    if replicated and not any(c.fits for c in replicated):
        need = min(c.memory["total"] for c in replicated)
        notes.append(f"PipeFusion required: replicated needs {_gb(need)} per device, budget {_gb(budget)}")
    if s.sharded:
        notes.append(f"sharding weights: the model does not fit replicated in {_gb(budget)} per device, so each of "
                     f"{s.shard_group} devices keeps 1/{s.shard_group} of every block ({_gb(best.memory['params'])} "
                     f"of weights per device) and gathers a block before it runs")
    if s.batch_degree > 1:
        notes.append(f"batch parallel: {s.batch_degree} groups of {s.world_size // s.batch_degree} device(s) each "
                     f"denoise up to {largest_share(s, batch)} of the {batch} images, with no traffic between groups "
                     f"until the result")
    if s.pipefusion_degree == 1:
        pipe = [c for c in candidates if c.strategy.pipefusion_degree > 1 and c.fits]
        if pipe and pipe[0].projection.job_s < proj.job_s:
            notes.append(f"{_strategy_text(pipe[0].strategy)} projected {proj.job_s / pipe[0].projection.job_s:.2f}x "
                         f"faster but inexact (stale KV); kept the exact strategy")
    notes.extend(_placement_notes(best, candidates, hosts, host_links or {}))
    notes.append(f"measured: {calib.describe()}")
    return "; ".join(parts + notes)


def _placement_notes(best: Candidate, candidates: list[Candidate], hosts: tuple[str, ...],
                     host_links: dict) -> list[str]:
    """The pick's heavy traffic on a slow host link (placement_warning's sentence), or the faster-on-one-host plan
    it beat because that one's heavy traffic would cross a slow link."""
    if best.slow_crossing:
        return [placement.placement_warning(best.strategy, hosts, host_links).rstrip(".")]  # one of the "; " notes
    crossed = sorted((c for c in candidates if c.fits and c.slow_crossing
                      and c.one_link_job_s is not None and c.one_link_job_s < best.projection.job_s),
                     key=lambda c: c.one_link_job_s)
    if not crossed:
        return _across_hosts_note(best.strategy, hosts, host_links)
    lost = crossed[0]
    crossing = placement.heavy_crossings(lost.strategy, hosts, host_links)
    pair, link = min(crossing.values(), key=lambda pl: pl[1].bandwidth)
    dims = " and ".join(d for d in placement.HEAVY_DIMS if d in crossing)
    return [f"kept {dims} inside each host: {placement.link_text(pair, link)} ({_strategy_text(lost.strategy)} "
            f"projected {lost.projection.job_s:.3g} s across it against {lost.one_link_job_s:.3g} s on one host's "
            f"link; this plan {best.projection.job_s:.3g} s)"]


def _across_hosts_note(s: StrategySpec, hosts: tuple[str, ...], host_links: dict) -> list[str]:
    """Which of the pick's dimensions cross hosts, over which measured link: what a user with several machines
    checks first (nothing heavy crosses here, or the pick would carry placement_warning's sentence)."""
    if len(set(hosts)) < 2:
        return []
    crossing = placement.crossing_groups(Topology.from_strategy(s), hosts)
    dims = list(dict.fromkeys(dim for dim, _, _ in crossing))
    pairs = sorted({pair for _, _, spanned in crossing for pair in itertools.combinations(sorted(spanned), 2)
                    if pair in host_links})
    links = ", ".join(placement.link_text(pair, host_links[pair]) for pair in pairs)
    inside = [d for d in placement.HEAVY_DIMS if getattr(s, f"{d}_degree") > 1 and d not in dims]
    where = f"{' and '.join(dims)} across hosts" if dims else "every group inside one host"
    return [f"{where}{f' ({links})' if links else ''}" + (f", {' and '.join(inside)} inside each" if inside and dims
                                                          else "")]


def _strategy_text(s: StrategySpec) -> str:
    parts = [f"{name}={deg}" for name, deg in (("batch", s.batch_degree), ("cfg", s.cfg_degree),
                                              ("pipefusion", s.pipefusion_degree),
                                              ("ulysses", s.ulysses_degree), ("ring", s.ring_degree),
                                              ("tensor", s.tensor_degree)) if deg > 1]
    if s.pipefusion_degree > 1:
        parts.append(f"patches={s.patches}")
    if s.sharded:
        parts.append("shard_weights")
    if s.balanced:
        parts.append("shares " + ":".join(f"{w:g}" for w in s.device_weights))
    return " ".join(parts) or "serial"


def choose_strategy(model_path: str, latent_shape: tuple, cfg: float, devices: str, *,
                    text_len: int = DEFAULT_TEXT_TOKENS, steps: int = DEFAULT_STEPS, threads: int | None = None,
                    weight_dtype: str = "default", memory_budget_bytes: int | None = None,
                    calibration: costmodel.Calibration | None = None, warmup_steps: int = 1,
                    refresh: bool = False, per_call: bool = False,
                    speeds: tuple[float, ...] = (), hosts: tuple[str, ...] = (), host_links: dict | None = None,
                    device_list: list[str] | None = None) -> tuple[StrategySpec, str]:
    """The strategy to run a job on `devices`, and a one-line reason. `per_call`: for a stock sampler's model
    calls (PipeFusion drains its pipeline every call).

    Across hosts the runtime gives `device_list` (each rank's bare device name, as `devices` names remote ones this
    host cannot resolve), `hosts` (each rank's host: contiguous, this host's first) and `host_links` (the measured
    link per sorted host pair): traffic that crosses hosts is projected on its link (see rank_candidates), and
    threads and the memory budget are this host's.

    Calibration (block compute at this job's token count, link between the workers) is measured on first
    use and cached on disk; pass `calibration` to reuse one, `memory_budget_bytes` to override the
    per-device memory limit.
    """
    from ..validate import model_config

    remote = device_list is not None
    if not remote:
        device_list, _ = runtime_devices(devices)  # the runtime's own (without NCCL, 'auto' is one GPU)
    world = len(device_list)
    if hosts and len(hosts) != world:
        raise ConfigError(f"the runtime names the host of {len(hosts)} rank(s) for {world} device(s); give one host "
                          f"per device.")
    local = hosts.count(hosts[0]) if hosts else world  # ranks on this host: its cores and memory are measured here
    config = model_config(model_path)
    if len(latent_shape) not in (4, 5):
        raise ConfigError(f"latent shape {tuple(latent_shape)} is not [batch, channels, (frames,) height/8, width/8].")
    b, _, *spatial = latent_shape
    h, w = latent_plane(spatial)  # a video's frames stack their token rows
    text_len = prompt_rows(config, text_len)  # the rows the workers run (FLUX.2 pads its prompt to 512)
    if world == 1:
        return StrategySpec(), "one device: serial"
    if threads is None:
        threads = max(1, costmodel.available_cores() // local) if device_list[0] == "cpu" else 1
    if calibration is None:
        dtype = resolve_dtype(weight_dtype, torch.device(device_list[0]))
        calibration = costmodel.calibrate(config, text_len, image_tokens(config, h, w), device_list, threads=threads,
                                          dtype=dtype, refresh=refresh)
    budget = device_memory_budget(device_list[:local]) if memory_budget_bytes is None else memory_budget_bytes
    candidates = rank_candidates(config, (b, latent_shape[1], h, w), cfg, device_list, calibration, text_len=text_len,
                                 steps=steps, weight_dtype=weight_dtype, memory_budget_bytes=budget,
                                 warmup_steps=warmup_steps, per_call=per_call, speeds=speeds,
                                 shared=() if remote else tuple(pinned_cores(devices)[:world]), hosts=hosts,
                                 host_links=host_links)
    best = pick(candidates)
    if best is None:
        need = min((c.memory["total"] for c in candidates), default=0)
        raise ConfigError(f"the model does not fit on {world} device(s): the leanest split needs about {_gb(need)} "
                          f"per device but {_gb(budget)} is available; add devices, pick weight_dtype bf16, or "
                          f"lower the resolution.")
    serial = costmodel.project(StrategySpec(), config, calibration, cfg=cfg, steps=steps, batch=b,
                               act_bytes=weight_bytes(weight_dtype, device_list[0]))
    # The serial reference runs alone: no contention from other workers.
    return best.strategy, describe_choice(best, candidates, serial.job_s, cfg, calibration, budget, b, hosts=hosts,
                                          host_links=host_links)
