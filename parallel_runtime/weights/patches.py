"""LoRA-style weight patches on the weights one rank holds: applied, swapped and taken off without re-reading
the checkpoint.

ComfyUI patches a weight by name (its own parameter names, which are the checkpoint keys of the family's
ComfyUI layout): it upcasts the weight to float32, adds each patch of its list in order (comfy/lora.py's
calculate_weight) and casts back. A rank holds diffusers parameters cut from those tensors (`keymap.Source`:
rows, a transform), so `RankWeightPatcher` rebuilds each patched tensor from the original parameters it
came from, runs the same arithmetic on it, and writes the rows back. A new LoRA stack, or none, starts from the
file's weights again: the touched tensors are read again from the file (`FileParameters`), the model is not
rebuilt.

Quantized weights are patched as ComfyUI patches them. Where ComfyUI holds a model in fp8 (a scaled-fp8 file,
weight_dtype fp8, a GPU with fp8 compute), an fp8 weight is baked back into fp8 with ComfyUI's seeded
stochastic rounding (`stochastic_round`, seeded by the tensor's name), so the same fp8 numbers result. Where
ComfyUI upcasts a plain fp8 file at load and patches the upcast weight, for weights kept in GGUF blocks
(ComfyUI-GGUF patches per layer) and for ComfyUI's quantized layouts (as its dynamic-VRAM path), the rank adds
the patches per call to the weight it upcasts anyway (`PatchedPerCall`): the same numbers, and the patched
weight is never held.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Iterable

import torch

from ..errors import ConfigError
from ..spec import PATCH_FUNCTIONS, PATCH_SLOTS, WeightPatch, WeightPatches
from .fp8 import Fp8Linear, Fp8Weight
from .gguf_file import GGUFLinear
from .keymap import Shard, Source, apply_transform
from .mapping import read_stored
from .storage import FP8_DTYPES, Storage, linear_names

COMFY_PREFIX = "diffusion_model."  # ComfyUI's name for a DiT parameter: the seed of its stochastic rounding


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


def string_to_seed(name: str) -> int:
    """ComfyUI's seed for rounding a patched weight (model_patcher.string_to_seed): the CRC-32 of its name."""
    return zlib.crc32(name.encode("utf-8"))


