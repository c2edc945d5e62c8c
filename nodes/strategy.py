"""Strategy Selector: how a job is split over the workers (or "let the runtime choose")."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import convert

StrategyType = io.Custom(convert.STRATEGY_TYPE)


class ParaDiTStrategy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParaDiTStrategy",
            display_name="Strategy Selector",
            category=convert.CATEGORY,
            description="Chooses how the Parallel Sampler splits each step over the workers: batch, CFG, "
                        "PipeFusion, Ulysses, Ring, tensor and displaced patch degrees, device weights for unequal devices, sharded weights for models bigger than one device, and a step cache. In auto mode the runtime chooses at sample time and writes its "
                        "choice and reason on this node.",
            inputs=convert.build_inputs(io, convert.STRATEGY_INPUTS),
            outputs=[StrategyType.Output(display_name="strategy")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, mode, cfg_degree, pipefusion_degree, ulysses_degree, ring_degree,
                num_pipeline_patch, warmup_steps, tensor_degree=1, patch_degree=1, device_weights="",
                shard_weights="auto", p2p="auto", batch_degree=1, cache="off", cache_threshold=0.1, cache_start=0.0,
                cache_end=1.0) -> io.NodeOutput:
        node_id = getattr(cls.hidden, "unique_id", None) if cls.hidden is not None else None
        choice = convert.strategy_choice(mode, cfg_degree, pipefusion_degree, ulysses_degree, ring_degree,
                                         num_pipeline_patch, warmup_steps, node_id=node_id, tensor_degree=tensor_degree,
                                         patch_degree=patch_degree, device_weights=device_weights,
                                         shard_weights=shard_weights, p2p=p2p, batch_degree=batch_degree, cache=cache,
                                         cache_threshold=cache_threshold, cache_start=cache_start, cache_end=cache_end)
        from .host import HOST

        HOST.send_text(choice.describe(), node_id)
        return io.NodeOutput(choice, ui=ui.PreviewText(choice.describe()))
