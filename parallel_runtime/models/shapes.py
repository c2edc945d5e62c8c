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


def plain_kind(name: str, tensor: torch.Tensor) -> str:
    """The kind most parameters have: biases, then 1-d scales (norms), then weights by fan-in."""
    return "bias" if name.endswith("bias") else "norm" if tensor.dim() == 1 else "weight"


def shapes_of_model(parameters: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    kind: Callable[..., str], key: Callable[[str], str] | None = None
                    ) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key(name): (shape, kind)} of a module tree (a meta model's state_dict). `kind` takes the name, or the name
    and the tensor where its rank decides (`plain_kind`); `key` maps a module name to the file's (default: the
    same), for families whose modules are named after diffusers' but whose files use the release's names."""
    items = parameters.items() if isinstance(parameters, dict) else parameters
    takes_tensor = kind.__code__.co_argcount >= 2
    key = key or (lambda name: name)
    return {key(name): (tuple(p.shape), kind(name, p) if takes_tensor else kind(name)) for name, p in items}
