"""Which token rows each rank holds: the one place every sequence split (Ulysses, Ring, naive and displaced
patch, PipeFusion's patches and their shards) is cut.

Cuts are near-equal, or in proportion to per-shard weights (`Strategy.device_weights`: a fast card beside a slow
one gets more rows, so neither waits for the other at each collective). Every cut is a contiguous run, and no
size has to suit the degree: Qwen-Image's 1328 px is 83 x 83 tokens, and ComfyUI's Flux dev template at 256x160
has 10 token rows, which any number of PipeFusion patches cuts into near-equal token runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def split_range(total: int, pieces: int, k: int, weights: tuple[float, ...] = ()) -> range:
    """Piece k of range(total) cut into `pieces` contiguous runs: near-equal (the first ones one longer) without
    `weights`, else in proportion to them, every piece at least one row where `total` allows."""
    if not weights or len(set(weights)) == 1:
        base, extra = divmod(total, pieces)
        start = k * base + min(k, extra)
        return range(start, start + base + (1 if k < extra else 0))
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    bounds = [round(total * c / cum[-1]) for c in cum]  # proportional cuts, rounded
    if total >= pieces:  # then no piece may be empty: a ring hop with no keys would have nothing to attend
        for j in range(1, pieces + 1):
            bounds[j] = max(bounds[j], bounds[j - 1] + 1)
        for j in range(pieces - 1, 0, -1):
            bounds[j] = min(bounds[j], bounds[j + 1] - 1)
    return range(bounds[k], bounds[k + 1])


def shard_rows(n: int, k: int) -> list[torch.Tensor]:
    """Row indices of k contiguous shards of n rows, the first n % k one longer."""
    sizes = [n // k + (j < n % k) for j in range(k)]
    return list(torch.arange(n).split(sizes))


def weighted_counts(total: int, weights: tuple[float, ...]) -> list[int]:
    """`total` whole units (attention heads, blocks) shared in proportion to `weights`, each share at least one."""
    return [len(split_range(total, len(weights), k, weights)) for k in range(len(weights))]


@dataclass(frozen=True)
class TokenLayout:
    """Which text, image and reference rows sequence-parallel rank `i` of `shards` holds.

    The canonical sequence is [text, image, references]: reference tokens (Kontext's ReferenceLatent) run
    through every block like image tokens but are not sampled; `ref_len` also counts the learned pad rows a family
    appends to the image stream after them (Z-Image's), which run and are split like reference rows. The image is
    cut into `patches` near-equal token runs (PipeFusion's patches; one otherwise), and every part into one run per
    shard, near-equal or by `weights` (one per shard). Ulysses and Ring take per-shard lengths; the result gather
    takes whole rows.
    """

    text_len: int
    image_len: int
    patches: int
    shards: int
    split_text: bool  # False for naive patch parallel, where every rank keeps the whole prompt
    ref_len: int = 0
    weights: tuple[float, ...] = ()  # per shard: its share of every cut (empty: equal)

    def patch_range(self, patch: int) -> range:
        """The image rows of one PipeFusion patch."""
        return split_range(self.image_len, self.patches, patch)

    def text_rows(self, i: int) -> range:
        if not self.split_text:
            return range(self.text_len)
        # Uneven split allowed: prompts rarely have a token count the degree divides.
        return split_range(self.text_len, self.shards, i, self.weights)

    def ref_rows(self, i: int, patch: int) -> range:
        if not self.split_text:  # naive patch: every rank sees the whole reference, as it sees the prompt
            return range(self.ref_len)
        return split_range(self.ref_len, self.patches * self.shards, patch * self.shards + i,
                           self.weights * self.patches)

    def image_slice(self, i: int, patch: int) -> slice:
        span = self.patch_range(patch)
        rows = split_range(len(span), self.shards, i, self.weights)
        return slice(span.start + rows.start, span.start + rows.stop)

    # Index tensors are built with arange on the device that indexes with them: a CPU index into a CUDA
    # tensor is a blocking host-to-device copy, i.e. a sync, on every use.
    def image_index(self, i: int, patches: list[int], device=None) -> torch.Tensor:
        return torch.cat([torch.arange(s.start, s.stop, device=device)
                          for s in (self.image_slice(i, p) for p in patches)])

    def ref_index(self, i: int, patches: list[int], device=None) -> torch.Tensor:
        return torch.cat([torch.arange(r.start, r.stop, device=device)
                          for r in (self.ref_rows(i, p) for p in patches)])

    def image_positions(self, i: int, patches: list[int], device=None) -> torch.Tensor:
        """Rows of the image stream [image, references] that rank i's image-stream tokens occupy."""
        return torch.cat([self.image_index(i, patches, device), self.image_len + self.ref_index(i, patches, device)])

    def positions(self, i: int, patches: list[int], device=None) -> torch.Tensor:
        """Rows of the canonical sequence [text, image, references] that rank i's tokens occupy."""
        rows = self.text_rows(i)
        text = torch.arange(rows.start, rows.stop, device=device)
        return torch.cat([text, self.text_len + self.image_positions(i, patches, device)])

    def stream_len(self, i: int, patches: list[int]) -> int:
        """Image-stream tokens (image and reference rows) of rank i for these patches."""
        image = sum(len(range(*self.image_slice(i, p).indices(self.image_len))) for p in patches)
        return image + sum(len(self.ref_rows(i, p)) for p in patches)

    def seq_len(self, i: int, patches: list[int]) -> int:
        return len(self.text_rows(i)) + self.stream_len(i, patches)
