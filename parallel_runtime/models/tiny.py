"""Small Flux configs and a writer of deterministic random Flux checkpoints (for tests/benchmarks)."""

from __future__ import annotations

import dataclasses
import os

import torch
from safetensors.torch import save_file

from .flux import TIME_FEATURES, FluxConfig
from .mapping import apply_transform

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


def bfl_tensor_shapes(config: FluxConfig, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """``{bfl_key: (shape, kind)}`` in a fixed order; kind is "weight", "mod", "bias" or "norm"."""
    H, M, hd = config.hidden_size, config.mlp_hidden, config.head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def linear(name: str, n_out: int, n_in: int, kind: str = "weight") -> None:
        out[f"{prefix}{name}.weight"] = ((n_out, n_in), kind)
        out[f"{prefix}{name}.bias"] = ((n_out,), "bias")

    def norm(name: str) -> None:
        out[f"{prefix}{name}.scale"] = ((hd,), "norm")

    linear("img_in", H, config.in_channels)
    linear("time_in.in_layer", H, TIME_FEATURES)
    linear("time_in.out_layer", H, H)
    linear("vector_in.in_layer", H, config.pooled_dim)
    linear("vector_in.out_layer", H, H)
    if config.guidance_embeds:
        linear("guidance_in.in_layer", H, TIME_FEATURES)
        linear("guidance_in.out_layer", H, H)
    linear("txt_in", H, config.context_dim)
    for i in range(config.num_layers):
        b = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            linear(f"{b}.{stream}_mod.lin", 6 * H, H, "mod")
            linear(f"{b}.{stream}_attn.qkv", 3 * H, H)
            norm(f"{b}.{stream}_attn.norm.query_norm")
            norm(f"{b}.{stream}_attn.norm.key_norm")
            linear(f"{b}.{stream}_attn.proj", H, H)
            linear(f"{b}.{stream}_mlp.0", M, H)
            linear(f"{b}.{stream}_mlp.2", H, M)
    for i in range(config.num_single_layers):
        b = f"single_blocks.{i}"
        linear(f"{b}.linear1", 3 * H + M, H)
        linear(f"{b}.linear2", H, H + M)
        norm(f"{b}.norm.query_norm")
        norm(f"{b}.norm.key_norm")
        linear(f"{b}.modulation.lin", 3 * H, H, "mod")
    linear("final_layer.linear", config.out_channels, H)
    linear("final_layer.adaLN_modulation.1", 2 * H, H, "mod")
    return out


def _random_original(config, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors for every key of the family's original (ComfyUI) layout, in a fixed order."""
    from .family import family_of

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
    from .family import family_of

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
