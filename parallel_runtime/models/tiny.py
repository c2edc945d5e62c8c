"""Small Flux configs and a writer of deterministic random checkpoints of any family (for tests/benchmarks)."""

from __future__ import annotations

import dataclasses
import os

import torch
from safetensors.torch import save_file

from ..weights.keymap import apply_transform
from .families.flux import FluxConfig

TINY = FluxConfig(
    hidden_size=128,
    num_heads=4,
    head_dim=32,
    num_layers=2,
    num_single_layers=2,
    in_channels=64,
    context_dim=64,
    pooled_dim=32,
    guidance_embeds=True,
    mlp_ratio=4.0,
)

BENCH = dataclasses.replace(TINY, hidden_size=256, head_dim=64, axes_dims_rope=None)

# Init scales (relative to 1/sqrt(fan_in) for weights).
_WEIGHT_GAIN = 1.0
_MOD_GAIN = 0.5  # modulation (adaLN) weights: gates/scales of O(0.3), neither ~0 nor exploding
_BIAS_STD = 0.02
_NORM_STD = 0.05  # RMSNorm scales ~ 1 +- 0.05


def _random_original(config, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors for every key of the family's original (ComfyUI) layout, in a fixed order."""
    from .registry import family_of

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    for key, (shape, kind) in family_of(config).checkpoint_shapes(config).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "weight":
            t.mul_(_WEIGHT_GAIN / shape[1] ** 0.5)
        elif kind == "mod":
            t.mul_(_MOD_GAIN / shape[1] ** 0.5)
        elif kind == "bias":
            t.mul_(_BIAS_STD)
        elif kind == "norm":
            t.mul_(_NORM_STD).add_(1.0)
        elif kind == "table":  # stored position tables: O(1) entries like sin/cos ones
            t.mul_(0.5)
        tensors[key] = t.to(dtype)
    return tensors


def write_checkpoint(
    path: str | os.PathLike,
    config,
    seed: int = 0,
    layout: str = "bfl",
    prefix: str = "",
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write deterministic random weights of any family's ``config`` to ``path`` (.safetensors) in ``layout``:
    "diffusers", or the family's original (ComfyUI) layout under any other name ("bfl" for Flux).

    The numbers depend only on ``config`` and ``seed``: an original file and its "diffusers"
    twin hold exactly the same values (the latter via our own key map).
    """
    from .registry import family_of

    path = os.fspath(path)
    bfl = _random_original(config, seed, dtype)
    if layout != "diffusers":
        tensors = {prefix + k: v for k, v in bfl.items()}
    else:
        tensors = {}
        for name, src in family_of(config).source_map(config, "bfl", "").items():
            t = bfl[src.key]
            if src.rows is not None:
                t = t[src.rows]
            tensors[prefix + name] = apply_transform(t, src.transform).contiguous().clone()
        del bfl
    metadata = {"format": "pt", "paradit_layout": layout, "paradit_seed": str(seed)}
    save_file(tensors, path, metadata=metadata)
    return path
