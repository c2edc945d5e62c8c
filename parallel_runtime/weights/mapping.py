"""From checkpoint tensors to a diffusers module tree: the one per-rank builder.

A family's key map (`keymap.Source` per parameter of its diffusers model) says which checkpoint tensor, and
which rows of it, each parameter comes from. `build_from_map` builds the model on the meta device and reads
only the parameters a rank owns, each as its storage kind keeps it, so every family loads lazily and per rank
the same way.
"""
from __future__ import annotations

import os
import re
from typing import Callable

import torch

from ..errors import ModelFileError
from .fp8 import Fp8Weight
from .keymap import Source, apply_transform
from .storage import Storage, install_kept_linears, linear_names, scale_key


def read_source(reader, src: Source, dtype: torch.dtype | None, device) -> torch.Tensor:
    """One parameter's value from the file in `dtype` (None: as read: a quantized weight dequantized to float32,
    then cast, since the dequantizers compute in float dtypes only)."""
    rows, cols = src.file_pieces()
    tensor = reader.read(src.key, rows=rows, device=device, cols=cols)
    return apply_transform(tensor.to(dtype) if dtype is not None else tensor, src.transform)


def read_stored(reader, src: Source, storage: Storage, device, linear: str | None):
    """One parameter as a rank holds it. `linear`: "weight" or "bias" of an nn.Linear, else None. A linear weight
    the storage keeps compact comes back as an `Fp8Weight` (fp8 values, the file's scale beside them), a
    `GGUFWeight` (its rows' raw blocks) or a `comfy_quant.ComfyQuantWeight` (a ComfyUI quantized layout's rows);
    anything else as a tensor in the compute dtype (a scaled tensor multiplied by its scale), rounded through fp8
    first where ComfyUI stores it in fp8 (see Storage.rounding)."""
    quant_format = reader.quant_format(src.key)
    if linear == "weight" and storage.keeps_blocks(quant_format):
        rows, cols = src.file_pieces()
        return reader.read_kept(src.key, rows, src.transform, device, cols)
    key = scale_key(src.key) if src.key.endswith(".weight") else None
    scale = reader.read(key, dtype=torch.float32, device=device) if key is not None and key in reader else None
    # A quantized weight not kept in its layout (weight_dtype fp8 casts it) reads as float32, like any other file's.
    kept = storage.linear_dtype(reader.dtype(src.key)) if linear == "weight" else None
    if kept is not None:
        return Fp8Weight(read_source(reader, src, kept, device), scale, _input_scale(reader, src.key, device))
    tensor = read_source(reader, src, storage.rounding(linear == "bias"), device).to(storage.compute)
    if scale is not None:
        tensor = tensor * scale.to(storage.compute)
    return tensor


def _input_scale(reader, weight_key: str, device) -> torch.Tensor | None:
    """A scaled-fp8 layer's `scale_input`; none when it is 1 (ComfyUI drops those; its fp8 kernel then quantizes
    the input at scale 1 all the same)."""
    key = weight_key[: -len("weight")] + "scale_input"
    if key not in reader:
        return None
    value = reader.read(key, dtype=torch.float32, device=device).reshape(())
    return None if value.item() == 1.0 else value


def _block_pattern(block_lists: tuple[str, ...]) -> re.Pattern:
    """Matches a parameter name of a block: groups (block list, index)."""
    return re.compile(r"(" + "|".join(map(re.escape, block_lists)) + r")\.(\d+)\.")


def drop_unowned_blocks(model: torch.nn.Module, block_lists: tuple[str, ...], wanted: list[str]) -> None:
    """Replace every block that owns no wanted parameter by Identity, so it holds no (meta) tensors."""
    pattern = _block_pattern(block_lists)
    used = {(m.group(1), int(m.group(2))) for n in wanted if (m := pattern.match(n))}
    for attr in block_lists:
        blocks = getattr(model, attr)
        for i in range(len(blocks)):
            if (attr, i) not in used:
                blocks[i] = torch.nn.Identity()


