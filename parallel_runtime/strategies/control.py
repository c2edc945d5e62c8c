"""ControlNet residuals under the job's token split.

ComfyUI runs a ControlNet chain before each model call and hands the DiT one residual per block, added to
the block's image rows. Here each rank runs the chain's ControlNets on the tokens it holds, with the same
attention strategy as the DiT (the ControlNet's blocks are the family's blocks): under Ulysses and Ring the
ControlNet's sequence splits exactly like the DiT's, so each rank computes the residuals of its own image
rows and nothing extra crosses the wire; under CFG parallel each rank runs its branch's chain; under
PipeFusion the first stage runs the chain on each patch (its attention reads stale K/V like the DiT's) and
the residuals ride with the patch's hidden rows to the stages that add them. ComfyUI's ControlNets never see
Kontext's reference rows (the DiT adds the residuals to its image rows, which come first): with references,
the ControlNet's sequence is the DiT's without them, over the same image rows per rank.

A ControlNet's outputs are few (one per ControlNet block) and ComfyUI repeats them over the DiT's blocks;
`ResidualPlan` keeps that mapping, so only the distinct outputs are computed, sent and kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..spec import ControlInput
from .batch import repeat_to_batch

HINTS_KEPT = 8  # ControlNet hints the workers keep between jobs (and hint token tables each ControlNet keeps)


@dataclass
class ControlNets:
    """A job's ControlNets on one rank: path -> loaded adapter where this rank runs them (every rank, or
    PipeFusion's first stage), and path -> config on every rank."""

    nets: dict = field(default_factory=dict)
    configs: dict = field(default_factory=dict)


class ResidualPlan:
    """Which distinct ControlNet outputs each DiT block adds: block index -> positions in the flat list of
    every chain member's outputs (chain order), whose sum in that order is ComfyUI's merged residual."""

    def __init__(self, configs: list, main_double: int, main_single: int):
        self.sizes = [c.outputs for c in configs]
        self.blocks: dict[int, list[int]] = {}
        offset = 0
        for config in configs:
            for block, j in config.residual_index(main_double, main_single).items():
                self.blocks.setdefault(block, []).append(offset + j)
            offset += config.outputs

    @property
    def count(self) -> int:
        return sum(self.sizes)


class Residuals:
    """The residuals one forward pass adds, summed per block when first asked (ComfyUI's control_merge adds a
    chain's members in order: earlier ControlNets first)."""

    def __init__(self, outputs: list[torch.Tensor], plan: ResidualPlan):
        self.outputs, self.plan = outputs, plan

    def get(self, block: int) -> torch.Tensor | None:
        positions = self.plan.blocks.get(block)
        if not positions:
            return None
        total = self.outputs[positions[0]]
        for j in positions[1:]:
            total = total + self.outputs[j]
        return total


class ControlPass:
    """One group of branches' ControlNet chain on this rank, for one job (one model call).

    `nets`: path -> the worker's loaded ControlNet adapter (absent on PipeFusion stages after the first, which
    only add residuals); `configs`: path -> its config, on every rank. The prompt's embedding and the time
    embedding are computed once per job; the hint's token table once per hint (kept by the adapter)."""

    def __init__(self, controlnets: ControlNets, main_config, branches, t: torch.Tensor, text_rows: range,
                 hw: tuple[int, ...], sequence=None, shares_sequence: bool = True):
        """`sequence(extra)`: (this rank's prompt rows, joint attention, RoPE rows) of the ControlNet's own pass, its
        prompt `extra` tokens longer than the DiT's (a union ControlNet's type tokens) and without the DiT's
        reference rows, its image rows and their shards the DiT's (None where no strategy offers it);
        `shares_sequence`: whether an untyped pass runs on the DiT's attention and RoPE rows (no reference rows, or
        the caller points them at the ControlNet's sequence); `hw`: the latent's size (for position embeddings)."""
        self.inputs, self.nets, self.branches = branches.control, controlnets.nets, branches
        self.plan = ResidualPlan([controlnets.configs[c.path] for c in self.inputs], main_config.num_layers,
                                 main_config.num_single_layers)
        self.t, self.text_rows, self.hw = t, text_rows, hw
        self.sequence, self.shares_sequence = sequence, shares_sequence
        self._embedded: dict[int, tuple] = {}

    def _embeddings(self, k: int, net, control: ControlInput) -> tuple:
        """(prompt rows, time embedding, (attention, RoPE rows) of the member's own sequence, or None where it is
        the DiT's) of chain member k: fixed for the job."""
        if k not in self._embedded:
            b = self.branches
            own = None
            extra = len(control.types) if control.types and net.reads_types else 0
            if extra or not self.shares_sequence:
                rows, attention, rope = self.sequence(extra)
                own = (attention, rope)
            if extra:
                text = net.embed_prompt_with_types(b.cond, control.types)[:, rows.start:rows.stop]
            else:
                text = net.embed_text(b.cond[:, self.text_rows.start:self.text_rows.stop])
            self._embedded[k] = (text, net.timestep_embedding(self.t, b.pooled, b.guidance), own)
        return self._embedded[k]

    def outputs(self, x_rows: torch.Tensor, index: torch.Tensor, rope) -> list[torch.Tensor]:
        """Every chain member's distinct residuals for the image rows `index` (x_rows: those rows of the call's
        input-scaled latent tokens, one row per branch and latent), each scaled by its strength."""
        out = []
        for k, control in enumerate(self.inputs):
            net = self.nets[control.path]
            net.use_layers(k)
            hint = _batched(hint_tokens(net, control)[:, index], self.branches)
            text, temb, own = self._embeddings(k, net, control)
            image = net.embed_control_image(x_rows, hint, index, self.hw)
            for residual in self._run(net, image, text, temb, rope, own):
                out.append(residual * control.strength if control.strength != 1.0 else residual)
        return out

    @staticmethod
    def _run(net, image, text, temb, rope, own) -> list[torch.Tensor]:
        """The member's residuals; a pass over its own sequence attends with its own attention and RoPE rows."""
        if own is None:
            return net.residuals(image, text, temb, rope)
        context, (attention, own_rope) = net.context, own
        saved, context.attention = context.attention, attention
        try:
            return net.residuals(image, text, temb, own_rope)
        finally:
            context.attention = saved

    def residuals(self, x_rows: torch.Tensor, index: torch.Tensor, rope) -> Residuals:
        return Residuals(self.outputs(x_rows, index, rope), self.plan)


def hint_tokens(net, control: ControlInput) -> torch.Tensor:
    """The embedded hint of `control` on this ControlNet, computed once per hint and kept in the adapter's
    `hint_cache` (a sampling run's calls all use the same hint)."""
    cache = net.hint_cache
    if control.hint_key not in cache:
        cache[control.hint_key] = net.hint_tokens(control.hint)
        while len(cache) > HINTS_KEPT:
            cache.popitem(last=False)
    cache.move_to_end(control.hint_key)
    return cache[control.hint_key]


def _batched(tokens: torch.Tensor, branches) -> torch.Tensor:
    """Hint tokens of one latent batch tiled as ComfyUI's broadcast_image_to tiles them: to the batch, then
    once per branch."""
    tokens = repeat_to_batch(tokens, branches.whole_batch)
    if branches.batch_rows is not None:  # batch parallel: this group's images of the whole batch
        tokens = tokens[branches.batch_rows]
    return tokens.repeat(branches.count, 1, 1) if branches.count > 1 else tokens