def _round_to_fp8(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """ComfyUI's stochastic rounding of one slice to fp8 (comfy/float.py), step for step: through fp16, then a
    uniform draw added to the scaled mantissa before flooring, so the rounding is unbiased."""
    exponent_bits, mantissa_bits, bias = (4, 3, 7) if dtype == FP8_DTYPES[0] else (5, 2, 15)
    x = x.half()
    abs_x = x.abs()
    sign = torch.where(abs_x == 0, 0, torch.sign(x))
    exponent = torch.clamp(torch.floor(torch.log2(abs_x)) + bias, 0, 2 ** exponent_bits - 1)
    normal = ~(exponent == 0)
    mantissa = torch.where(normal, (abs_x / (2.0 ** (exponent - bias)) - 1.0) * (2 ** mantissa_bits),
                           abs_x / (2.0 ** (-bias + 1 - mantissa_bits)))
    mantissa += torch.rand(mantissa.size(), dtype=mantissa.dtype, layout=mantissa.layout, device=mantissa.device,
                           generator=generator)
    abs_x[:] = mantissa.floor() / (2 ** mantissa_bits)
    sign *= torch.where(normal, (2.0 ** (exponent - bias)) * (1.0 + abs_x), (2.0 ** (-bias + 1)) * abs_x)
    limits = torch.finfo(dtype)
    return torch.clamp(sign, min=limits.min, max=limits.max, out=sign)


def stochastic_round(value: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`value` in fp8 as ComfyUI's comfy.float.stochastic_rounding makes it: slices of ~4096^2 values, one
    generator seeded per tensor, on the tensor's device (so the draws, and the fp8 numbers, are ComfyUI's)."""
    generator = torch.Generator(device=value.device)
    generator.manual_seed(seed)
    out = torch.empty_like(value, dtype=dtype)
    slices = max(1, value.numel() / (4096 * 4096))
    size = max(1, round(value.shape[0] / slices))
    for i in range(0, value.shape[0], size):
        out[i:i + size].copy_(_round_to_fp8(value[i:i + size], dtype, generator))
    return out


class FileParameters:
    """The file's value of any parameter a rank holds, read again exactly as the build read it (rows, transform,
    dtype). Re-reading, rather than keeping a copy aside, costs no memory: ranks on one machine share the file's
    pages, where a copy per rank of a LoRA'd Flux would be 24 GB each."""

    def __init__(self, path: str, source_map: dict[str, Source], storage: Storage, device):
        """`storage`: the build's, for this file (Storage.for_file: a scaled-fp8 file's type)."""
        self.path, self.source_map, self.storage, self.device = path, source_map, storage, device
        self._reader = None

    def __enter__(self) -> "FileParameters":
        """Open for one application of a stack (the file is not held open between jobs)."""
        from .checkpoint import open_checkpoint

        self._reader = open_checkpoint(self.path)
        return self

    def __exit__(self, *exc) -> None:
        self._reader.close()
        self._reader = None

    def read(self, name: str, linear: str | None) -> torch.Tensor:
        """As the build stored it (`linear`: "weight"/"bias" of a linear layer): an fp8 weight in fp8."""
        value = read_stored(self._reader, self.source_map[name], self.storage, self.device, linear=linear)
        return value.weight if isinstance(value, Fp8Weight) else value

    def comfy_value(self, name: str, linear: str | None) -> tuple[torch.Tensor, torch.dtype | None, torch.Tensor | None]:
        """(float32 value as ComfyUI upcasts it to patch it, the fp8 type ComfyUI stores it in or None, the
        file's scale of it or None): the whole parameter, also where a tensor-parallel rank holds a part of it."""
        whole = dataclasses.replace(self.source_map[name], shard=None)
        value = read_stored(self._reader, whole, self.storage, self.device, linear=linear)
        if isinstance(value, Fp8Weight):
            scale = value.scale.float() if value.scale is not None else None
            weight = value.weight.float()
            return (weight * scale if scale is not None else weight), value.weight.dtype, scale
        return value.float(), self.storage.rounding(linear == "bias"), None


def whole_patched(parts: list[torch.Tensor], sources: list[Source], patches: list[WeightPatch]) -> torch.Tensor:
    """The file tensor the parts were cut from (each part back through its transform, in row order) with the
    patches added (calculate_weight's arithmetic, in the parts' dtype)."""
    parts = [apply_transform(part, source.transform) for part, source in zip(parts, sources)]
    return patched_weight(torch.cat(parts) if len(parts) > 1 else parts[0], patches)


def rows_of(weight: torch.Tensor, source: Source, shard: Shard | None = None) -> torch.Tensor:
    """One part's rows of a whole tensor, in the part's own layout (its transform applied), and of those the
    tensor-parallel `shard` a rank holds."""
    part = apply_transform(weight[source.rows] if source.rows is not None else weight, source.transform)
    return shard.take(part) if shard is not None else part