def build_from_map(model: torch.nn.Module, smap: dict[str, Source], reader, block_lists: tuple[str, ...],
                   what: str, owned: Callable[[str], bool] = lambda name: True,
                   dtype: torch.dtype | Storage = torch.float32, device: str | torch.device = "cpu",
                   shard: tuple[int, int] | None = None) -> torch.nn.Module:
    """Fill a meta-device `model` with the parameters `owned` selects, read through `smap` from `reader`.

    `what` names the model in errors ("Flux.1 DiT"); `dtype`: the compute dtype, or a `storage.Storage` (fp8
    linear weights kept fp8, GGUF and ComfyUI-quantized ones in their layouts). Blocks owning nothing become
    Identity; other parameters not owned stay on meta, so touching them fails loudly instead of computing garbage.
    `shard` (index, degree): keep only that slice of every block's bytes (sharded.ShardedBlock), reading one block
    at a time, so the rank never holds more than one whole block; the blocks are returned in `model.sharded_blocks`.
    """
    storage = dtype if isinstance(dtype, Storage) else Storage(dtype)
    storage = storage.for_file(reader)
    name = os.path.basename(getattr(reader, "path", "checkpoint"))
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if set(smap) != set(expected):
        unmapped = sorted(set(expected) - set(smap))[:3]
        extra = sorted(set(smap) - set(expected))[:3]
        raise RuntimeError(f"{what} key map out of sync with diffusers: unmapped {unmapped}, unknown {extra}")

    wanted = [n for n in expected if owned(n)]
    drop_unowned_blocks(model, block_lists, wanted)

    missing = sorted({smap[n].key for n in wanted if smap[n].key not in reader})
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{name} has no tensor {missing[0]!r}{more}, so it is not a complete {what}; "
                             f"re-download it.")

    linears = linear_names(model)
    groups = _by_block(wanted, block_lists) if shard is not None else {None: wanted}
    sharded = []
    for block, names in groups.items():
        state: dict[str, torch.Tensor] = {}
        kept_linears: dict = {}  # module name -> the weight its compact layer keeps (storage.install_kept_linears)
        for n in names:
            tensor = _read_checked(reader, smap[n], storage, device, n, expected[n], name,
                                   linear=n.rpartition(".")[2] if n in linears else None)
            if isinstance(tensor, torch.Tensor):
                state[n] = tensor.contiguous()
            else:
                kept_linears[linears[n]] = tensor
        result = model.load_state_dict(state, strict=False, assign=True)
        if result.unexpected_keys:
            raise RuntimeError(f"unexpected keys while loading {what}: {result.unexpected_keys[:3]}")
        install_kept_linears(model, kept_linears, storage)
        if block is not None:
            from .sharded import ShardedBlock

            sharded.append(ShardedBlock(model.get_submodule(block), *shard))
        del state, kept_linears
    model.eval()
    model.requires_grad_(False)
    if shard is not None:
        model.sharded_blocks = sharded
    return model


def _read_checked(reader, src: Source, storage: Storage, device, n: str, shape: tuple, file: str, linear: str | None):
    """One parameter as its storage kind keeps it, with one sentence when the file's shape is not the model's."""
    tensor = read_stored(reader, src, storage, device, linear=linear)
    if tuple(tensor.shape) != shape:
        where = f"{src.key!r}" + (f" rows {src.rows.start}:{src.rows.stop}" if src.rows is not None else "")
        raise ModelFileError(f"{file}: tensor {where} has shape {tuple(tensor.shape)} but {n} needs {shape}; "
                             f"the file is damaged or mixes model variants, so re-download it.")
    return tensor


def _by_block(names: list[str], block_lists: tuple[str, ...]) -> dict[str | None, list[str]]:
    """Parameter names grouped by the block they belong to ("transformer_blocks.3"), in pipeline order (the block
    lists' order, then the index), after the non-block ones (key None)."""
    pattern = _block_pattern(block_lists)
    groups: dict = {None: []}
    for n in names:
        m = pattern.match(n)
        groups.setdefault(f"{m.group(1)}.{m.group(2)}" if m else None, []).append(n)
    order = {attr: k for k, attr in enumerate(block_lists)}

    def rank(key):
        if key is None:
            return (-1, 0)
        attr, _, i = key.rpartition(".")
        return (order[attr], int(i))
    return {k: groups[k] for k in sorted(groups, key=rank)}


def parameter_counts(model: torch.nn.Module, blocks: list[torch.nn.Module], always: tuple[str, ...],
                     first: tuple[str, ...], last: tuple[str, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """(per block, every stage's, the first stage's, the last stage's) element counts of what a meta-device
    model loads (no memory, no file access); `always`/`first`/`last` are parameter-name prefixes. Counted over
    the state dict, so loaded buffers (SD3's position table) weigh in as they do on a rank."""
    state = model.state_dict()
    shared = [sum(t.numel() for n, t in state.items() if n.startswith(prefixes)) for prefixes in (always, first, last)]
    return (tuple(sum(t.numel() for t in b.state_dict().values()) for b in blocks), *shared)
