"""Tensor parallelism: every block's attention heads and MLP hidden units split over the tensor group.

Megatron's pairing, as torchtitan's `parallelize_*` functions and diffusers' `_tp_plan` apply it: a column-wise
layer (q/k/v, an MLP's up and gate projections) keeps 1/N of its output rows, so each rank computes its own heads
or hidden units from the whole input; the row-wise layer after it (attention's out-projection, the MLP's down
projection) keeps the matching 1/N of its input columns, so each rank's product is a partial sum, which one
all-reduce over the group completes (the bias added once, after it). Nothing between the two layers communicates:
attention runs on the rank's heads (Ulysses and Ring inside a tensor rank see heads/N of them), activations act
elementwise. A q/k norm over the whole width of all heads (Wan's RMSNorm, style "norm") holds the columns of its
column-wise layer and all-reduces its sum of squares; a per-head q/k norm works unchanged on a rank's heads. A
block's modulation (adaLN: per sample, not per token, yet ~a third of a Flux block's weights) keeps 1/N of its
outputs and all-gathers them ("gather": a few KB per block and step), so every rank applies the whole modulation.
A token embedding (a vocabulary of 150k rows: 7% of an 8B decoder) keeps 1/N of its rows and all-reduces its
lookups ("vocab"). Other norms, embedders and the final layer are every rank's. A block whose reductions need not
wait for each other makes them one collective (tensor_calls.py, which also holds the split layers' forwards).

The plan is data (`DiTFamily.tensor_plan_for`: module-name patterns -> "colwise", "rowwise", "norm", "gather", or
diffusers' packed styles for a layer that fuses projections). Loading reads only each rank's part:
`TensorSplit.shard` shrinks the meta model's layers to their local shapes, divides the head counts attention reads,
and gives each parameter's `keymap.Source` its `Shard`, so every storage kind reads just those rows or columns.
After loading, `parallelize_tensor` gives the row-wise layers and whole-width norms their all-reduce and the
gathered layers their all-gather, and each job `bind_tensor_group` points them at its tensor group.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError
from ..weights.keymap import Shard, Source
from .tensor_calls import SPLIT_FORWARDS

# Attributes of an attention module that count its heads or their width (diffusers' Attention and fused
# attention-MLP modules): a rank runs 1/N of each.
WIDTH_ATTRIBUTES = ("heads", "kv_heads", "inner_dim", "inner_kv_dim", "mlp_hidden_dim")


@dataclasses.dataclass(frozen=True)
class Style:
    """How one module splits: `kind` "colwise" / "rowwise" (a linear layer's output rows / input columns), "norm" (a
    norm over a column-wise layer's whole output), "gather" (output rows, all-gathered after it runs) or "vocab" (an
    embedding table's rows, its lookups all-reduced); `blocks`:
    the fused projections' sizes along the split dimension (one block unless the layer packs several)."""

    kind: str
    blocks: tuple[int, ...]


def resolve_plan(model: torch.nn.Module, plan: dict) -> dict[str, Style]:
    """{module name: Style} of a plan whose keys are module names with at most one `*` over a ModuleList (diffusers'
    `_tp_plan` grammar); modules a key names that the model lacks (an optional layer) are skipped."""
    styles: dict[str, Style] = {}
    for pattern, style in plan.items():
        prefix, star, suffix = pattern.partition("*")
        if star:
            container = _find(model, prefix.strip("."))
            names = [f"{prefix.strip('.')}.{i}.{suffix.strip('.')}" for i in range(len(container or ()))]
        else:
            names = [pattern]
        for name in names:
            module = _find(model, name)
            if module is not None:
                styles[name] = _style(style, module, name)
    return styles


def _find(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _style(style, module: torch.nn.Module, name: str) -> Style:
    """A plan value as a Style: a kind ("colwise", "rowwise", "norm", "gather"), a (kind, block proportions) pair
    for a layer that packs projections, or diffusers' PackedColwiseParallel / PackedRowwiseParallel (its blocks, or
    the `_tp_packed_*_blocks` sizes the layer carries)."""
    if isinstance(style, str):
        kind, blocks = style, None
    elif isinstance(style, tuple):
        kind, blocks = style
    else:
        kind = "colwise" if "Colwise" in type(style).__name__ else "rowwise"
        blocks = style.blocks or getattr(module, f"_tp_packed_{'col' if kind == 'colwise' else 'row'}_blocks", None)
        if not blocks:  # one block would cut the packed projections' columns wrongly: a plan bug
            raise ValueError(f"{name}: a packed tensor-parallel style needs its blocks")
    if kind not in ("colwise", "rowwise", "norm", "gather", "vocab"):
        raise ValueError(f"unknown tensor-parallel style {style!r} for {name}")
    size = module.weight.shape[1 if kind == "rowwise" else 0]
    blocks = tuple(blocks or (1,))
    unit, extra = divmod(size, sum(blocks))
    if extra:
        raise ValueError(f"{name}: blocks {blocks} do not divide its {size} units")
    return Style(kind, tuple(b * unit for b in blocks))


@dataclasses.dataclass
class TensorSplit:
    """Rank `index` of a tensor group of `degree`: what it cut while loading (`reducing`: the modules that
    all-reduce or all-gather, `sources`: the sharded key map) and, during a job, the group they run on."""

    index: int
    degree: int
    joined: dict[str, str] = dataclasses.field(default_factory=dict)  # module -> its kind, unless "colwise"
    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    comm: object = None
    group: object = None

    def shard(self, model: torch.nn.Module, plan: dict, smap: dict[str, Source], what: str) -> dict[str, Source]:
        """Shrink a meta-device `model`'s planned layers to this rank's part and return `smap` with each of their
        parameters' Shard; one sentence where the degree does not divide a layer (`what` names the model)."""
        styles = resolve_plan(model, plan)
        if not styles:
            raise ConfigError(f"{what} has no tensor-parallel plan (its layers are not split yet); set "
                              f"tensor_degree=1 and split it with ulysses_degree or ring_degree instead.")
        shards: dict[str, Shard] = {}
        for name, style in styles.items():
            module = model.get_submodule(name)
            shards.update(self._shrink(module, name, style, what))
            if style.kind != "colwise":
                self.joined[name] = style.kind
        split_by = {name.rpartition(".")[0] for name, style in styles.items() if style.kind == "colwise"}
        for name, module in model.named_modules():
            if name in split_by:
                self._divide_widths(module, name, what)
        self.sources = {n: dataclasses.replace(src, shard=shards[n]) if n in shards else src for n, src in smap.items()}
        return self.sources

    def _shrink(self, module: torch.nn.Module, name: str, style: Style, what: str) -> dict[str, Shard]:
        """Give `module`'s split parameters their local (meta) shapes; returns {parameter: Shard}."""
        for size in style.blocks:
            if size % self.degree:
                raise ConfigError(f"tensor_degree={self.degree} does not divide the {size} "
                                  f"{'input columns' if style.kind == 'rowwise' else 'outputs'} of {what}'s {name}; "
                                  f"pick a divisor of the model's head count and MLP width.")
        dim = 1 if style.kind == "rowwise" else 0
        shard = Shard(dim, style.blocks, self.index, self.degree)
        out = {}
        for param in ("weight", "bias"):
            value = getattr(module, param, None)
            if value is None or (param == "bias" and dim == 1):  # a row-wise bias is added once, after the sum
                continue
            shape = list(value.shape)
            shape[dim] //= self.degree
            setattr(module, param, torch.nn.Parameter(torch.empty(shape, dtype=value.dtype, device="meta"),
                                                      requires_grad=False))
            out[f"{name}.{param}"] = shard
        for attr in ("out_features", "in_features", "num_embeddings"):  # nn.Linear's / nn.Embedding's own record
            if hasattr(module, attr):
                setattr(module, attr, module.weight.shape[1 if attr == "in_features" else 0])
        return out

    def _divide_widths(self, module: torch.nn.Module, name: str, what: str) -> None:
        """An attention module whose projections split holds 1/N of its heads: its processor reads `heads`."""
        for attr in WIDTH_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % self.degree:
                    raise ConfigError(f"tensor_degree={self.degree} does not divide the {value} "
                                      f"{attr.replace('_', ' ')} of {what}'s {name}; pick a divisor of the model's "
                                      f"head count.")
                setattr(module, attr, value // self.degree)

    # -- during a job ---------------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t, self.group, op="tensor")

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, joined along the last dimension in rank order."""
        return torch.cat(self.comm.all_gather(t.contiguous(), self.group, op="tensor"), dim=-1)

    def all_reduce_together(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of `parts` summed over the group, by one all-reduce of them laid end to end: a block's reductions
        that need not wait for each other (two streams' out-projections, a norm's statistics of q and k) pay one
        collective's latency (~2 ms on gloo whatever the size below a few hundred KB), not one each."""
        if len(parts) == 1:
            return [self.all_reduce(parts[0].contiguous())]
        dtype = parts[0].dtype
        if any(p.dtype != dtype for p in parts):
            raise ValueError("tensors reduced together share one dtype (a ParaDiT bug)")
        flat = self.all_reduce(torch.cat([p.reshape(-1) for p in parts]))
        return [chunk.view(p.shape) for chunk, p in zip(flat.split([p.numel() for p in parts]), parts)]


def parallelize_tensor(model: torch.nn.Module, split: TensorSplit) -> None:
    """Give the loaded model's row-wise layers and whole-width norms their all-reduce and its gathered layers their
    all-gather over `split`'s group (bound per job), and keep the split on the model (`bind_tensor_group` finds it
    there)."""
    for name, kind in split.joined.items():
        module = _find(model, name)
        if module is None or isinstance(module, torch.nn.Identity):  # in a block another PipeFusion stage runs
            continue
        module.forward = SPLIT_FORWARDS[kind](module, split)
    model.tensor_split = split


def bind_tensor_group(model: torch.nn.Module, comm) -> None:
    """Point a tensor-split model's all-reduces at this job's tensor group (nothing for a whole model)."""
    split = getattr(model, "tensor_split", None)
    if split is not None:
        split.comm, split.group = comm, comm.group("tensor")
