"""The configurations the bench (and the demo and soak) run: serial, every pure strategy at 2/4/8 ranks, the
hybrids and naive patch that fit the model and the devices."""
from __future__ import annotations

from ..errors import ConfigError
from ..distributed.topology import validate_strategy
from ..spec import StrategySpec

CFG_PARALLEL_SCALE = 3.5  # cfg used for the CFG-parallel rows when the grid itself runs at cfg 1


def grid(max_world: int, *, cfg: float, heads: int, num_blocks: int, latent_hw: tuple[int, int], patch: int = 2,
         mlp_hidden: int | None = None, tensor: bool = True,
         skipped: list[tuple[str, str]] | None = None) -> list[tuple[StrategySpec, float]]:
    """(strategy, cfg) pairs: serial, pure strategies at 2/4/8 ranks, hybrids and naive patch that fit the model
    (its heads, blocks, MLP width, whether its family splits layers for tensor parallel: `tensor`) and the latent.
    `skipped` gets (label, the runtime's sentence) for each row left out."""
    cfg_rows = cfg if abs(cfg - 1.0) > 1e-9 else CFG_PARALLEL_SCALE
    rows: list[tuple[StrategySpec, float]] = [(StrategySpec(), cfg)]
    if abs(cfg - 1.0) <= 1e-9 and max_world >= 2:
        rows.append((StrategySpec(), cfg_rows))  # serial reference of the CFG-parallel rows
    S = StrategySpec
    for w in (2, 4, 8):
        if w > max_world:
            break
        h = w // 2
        cands = [(S(ulysses_degree=w), cfg), (S(ulysses_degree=w, shard_weights=True), cfg), (S(ring_degree=w), cfg),
                 (S(pipefusion_degree=w, num_pipeline_patch=w), cfg),
                 (S(pipefusion_degree=w, num_pipeline_patch=2 * w), cfg)]
        if w == 2:
            cands.insert(0, (S(cfg_degree=2), cfg_rows))
        else:
            cands += [(S(cfg_degree=2, ulysses_degree=h), cfg_rows), (S(cfg_degree=2, ring_degree=h), cfg_rows),
                      (S(cfg_degree=2, pipefusion_degree=h, num_pipeline_patch=h), cfg_rows),
                      (S(ulysses_degree=h, ring_degree=2), cfg),
                      (S(pipefusion_degree=2, ulysses_degree=h, num_pipeline_patch=2), cfg),
                      (S(pipefusion_degree=2, ring_degree=h, num_pipeline_patch=2), cfg)]
        cands.append((S(tensor_degree=w), cfg))  # each rank 1/w of every block's heads and MLP units
        if w > 2:
            cands.append((S(cfg_degree=2, tensor_degree=h), cfg_rows))
        cands.append((S(patch_degree=w), cfg))  # displaced patch: one step of warm-up, then stale K/V
        cands.append((S(naive_patch_degree=w), cfg))
        for s, c in cands:
            try:
                validate_strategy(s, world_size=s.world_size, heads=heads, num_blocks=num_blocks, latent_hw=latent_hw,
                                  cfg_scale=c, patch=patch, mlp_hidden=mlp_hidden)
                if s.tensor_degree > 1 and not tensor:
                    raise ConfigError("this family does not split its layers for tensor parallelism yet; set "
                                      "tensor_degree=1 and split it with ulysses_degree or ring_degree.")
            except ConfigError as exc:
                if skipped is not None:
                    skipped.append((row_label(s, c), str(exc)))
                continue
            rows.append((s, c))
    return rows


def row_label(s: StrategySpec, cfg: float) -> str:
    return s.label() + (f"@cfg{cfg:g}" if abs(cfg - 1.0) > 1e-9 else "")


def subset_devices(devices: list[str], spec: str, world: int) -> str:
    if devices[0] == "cpu":
        return f"cpu:{world}"
    return ",".join(d.split(":")[1] for d in devices[:world])
