"""The shapes of a complete checkpoint, for writing random test checkpoints (`tiny.write_checkpoint`): every key
with its shape and its kind, which sets the scale `tiny` draws it at ("weight" ~ 1/sqrt(fan-in), "mod" half that,
"bias" and "norm" small around 0 and 1, "table" O(1)).

`tiny` draws the tensors in the dict's order, so a family lists its keys in one fixed order: changing that order
changes every fixture's numbers.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class CheckpointShapes(dict):
    """{key: (shape, kind)}, written one layer at a time in the file's names, after `prefix`."""

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix

    def linear(self, name: str, n_out: int, n_in: int, kind: str = "weight", bias: bool = True) -> None:
        self[f"{self.prefix}{name}.weight"] = ((n_out, n_in), kind)
        if bias:
            self[f"{self.prefix}{name}.bias"] = ((n_out,), "bias")

    def conv(self, name: str, n_out: int, n_in: int, *kernel: int) -> None:
        self[f"{self.prefix}{name}.weight"] = ((n_out, n_in, *kernel), "weight")
        self[f"{self.prefix}{name}.bias"] = ((n_out,), "bias")

    def norm(self, name: str, width: int, leaf: str = "weight") -> None:
        """A norm's scale (`leaf` "scale" in BFL's names)."""
        self[f"{self.prefix}{name}.{leaf}"] = ((width,), "norm")

    def table(self, name: str, *shape: int) -> None:
        self[f"{self.prefix}{name}"] = (shape, "table")


def shapes_of_model(parameters: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    kind: Callable[[str], str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, kind(name))} of a module tree whose names are the file's (a meta model's state_dict)."""
    items = parameters.items() if isinstance(parameters, dict) else parameters
    return {name: (tuple(p.shape), kind(name)) for name, p in items}
