"""Telling a family's files by their keys: the prefixes checkpoints put before a DiT's names, and a family's
layouts written as data (`Signature`: which keys and block lists a layout has, under which prefixes).

A family module writes `match_layout = signature_match(Signature(...), ...)`; detection order between families
stays in `registry.families()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..weights.keymap import has_block
from .family import Match

# ComfyUI's (and the original releases') single files: the whole-checkpoint prefix, the bare DiT's, none.
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")
# diffusers' files: a pipeline's transformer folder saved whole, or the transformer alone.
DIFFUSERS_PREFIXES = ("transformer.", "")


@dataclass(frozen=True)
class Signature:
    """One key layout of a family: every key of `keys` and a block of each list in `blocks` under one of
    `prefixes`, none of `absent` there, and `also(keys, prefix)` where a layout needs a check keys cannot say."""

    layout: str
    keys: tuple[str, ...]
    blocks: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = BFL_PREFIXES
    absent: tuple[str, ...] = ()
    also: Callable[[list[str], str], bool] | None = None

    def prefix_in(self, keys: list[str], key_set: set[str]) -> str | None:
        """The first of `prefixes` this layout's keys sit under, or None."""
        for prefix in self.prefixes:
            if (all(prefix + k in key_set for k in self.keys) and not any(prefix + k in key_set for k in self.absent)
                    and all(has_block(keys, prefix, b) for b in self.blocks)
                    and (self.also is None or self.also(keys, prefix))):
                return prefix
        return None


def match_signatures(keys: list[str], *signatures: Signature) -> Match | None:
    """The first signature (in the order given) these keys have, as a Match, or None."""
    key_set = set(keys)
    for signature in signatures:
        prefix = signature.prefix_in(keys, key_set)
        if prefix is not None:
            return Match(signature.layout, prefix)
    return None


def signature_match(*signatures: Signature) -> Callable[[list[str]], Match | None]:
    """A family's `match`: keys -> the first of `signatures` they have, as a Match, or None."""
    def match_layout(keys: list[str]) -> Match | None:
        return match_signatures(keys, *signatures)

    return match_layout
