"""ComfyUI's weight patches on a parallel MODEL (LoraLoader, LoraLoaderModelOnly, ...) as the runtime's
WeightPatches: the workers apply them to the weights each rank holds.

ComfyUI's LoRA loaders have already done the hard part: read the file (kohya, PEFT/diffusers, BFL, LyCORIS
formats), mapped its keys onto the model's parameter names (with an offset where a diffusers-format q/k/v
LoRA lands in a fused tensor) and built one adapter per weight. Here each adapter becomes plain tensors and
numbers; what the workers cannot compute is refused in one sentence, never dropped.
"""
from __future__ import annotations

import logging

from . import convert

PREFIX = "diffusion_model."
# ComfyUI adapter -> (its `weights` tuple's entries, in order: a slot name, "alpha", or None for one we refuse).
_ADAPTER_SLOTS = {
    "lora": ("up", "down", "alpha", "mid", "dora_scale", "reshape"),
    "loha": ("w1a", "w1b", "alpha", "w2a", "w2b", "t1", "t2", "dora_scale"),
    "lokr": ("w1", "w2", "alpha", "w1_a", "w1_b", "w2_a", "w2_b", "t2", "dora_scale"),
}
log = logging.getLogger("paradit")


def weight_patches_of(patcher, shapes: dict):
    """The patcher's weight patches as a runtime WeightPatches (None without any); `shapes`: ComfyUI's
    parameter name (no prefix) -> shape, to skip a mismatched patch exactly where ComfyUI skips it."""
    from parallel_runtime.spec import WeightPatches

    if not getattr(patcher, "patches", None):
        return None
    weights = {}
    for key, entries in patcher.patches.items():
        if not key.startswith(PREFIX):
            raise convert.ConfigError(f"a patch on {key!r} is not on the diffusion model, which is all the ParaDiT "
                                      f"workers hold; remove the node that adds it.")
        name = key[len(PREFIX):]
        converted = [p for p in (_patch(name, entry, shapes.get(name)) for entry in entries) if p is not None]
        if converted:  # a weight whose every patch ComfyUI would skip stays the file's
            weights[name] = converted
    return WeightPatches(str(patcher.patches_uuid), weights) if weights else None


def _patch(name: str, entry: tuple, shape):
    from parallel_runtime.spec import WeightPatch

    strength, value, strength_model, offset, function = entry
    common = dict(strength=float(strength), strength_model=float(strength_model),
                  offset=tuple(int(v) for v in offset) if offset is not None else None,
                  function=_function_name(name, function))
    target = list(shape) if shape is not None else None
    if target is not None and offset is not None:
        target[offset[0]] = offset[2]
    kind = getattr(value, "name", None)
    if kind in _ADAPTER_SLOTS:
        tensors, alpha = _adapter_tensors(name, kind, value.weights)
        patch = WeightPatch(kind, tensors, alpha=alpha, **common)
        return patch if _delta_fits(name, patch, target) else None
    if isinstance(value, tuple) and len(value) in (1, 2) and not kind:
        kind, payload = ("diff", value) if len(value) == 1 else value
        if kind == "diff" and (len(payload) == 1 or not payload[1].get("pad_weight")):
            if target is not None and list(payload[0].shape) != target:
                log.warning("ParaDiT: LoRA patch for %s has shape %s, the weight %s: not merged (as ComfyUI).",
                            name, tuple(payload[0].shape), tuple(target))
                return None
            return WeightPatch("diff", {"diff": payload[0]}, **common)
        if kind == "set":
            return WeightPatch("set", {"value": payload[0]}, **common)
    if isinstance(value, list):
        what = "model-merge"
    elif kind == "diff":
        what = "padded diff"
    else:
        what = kind or type(value).__name__
    raise convert.ConfigError(f"the weight patch on {name} is a {what} patch, which the ParaDiT workers do not apply "
                              f"(they apply LoRA, LoHa, LoKr and plain diff/set patches); remove the node that adds "
                              f"it or load the model with UNETLoader.")


def _adapter_tensors(name: str, kind: str, weights) -> tuple[dict, float | None]:
    if len(weights) != len(_ADAPTER_SLOTS[kind]):  # a ComfyUI whose adapter holds more than we would send
        raise convert.ConfigError(f"the {kind} patch on {name} has {len(weights)} parts where ParaDiT knows "
                                  f"{len(_ADAPTER_SLOTS[kind])}; update ParaDiT or load the model with UNETLoader.")
    tensors, alpha = {}, None
    for slot, value in zip(_ADAPTER_SLOTS[kind], weights):
        if value is None:
            continue
        if slot == "alpha":
            alpha = float(value)
        elif slot == "reshape":
            raise convert.ConfigError(f"the LoRA on {name} reshapes its weight (a reshape_weight key), which the "
                                      f"ParaDiT workers do not do; use another LoRA file or load the model with "
                                      f"UNETLoader.")
        else:
            tensors[slot] = value.detach()
    return tensors, alpha


def _function_name(name: str, function) -> str | None:
    if function is None:
        return None
    import comfy.utils

    if function is comfy.utils.swap_scale_shift:  # a diffusers-format LoRA on a final norm's (scale, shift)
        return "swap_halves"
    raise convert.ConfigError(f"the weight patch on {name} applies {getattr(function, '__name__', function)!r} to its "
                              f"delta, which the ParaDiT workers do not; remove the node that adds it.")


def _delta_fits(name: str, patch, target) -> bool:
    """Whether the adapter's delta has the weight's element count (ComfyUI logs and skips it otherwise)."""
    if target is None:
        return True
    size = 1
    for d in target:
        size *= d
    if _delta_numel(patch.kind, patch.tensors) == size:
        return True
    log.warning("ParaDiT: %s patch for %s does not fit the weight %s: not merged (as ComfyUI).", patch.kind, name,
                tuple(target))
    return False


def _delta_numel(kind: str, t: dict) -> int:
    """Elements of the delta an adapter's factors make (see parallel_runtime/models/weight_patches.py)."""
    def spatial(core):  # a Tucker core's kernel size (1 without one)
        return core.shape[2] * core.shape[3] if core is not None else 1

    if kind == "lora":
        if "mid" in t:
            return t["up"].shape[0] * t["down"].shape[1] * spatial(t["mid"])
        return t["up"].shape[0] * t["down"].flatten(1).shape[1]
    if kind == "loha":
        return t["w1a"].shape[1 if "t1" in t else 0] * t["w1b"].shape[1] * spatial(t.get("t1"))

    def factor(whole, a, b, core=None):  # one Kronecker factor, given whole or as a (Tucker) product
        if whole in t:
            return t[whole].numel()
        return t[a].shape[1 if core in t else 0] * t[b].shape[1] * spatial(t.get(core))
    return factor("w1", "w1_a", "w1_b") * factor("w2", "w2_a", "w2_b", "t2")
