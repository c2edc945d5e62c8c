"""LoRA-style weight patches on the weights one rank holds: applied, swapped and taken off without re-reading
the checkpoint.

ComfyUI patches a weight by name (its own parameter names, which are the checkpoint keys of the family's
ComfyUI layout): it upcasts the weight to float32, adds each patch of its list in order (comfy/lora.py's
calculate_weight) and casts back. A rank holds diffusers parameters cut from those tensors (`mapping.Source`:
rows, a transform), so `RankWeightPatcher` rebuilds each patched tensor from the original parameters it
came from, runs the same arithmetic on it, and writes the rows back. A new LoRA stack, or none, starts from the
file's weights again: the touched tensors are read again from the file (`FileParameters`), the model is not
rebuilt.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ..errors import ConfigError
from ..spec import PATCH_FUNCTIONS, PATCH_SLOTS, WeightPatch, WeightPatches
from .mapping import Source, apply_transform, read_stored
from .stored import Storage


def patched_weight(weight: torch.Tensor, patches: Iterable[WeightPatch]) -> torch.Tensor:
    """`weight` (float32, modified in place) with each patch added in order, as ComfyUI's calculate_weight."""
    for patch in patches:
        target = weight.narrow(*patch.offset) if patch.offset is not None else weight
        if patch.strength_model != 1.0:
            target *= patch.strength_model
        _ADD[patch.kind](target, patch)
    return weight


def _float(patch: WeightPatch, slot: str, like: torch.Tensor) -> torch.Tensor | None:
    t = patch.tensors.get(slot)
    return None if t is None else t.to(device=like.device, dtype=torch.float32)


def _function(patch: WeightPatch, delta: torch.Tensor) -> torch.Tensor:
    return apply_transform(delta, "swap_halves") if patch.function == "swap_halves" else delta


def _add_delta(weight: torch.Tensor, patch: WeightPatch, delta: torch.Tensor, alpha: float) -> None:
    """weight += strength * alpha * delta, or DoRA's decomposition when the patch has a magnitude vector."""
    dora_scale = _float(patch, "dora_scale", weight)
    if dora_scale is None:
        weight += _function(patch, ((patch.strength * alpha) * delta).type(weight.dtype))
    else:
        _weight_decompose(weight, patch, dora_scale, delta * alpha)