class PatchedPerCall:
    """A LoRA on compact weights (GGUF blocks, ComfyUI layouts, fp8), added when the layers run: each weight
    dequantized to the compute dtype and patched as its reference patches it: GGUF and ComfyUI layouts in the
    compute dtype (ComfyUI-GGUF's calculate_weight on the dequantized weight), fp8 in float32 (ComfyUI's patch of
    an upcast model), then cast back. The layers cut from one file tensor (Flux's fused qkv: to_q, to_k, to_v) share
    one: the first to run builds the whole patched tensor, the others take their rows of it, and it is dropped
    once each has (or at the job's end: `drop`).

    A tensor-parallel rank holds only its `shards` of those layers, so the whole weight cannot be rebuilt from them:
    it adds its part of what the patches add instead. Every patch but DoRA maps each weight element w to
    a * w + b with a and b independent of the weight (LoRA, LoHa, LoKr and diff add b; strength_model scales by a;
    "set" has a = 0), so the patches run on a whole tensor of zeros give b (and of ones, a + b) per call, and the
    rank takes its part of them: the same numbers, still without holding a patched weight."""

    def __init__(self, layers: list[tuple[GGUFLinear | Fp8Linear, Source]], patches: list[WeightPatch],
                 shards: dict[int, Shard] | None = None):
        first = layers[0][0]
        device = next(t for t in [*first.parameters(), *first.buffers()] if t is not None).device
        # The LoRA factors live beside the layer, in float32, once: not copied from the CPU at every call.
        self.patches = [dataclasses.replace(p, tensors={k: v.to(device, torch.float32) for k, v in p.tensors.items()})
                        for p in patches]
        self.layers, self.shards, self.device = layers, shards or {}, device
        self.fp32 = isinstance(layers[0][0], Fp8Linear)
        self.scales = any(p.strength_model != 1.0 or p.kind == "set" for p in self.patches)  # a != 1 somewhere
        self.drop()

    def drop(self) -> None:
        self._full, self._dtype, self._taken = None, None, set()

    def _whole_shape(self, layer) -> tuple[int, int]:
        """The shape of `layer`'s whole weight, of which a tensor-parallel rank holds its shard."""
        shape = [layer.out_features, layer.in_features]
        shard = self.shards.get(id(layer))
        if shard is not None:
            shape[shard.dim] = sum(shard.blocks)
        return tuple(shape)

    def install(self) -> None:
        for layer, _ in self.layers:
            layer.patch = self

    def __call__(self, layer, dtype: torch.dtype) -> torch.Tensor:
        patch_dtype = torch.float32 if self.fp32 else dtype
        if self._full is None or id(layer) in self._taken or dtype != self._dtype:
            sources = [source for _, source in self.layers]
            if self.shards:  # (b, a + b) of the whole tensor: the patches on zeros and on ones
                self._full = tuple(whole_patched([fill(self._whole_shape(part), dtype=patch_dtype, device=self.device)
                                                  for part, _ in self.layers], sources, self.patches)
                                   for fill in ((torch.zeros, torch.ones) if self.scales else (torch.zeros,)))
            else:
                parts = [part.dequantized(dtype).to(patch_dtype) for part, _ in self.layers]
                self._full = whole_patched(parts, sources, self.patches)
            self._dtype, self._taken = dtype, set()
        source = next(source for part, source in self.layers if part is layer)
        if self.shards:
            shard = self.shards.get(id(layer))
            offset, *with_ones = (rows_of(t, source, shard) for t in self._full)
            held = layer.dequantized(dtype).to(patch_dtype)
            weight = (held * (with_ones[0] - offset) + offset if with_ones else held + offset).to(dtype)
        else:
            weight = rows_of(self._full, source).to(dtype)
        self._taken.add(id(layer))
        if len(self._taken) == len(self.layers):
            self.drop()
        return weight


