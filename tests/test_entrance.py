"""The runtime's one planning entrance for both nodes (runtime/entrance.py): manual degrees as set (with measured
speeds where asked), auto's pick within the workers' memory report with the Selector's knobs laid over it, and a
model call's plan fitted to its latent."""
from __future__ import annotations

import types

import pytest

from parallel_runtime.planning import auto, balance
from parallel_runtime.runtime.entrance import plan
from parallel_runtime.spec import ModelSpec, StrategySpec

MODEL = ModelSpec(path="/m.safetensors", weight_dtype="bf16")


class Client:
    def memory_budget(self):
        return 8 * 2 ** 30


def request(mode="auto", measured=False, **spec):
    return types.SimpleNamespace(mode=mode, spec=StrategySpec(**spec), measured=measured)


class Asked(list):
    """choose_strategy's calls, and the pick it returns."""
    pick: StrategySpec


@pytest.fixture
def chooser(monkeypatch):
    asked = Asked()

    def choose_strategy(path, shape, cfg, devices, **kw):
        asked.append((path, shape, cfg, devices, kw))
        return asked.pick, "auto's reason"
    asked.pick = StrategySpec(ulysses_degree=2)
    monkeypatch.setattr(auto, "choose_strategy", choose_strategy)
    monkeypatch.setattr(balance, "measured_weights", lambda client, path, shape, text, dtype: (0.5, 1.0))
    return asked


def test_manual_runs_as_set_and_measured_speeds_are_timed(chooser):
    assert plan(Client(), request("manual", ring_degree=2), MODEL, (1, 16, 8, 8), 1.0, "cpu:2") == \
        (StrategySpec(ring_degree=2), "manual", None)
    spec = plan(Client(), request("manual", True, ulysses_degree=2), MODEL, (1, 16, 8, 8), 1.0, "cpu:2").strategy
    assert spec == StrategySpec(ulysses_degree=2, device_weights=(0.5, 1.0)) and chooser == []


def test_auto_plans_within_the_workers_memory_and_keeps_the_selectors_knobs(chooser):
    strategy, reason, note = plan(Client(), request(), MODEL, (1, 16, 8, 8), 3.5, "cpu:2")
    assert (strategy, reason, note) == (StrategySpec(ulysses_degree=2), "auto's reason", None)
    assert chooser == [("/m.safetensors", (1, 16, 8, 8), 3.5, "cpu:2", {"memory_budget_bytes": 8 * 2 ** 30})]
    chooser.clear()
    plan(Client(), request(measured=True), MODEL, (1, 16, 8, 8), 1.0, "cpu:2", per_call=True)
    assert chooser[0][4] == {"memory_budget_bytes": 8 * 2 ** 30, "per_call": True, "speeds": (0.5, 1.0)}
    chooser.pick = StrategySpec(pipefusion_degree=2)
    knobs = request(num_pipeline_patch=4, warmup_steps=2)
    assert plan(Client(), knobs, MODEL, (1, 16, 8, 8), 1.0, "cpu:2").strategy == \
        StrategySpec(pipefusion_degree=2, num_pipeline_patch=4, warmup_steps=2)
    chooser.pick = StrategySpec(cfg_degree=2, ulysses_degree=2)  # replicas over the CFG pair: shard on as asked
    assert plan(Client(), request(shard_weights=True), MODEL, (1, 16, 8, 8), 3.5, "cpu:4").strategy.sharded


def test_a_model_call_too_small_for_the_degrees_runs_whole_image_stages(chooser):
    """An 8x8 latent (4x4 tokens at patch 2) fits Ulysses-2; a 2x2 latent (one token, as a 16x16 px area crops it)
    does not: the call runs as PipeFusion with one patch over the same devices (exact)."""
    fits = plan(Client(), request("manual", ulysses_degree=2), MODEL, (1, 16, 8, 8), 1.0, "cpu:2", per_call=True)
    assert fits.strategy == StrategySpec(ulysses_degree=2) and fits.note is None
    small = plan(Client(), request("manual", ulysses_degree=2), MODEL, (1, 16, 2, 2), 1.0, "cpu:2", per_call=True)
    assert small.strategy.pipefusion_degree == 2 and small.strategy.ulysses_degree == 1
    assert "too small for ulysses2" in small.note


def test_the_selectors_cache_rides_on_auto_and_a_model_call_runs_uncached_with_a_note(chooser):
    cache = dict(cache="first_block", cache_threshold=0.08, cache_start=0.1, cache_end=0.9)
    picked = plan(Client(), request(**cache), MODEL, (1, 16, 8, 8), 3.5, "cpu:2")
    assert picked.strategy == StrategySpec(ulysses_degree=2, **cache) and picked.note is None
    chooser.pick = StrategySpec(pipefusion_degree=2)  # PipeFusion too (stage 0 decides, one step late)
    piped = plan(Client(), request(**cache), MODEL, (1, 16, 8, 8), 3.5, "cpu:2")
    assert piped.strategy == StrategySpec(pipefusion_degree=2, **cache) and "cache" not in piped.reason
    # A stock sampler's model call is one step of the host's loop: the cache is the host's (EasyCache), not ours.
    call = plan(Client(), request("manual", ulysses_degree=2, **cache), MODEL, (1, 16, 8, 8), 1.0, "cpu:2",
                per_call=True)
    assert call.strategy == StrategySpec(ulysses_degree=2) and "EasyCache" in call.note