def _weight_decompose(weight: torch.Tensor, patch: WeightPatch, dora_scale: torch.Tensor, delta: torch.Tensor):
    """DoRA: the patched weight's direction, rescaled to the stored magnitudes (per output row, or per input
    column when the magnitudes have the input's length)."""
    combined = weight + _function(patch, delta).type(weight.dtype)
    if dora_scale.shape[0] == combined.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        norm = combined.transpose(0, 1).reshape(combined.shape[1], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(combined.shape[1], *[1] * (combined.dim() - 1)).transpose(0, 1)
    norm = norm + torch.finfo(weight.dtype).eps
    combined *= (dora_scale / norm).type(weight.dtype)
    if patch.strength != 1.0:
        combined -= weight
        weight += patch.strength * combined
    else:
        weight[:] = combined


def _add_lora(weight: torch.Tensor, patch: WeightPatch) -> None:
    up, down, mid = (_float(patch, s, weight) for s in ("up", "down", "mid"))
    alpha = patch.alpha / down.shape[0] if patch.alpha is not None else 1.0
    if mid is not None:  # LoCon's middle (Tucker) factor of a convolution
        shape = [down.shape[1], down.shape[0], mid.shape[2], mid.shape[3]]
        down = torch.mm(down.transpose(0, 1).flatten(start_dim=1),
                        mid.transpose(0, 1).flatten(start_dim=1)).reshape(shape).transpose(0, 1)
    delta = torch.mm(up.flatten(start_dim=1), down.flatten(start_dim=1)).reshape(weight.shape)
    _add_delta(weight, patch, delta, alpha)


def _tucker(core: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.einsum("i j k l, j r, i p -> p r k l", core, b, a)


def _add_loha(weight: torch.Tensor, patch: WeightPatch) -> None:
    w1a, w1b, w2a, w2b, t1, t2 = (_float(patch, s, weight) for s in ("w1a", "w1b", "w2a", "w2b", "t1", "t2"))
    alpha = patch.alpha / w1b.shape[0] if patch.alpha is not None else 1.0
    if t1 is not None:
        m1, m2 = _tucker(t1, w1b, w1a), _tucker(t2, w2b, w2a)
    else:
        m1, m2 = torch.mm(w1a, w1b), torch.mm(w2a, w2b)
    _add_delta(weight, patch, (m1 * m2).reshape(weight.shape), alpha)


def _add_lokr(weight: torch.Tensor, patch: WeightPatch) -> None:
    w1, w2, w1_a, w1_b, w2_a, w2_b, t2 = (_float(patch, s, weight)
                                         for s in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2"))
    rank = None  # the factorisation's rank scales alpha, as in LyCORIS
    if w1 is None:
        rank = w1_b.shape[0]
        w1 = torch.mm(w1_a, w1_b)
    if w2 is None:
        rank = w2_b.shape[0]
        w2 = torch.mm(w2_a, w2_b) if t2 is None else _tucker(t2, w2_b, w2_a)
    if w2.dim() == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    alpha = patch.alpha / rank if patch.alpha is not None and rank is not None else 1.0
    _add_delta(weight, patch, torch.kron(w1, w2).reshape(weight.shape), alpha)


def _add_diff(weight: torch.Tensor, patch: WeightPatch) -> None:
    if patch.strength != 0.0:
        weight += _function(patch, patch.strength * patch.tensors["diff"].to(weight.device, weight.dtype))


def _set(weight: torch.Tensor, patch: WeightPatch) -> None:
    weight.copy_(patch.tensors["value"])


_ADD = {"lora": _add_lora, "loha": _add_loha, "lokr": _add_lokr, "diff": _add_diff, "set": _set}


def patch_targets(source_map: dict[str, Source]) -> dict[str, list[tuple[str, Source]]]:
    """ComfyUI parameter name -> the diffusers parameters cut from it, given the family's key map in its
    ComfyUI layout (no prefix)."""
    targets: dict[str, list[tuple[str, Source]]] = {}
    for name, source in source_map.items():
        targets.setdefault(source.key, []).append((name, source))
    return targets


class FileParameters:
    """The file's value of any parameter a rank holds, read again exactly as the build read it (rows, transform,
    dtype). Re-reading, rather than keeping a copy aside, costs no memory: ranks on one machine share the file's
    pages, where a copy per rank of a LoRA'd Flux would be 24 GB each."""

    def __init__(self, path: str, source_map: dict[str, Source], storage: Storage, device):
        self.path, self.source_map, self.storage, self.device = path, source_map, storage, device
        self._reader = None

    def __enter__(self) -> "FileParameters":
        from .loading import CheckpointReader

        self._reader = CheckpointReader(self.path)
        return self

    def __exit__(self, *exc) -> None:
        self._reader.close()
        self._reader = None

    def read(self, name: str) -> torch.Tensor:
        """As the build read it (a linear weight kept in fp8 is not patched here: see validate_weight_patches)."""
        return read_stored(self._reader, self.source_map[name], self.storage, self.device, linear=None)[0]


class RankWeightPatcher:
    """Puts a WeightPatches on the parameters this rank holds, and takes the last one off."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, list[tuple[str, Source]]], files: FileParameters):
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        self.params = {n: t for n, t in tensors.items() if t.device.type != "meta"}
        self.targets, self.files = targets, files
        self.patched: set[str] = set()  # parameters that differ from the file
        self.applied: str | None = None  # the id of the patches in place

    def apply(self, patches: WeightPatches | None) -> int:
        """Make the held weights the file's plus `patches` (None: the file's); returns how many tensors of
        this rank the patches change."""
        new_id = patches.id if patches is not None else None
        mine = {k: v for k, v in (patches.weights.items() if patches else ()) if self._held(k)}
        if new_id == self.applied:
            return len(mine)
        self.applied = None  # half-applied until the end: a failure here makes the next job start over
        wanted = {name for key in mine for name, _ in self.targets[key]}
        with self.files:
            for name in sorted(self.patched - wanted):
                self.params[name].copy_(self.files.read(name))
                self.patched.discard(name)
            for key, key_patches in mine.items():  # one tensor at a time: no second copy of the model
                self._patch(key, key_patches)
        self.applied = new_id
        return len(mine)

    def _held(self, key: str) -> bool:
        sources = self.targets.get(key, ())
        held = [name in self.params for name, _ in sources]
        if any(held) and not all(held):
            raise RuntimeError(f"this rank holds only part of {key}; ParaDiT cannot patch it (a ParaDiT bug).")
        return bool(sources) and all(held)

    def _patch(self, key: str, patches: list[WeightPatch]) -> None:
        sources = sorted(self.targets[key], key=lambda ns: ns[1].rows.start if ns[1].rows is not None else 0)
        # The whole tensor in float32 as ComfyUI's model holds it (the file's value in the rank's dtype, upcast):
        # the transforms undo themselves.
        parts = [apply_transform(self.files.read(name).float(), source.transform) for name, source in sources]
        weight = patched_weight(torch.cat(parts) if len(parts) > 1 else parts[0], patches)
        for name, source in sources:
            rows = weight[source.rows] if source.rows is not None else weight
            self.params[name].copy_(apply_transform(rows, source.transform))  # copy_ casts as ComfyUI's .to
            self.patched.add(name)


def validate_weight_patches(patches: WeightPatches, targets: dict, what: str) -> None:
    """One sentence for a patch the workers cannot apply as ComfyUI would, before any work starts."""
    unknown = sorted(k for k in patches.weights if k not in targets)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ConfigError(f"a LoRA patches {unknown[0]!r}{more}, which {what} does not have on the ParaDiT workers; "
                          f"use a LoRA made for this model.")
    for key, key_patches in patches.weights.items():
        for p in key_patches:
            if p.kind not in PATCH_SLOTS or p.function not in PATCH_FUNCTIONS or set(p.tensors) - set(PATCH_SLOTS[p.kind]):
                raise ConfigError(f"the patch on {key!r} ({p.kind}, {p.function or 'no function'}) is not one the "
                                  f"ParaDiT workers apply; this is a ParaDiT bug, please report it.")
            numbers = (p.strength, p.strength_model) + ((p.alpha,) if p.alpha is not None else ())
            if not all(math.isfinite(v) for v in numbers):
                raise ConfigError(f"the LoRA on {key!r} has strength {p.strength} (alpha {p.alpha}); set a finite "
                                  f"strength on the LoRA loader.")
