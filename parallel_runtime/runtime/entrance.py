"""The one way into the runtime's planning for both nodes: which strategy runs a job (Parallel Sampler's whole
denoise) or a stock sampler's model call, from the Strategy Selector's request.

A request is manual (its degrees as set, with measured device speeds where asked) or auto (planning.auto picks
the degrees for the devices, the latent and cfg within the workers' own memory report, and the Selector's
PipeFusion knobs and sharding are laid over its pick). A model call is planned per call (PipeFusion drains each
call: auto weighs that) and then fitted to the call's latent, which an area conditioning may have cropped
(topology.fit_to_latent). The nodes only turn ComfyUI's types into these arguments and show the result.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

from ..spec import CACHE_FIELDS, ModelSpec, StrategySpec


class StrategyRequest(Protocol):
    """What the Strategy Selector asks for (nodes' StrategyChoice)."""

    mode: str  # "auto" | "manual"
    spec: StrategySpec  # manual: the degrees; auto: only the PipeFusion knobs and shard_weights to lay over
    measured: bool  # device_weights 'measured': time the devices on this job's shapes first


class Plan(NamedTuple):
    strategy: StrategySpec
    reason: str  # why these degrees ("manual", or auto's one line)
    note: str | None = None  # a model call's latent too small for them: what runs instead, one sentence


def plan(client, request: StrategyRequest, model: ModelSpec, latent_shape: tuple, cfg: float, devices: str, *,
         text_tokens: int | None = None, per_call: bool = False, patch: int = 2) -> Plan:
    """The StrategySpec to run, why, and for a model call whether its latent changed it. `latent_shape`: one
    chunk's latent ([B, C, H, W] or [B, C, T, H, W]); `per_call`: a stock sampler's model call, whose latent the
    plan is then fitted to (`patch`: latent pixels per token side); `text_tokens`: the prompt's length, for
    measured speeds (auto's typical length if None)."""
    weights = request.spec.device_weights
    if request.measured:
        from ..planning.auto import DEFAULT_TEXT_TOKENS
        from ..planning.balance import measured_weights

        weights = measured_weights(client, model.path, tuple(latent_shape), text_tokens or DEFAULT_TEXT_TOKENS,
                                   model.weight_dtype)
    if request.mode == "manual":
        spec, reason = dataclasses.replace(request.spec, device_weights=weights), "manual"
        warning = _placement_warning(client, spec)
        if warning:  # run as asked (the user may know better), but say what the slow link will cost
            reason = f"manual; {warning}"
    else:
        spec, reason = _auto(client, request, model, latent_shape, cfg, devices, weights, per_call)
    if not per_call:
        return Plan(spec, reason)
    from ..distributed.topology import fit_to_latent, latent_plane

    fitted, note = fit_to_latent(spec, latent_plane(tuple(latent_shape)[2:]), patch)
    if fitted.cache != "off":
        # A model call is one step of the host's sampler: the step loop, and so the cache, is the host's.
        fitted = dataclasses.replace(fitted, **{f: getattr(StrategySpec(), f) for f in CACHE_FIELDS})
        note = "; ".join(filter(None, [note, CALL_CACHE_NOTE]))
    return Plan(fitted, reason, note)


def _placement_warning(client, spec: StrategySpec) -> str | None:
    """placement.placement_warning's sentence for a manual plan whose all-to-all or tensor traffic crosses from one
    machine to another (a network link, far slower than the links inside a machine: its measured speed is in the
    sentence); None on one machine or where nothing heavy crosses."""
    if not getattr(client, "remote", False) or spec.world_size != client.world:
        return None  # one machine; or degrees that do not fit the devices, which validation refuses next
    import logging

    from ..planning import placement

    warning = placement.placement_warning(spec, client.hosts, client.host_links())
    if warning:
        logging.getLogger("paradit").warning("ParaDiT: %s", warning)
    return warning


CALL_CACHE_NOTE = ("the Strategy Selector's cache runs in Parallel Sampler's own step loop only, so this KSampler "
                   "runs uncached: put ComfyUI's EasyCache or LazyCache on the MODEL for a cache there")


def _auto(client, request: StrategyRequest, model: ModelSpec, latent_shape: tuple, cfg: float, devices: str,
          weights: tuple, per_call: bool) -> tuple[StrategySpec, str]:
    """auto's pick within the workers' own memory report, the Selector's knobs laid over it."""
    from ..planning.auto import choose_strategy

    kw = dict(memory_budget_bytes=client.memory_budget())
    if getattr(client, "remote", False):  # ranks on other machines: their devices and the links between the hosts
        kw.update(device_list=client.devices, hosts=client.hosts, host_links=client.host_links())
    if per_call:
        kw["per_call"] = True
    if weights:
        kw["speeds"] = weights
    spec, reason = choose_strategy(model.path, tuple(latent_shape), float(cfg), devices, **kw)
    asked = request.spec
    # The plan's sharding: the Selector's, where the chosen plan has ranks that hold the same blocks (auto chose
    # it on already where nothing fits otherwise).
    if asked.shard_weights is not True or spec.shard_group > 1:
        spec = dataclasses.replace(spec, shard_weights=spec.shard_weights or asked.shard_weights)
    overrides = {}
    if asked.num_pipeline_patch:
        overrides["num_pipeline_patch"] = asked.num_pipeline_patch
    if asked.warmup_steps != StrategySpec().warmup_steps:
        overrides["warmup_steps"] = asked.warmup_steps
    if overrides and spec.pipefusion_degree > 1:
        spec = dataclasses.replace(spec, **overrides)
    if asked.cache != "off":  # the Selector's cache rides on any pick it runs with
        spec = dataclasses.replace(spec, **{f: getattr(asked, f) for f in CACHE_FIELDS})
    return spec, reason
