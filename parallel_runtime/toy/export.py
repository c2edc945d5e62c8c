"""Writing a diffusers FluxTransformer2DModel state dict as a BFL-layout checkpoint (ComfyUI's key layout).

The inverse of flux.source_map: every BFL tensor is put back together from the diffusers parameters that
read (rows of) it, so the file loads through the same code path as any flux1-dev.safetensors.
"""
from __future__ import annotations

import torch
from safetensors.torch import save_file

from ..models.families.flux import FluxConfig, bfl_tensor_shapes, source_map
from ..weights.keymap import apply_transform


def bfl_state_dict(config: FluxConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = bfl_tensor_shapes(config)
    out = {key: torch.empty(shape, dtype=torch.float32) for key, (shape, _) in shapes.items()}
    rows_written = dict.fromkeys(out, 0)
    for name, src in source_map(config, "bfl").items():
        # swap_halves (the final modulation's order) is its own inverse.
        tensor = apply_transform(state[name].detach().float(), src.transform)
        target = out[src.key] if src.rows is None else out[src.key][src.rows]
        target.copy_(tensor)
        rows_written[src.key] += tensor.shape[0]
    incomplete = [k for k, n in rows_written.items() if n != out[k].shape[0]]
    if incomplete:
        raise RuntimeError(f"BFL tensors not fully written from the diffusers state: {incomplete[:3]}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def save_bfl(path: str, config: FluxConfig, state: dict[str, torch.Tensor], metadata: dict[str, str],
             dtype: torch.dtype = torch.float16) -> str:
    save_file(bfl_state_dict(config, state, dtype), path, metadata={"format": "pt", **metadata})
    return path
