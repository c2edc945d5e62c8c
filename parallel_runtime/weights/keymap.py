"""The key map's vocabulary: what a family module writes to say where each parameter of its diffusers model
comes from in a checkpoint (`Source`: a key, a row range, a transform), and the header-only helpers that read a
checkpoint's block structure. It imports nothing of the project's but errors, so families and every storage
kind can use it without a circle."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ModelFileError


@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's part of a parameter: along `dim` (0: a linear layer's output rows, 1: its input
    columns), each block of `blocks` (sizes summing to that dimension: one block, or one per projection a fused
    layer packs, such as Flux's single-block [attention, MLP] input) cut into `degree` equal runs, of which the rank
    keeps run `index` of every block."""

    dim: int
    blocks: tuple[int, ...]
    index: int
    degree: int

    def pieces(self, offset: int = 0) -> tuple[slice, ...]:
        """The runs this rank keeps, as slices of the dimension (shifted by `offset`)."""
        out, start = [], offset
        for size in self.blocks:
            run = size // self.degree
            out.append(slice(start + self.index * run, start + (self.index + 1) * run))
            start += size
        return tuple(out)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor."""
        parts = [tensor[(slice(None),) * self.dim + (p,)] for p in self.pieces()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class Source:
    """Where a diffusers parameter comes from: ``transform(file[key][rows])``, and of that only `shard` where a
    tensor-parallel rank holds part of the parameter."""

    key: str
    rows: slice | None = None
    transform: str | None = None  # None or "swap_halves"
    shard: Shard | None = None

    def file_pieces(self) -> tuple[slice | tuple[slice, ...] | None, tuple[slice, ...] | None]:
        """(rows, columns) of the file tensor this parameter reads: None (all), a slice, or the runs of a shard."""
        if self.shard is None:
            return self.rows, None
        # A transform moves rows. Swapping the halves of a layer split as two equal halves (a GLU stored [gate; value]
        # for diffusers' [value; gate]: MiniMax-H3's MLP) commutes with the split: the rank reads [gate_i; value_i]
        # and swaps it to [value_i; gate_i]. Any other moved rows (modulations) no plan splits.
        halves = (self.transform == "swap_halves" and self.shard.dim == 0 and len(self.shard.blocks) == 2
                  and self.shard.blocks[0] == self.shard.blocks[1])
        if self.transform is not None and not halves:
            raise ValueError(f"{self.key}: a transformed tensor cannot be split for tensor parallelism")
        if self.shard.dim == 1:
            return self.rows, self.shard.pieces()
        start = self.rows.start or 0 if self.rows is not None else 0
        return self.shard.pieces(start), None


Rows = slice | tuple[slice, ...] | None  # a reader's rows: all, one run, or a shard's runs (joined in order)


def read_pieces(index, rows: Rows, cols: tuple[slice, ...] | None, cat):
    """The `rows` and `cols` of a stored tensor, joined in order: `index(slices)` reads it at a tuple of slices (a
    safetensors slice, a numpy array), `cat(parts, dim)` joins parts (torch.cat, numpy.concatenate)."""
    runs = rows if isinstance(rows, tuple) else (rows if rows is not None else slice(None),)
    parts = [index((r,)) if cols is None else _joined([index((r, c)) for c in cols], 1, cat) for r in runs]
    return _joined(parts, 0, cat)


def _joined(parts: list, dim: int, cat):
    return parts[0] if len(parts) == 1 else cat(parts, dim)


def apply_transform(tensor: torch.Tensor, transform: str | None) -> torch.Tensor:
    if transform is None:
        return tensor
    if transform == "swap_halves":
        # The original final/pre-only modulations are (shift, scale); diffusers' AdaLayerNormContinuous
        # chunks (scale, shift).
        first, second = tensor.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    raise ValueError(f"unknown transform {transform!r}")


def linear(out: dict, dst: str, src: str, rows: slice | None = None, transform: str | None = None) -> None:
    """Map a Linear's weight and bias (the same rows of both)."""
    out[f"{dst}.weight"] = Source(f"{src}.weight", rows, transform)
    out[f"{dst}.bias"] = Source(f"{src}.bias", rows, transform)


def same_names(names, prefix: str = "") -> dict[str, Source]:
    """The key map of a diffusers-layout file: every parameter under its own name (after `prefix`)."""
    return {n: Source(prefix + n) for n in names}


def tensor_shapes(reader, prefix: str, name: str, what: str, fix: str = "re-download it"):
    """`shape(key)`: the shape of `prefix + key` in the checkpoint, or one sentence saying the file `name` is not
    `what` (e.g. "a complete Wan DiT") without it, and the fix."""
    def shape(key: str) -> tuple[int, ...]:
        if prefix + key not in reader:
            raise ModelFileError(f"{name} has no tensor {prefix + key!r}, so it is not {what}; {fix}.")
        return reader.shape(prefix + key)

    return shape


def block_count(keys: list[str], prefix: str, block: str, name: str) -> int:
    """How many `{prefix}{block}.N.` blocks a checkpoint has; a gap in the numbering means a damaged file."""
    pat = re.compile(re.escape(prefix + block) + r"\.(\d+)\.")
    idx = {int(m.group(1)) for k in keys if (m := pat.match(k))}
    if not idx:
        return 0
    n = max(idx) + 1
    missing = sorted(set(range(n)) - idx)
    if missing:
        raise ModelFileError(
            f"{name} has no tensors for {prefix}{block}.{missing[0]} although it has {block} up to {n - 1}; "
            f"the file is incomplete, so re-download it.")
    return n


def has_block(keys: list[str], prefix: str, block: str) -> bool:
    pat = re.compile(re.escape(prefix + block) + r"\.\d+\.")
    return any(pat.match(k) for k in keys)