class RankWeightPatcher:
    """Puts a WeightPatches on the parameters this rank holds, and takes the last one off."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, list[tuple[str, Source]]], files: FileParameters):
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        self.params = {n: t for n, t in tensors.items() if t.device.type != "meta"}
        # Compact layers whose LoRA is added per call (GGUF and ComfyUI layouts always; fp8 where ComfyUI would hold
        # it upcast, or where it multiplies in fp8: then it is one of ComfyUI's quantized layers).
        from .comfy_quant import ComfyQuantLinear

        per_call = (GGUFLinear, ComfyQuantLinear) + (() if files.storage.bakes_fp8() else (Fp8Linear,))
        self.per_call = {f"{n}.weight": m for n, m in model.named_modules()
                         if isinstance(m, per_call) or (isinstance(m, Fp8Linear) and m.kernel)}
        self.linear_parts = {n: n.rpartition(".")[2] for n in linear_names(model)}
        self.targets, self.files = targets, files
        self.patched: set[str] = set()  # parameters that differ from the file
        self.transients: list[PatchedPerCall] = []  # the per-call LoRAs in place
        self.applied: str | None = None  # the id of the patches in place
        # shard_weights: a sharded block's tensors exist only while it is gathered, from the slices its replica
        # group keeps. A LoRA is baked into those slices, each rank's part of the patched bytes (ShardedBlock.store),
        # when the stack is applied: the gathers then bring the patched weights with no file read or patch per
        # gather, and taking it off writes the file's bytes back, as for a whole tensor.
        self.sharded = {}  # parameter name -> (its ShardedBlock, its slot there)
        modules = dict(model.named_modules())
        for block in getattr(model, "sharded_blocks", ()):
            prefix = next(n for n, m in modules.items() if m is block.block)
            self.sharded.update({f"{prefix}.{n}": (block, slot) for n, slot in block.names.items()})

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
            self.transients = []
            for name in sorted(self.patched - wanted):
                if name in self.per_call:
                    self.per_call[name].patch = None
                else:
                    self._store(name, self.files.read(name, self.linear_parts.get(name)))
                self.patched.discard(name)
            for key, key_patches in mine.items():  # one tensor at a time: no second copy of the model
                self._patch(key, key_patches)
        self.applied = new_id
        return len(mine)

    def _held(self, key: str) -> bool:
        sources = self.targets.get(key, ())
        held = [name in self.params or name in self.per_call for name, _ in sources]
        if any(held) and not all(held):
            raise RuntimeError(f"this rank holds only part of {key}; ParaDiT cannot patch it (a ParaDiT bug).")
        return bool(sources) and all(held)

    def _patch(self, key: str, patches: list[WeightPatch]) -> None:
        sources = sorted(self.targets[key], key=lambda ns: ns[1].rows.start if ns[1].rows is not None else 0)
        shards = {name: self.files.source_map[name].shard for name, _ in sources}
        if sources[0][0] in self.per_call:  # cut from one compact tensor: all its parts are held alike
            if any(shards.values()) and any("dora_scale" in p.tensors for p in patches):
                raise ConfigError(f"the LoRA on {key!r} is a DoRA, whose weight norms a tensor-parallel rank cannot "
                                  f"form from its part of a quantized weight; set tensor_degree=1 for this LoRA.")
            layers = [(self.per_call[name], source) for name, source in sources]
            per_call = PatchedPerCall(layers, patches, {id(self.per_call[name]): shard
                                                        for name, shard in shards.items() if shard is not None})
            per_call.install()
            self.transients.append(per_call)
            self.patched.update(name for name, _ in sources)
            return
        # The whole tensor in float32 as ComfyUI's model holds it (the file's value in the rank's dtype, upcast):
        # the transforms undo themselves.
        values = [self.files.comfy_value(name, self.linear_parts.get(name)) for name, _ in sources]
        weight = whole_patched([v for v, _, _ in values], [source for _, source in sources], patches)
        _, fp8, scale = values[0]
        if fp8 is not None:  # back into fp8 as ComfyUI bakes it (a scaled weight divided by its scale first)
            weight = stochastic_round(weight / scale if scale is not None else weight, fp8,
                                      seed=string_to_seed(COMFY_PREFIX + key))
        for name, source in sources:
            self._store(name, rows_of(weight, source, shards[name]))
            self.patched.add(name)

    def _store(self, name: str, value: torch.Tensor) -> None:
        """Make `value` what parameter `name` holds (copy_ casts as ComfyUI's .to); a sharded block's parameter:
        this rank's part of its bytes in the block's kept slice."""
        if name in self.sharded:
            block, slot = self.sharded[name]
            block.store(slot, value)
        else:
            self.params[name].copy_(value)

    def drop_transients(self) -> None:
        """Free any whole patched tensor a per-call LoRA still caches (a job stopped between a fused tensor's
        parts); the next call rebuilds it."""
        for per_call in self.transients:
            per_call.drop()


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
