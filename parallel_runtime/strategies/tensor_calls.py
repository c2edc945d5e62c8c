"""What a tensor-split model's blocks run: the split layers' forwards and the calls that join a block's collectives.

`strategies/tensor.py` (which plans the split and loads each rank's part) gives each split layer one of these
forwards; families call the helpers below from their blocks, so this module sits on the floor below the families
(with the attention they call) and never reaches up: it reads the split a model carries (`model.tensor_split`: its
rank `index`, `degree`, `all_reduce`, `all_gather`, and the job's `comm` and `group`) without importing it.

A block's reductions that need not wait for each other become one collective (`row_projections`, `rms_norms`,
`summed_partials`, `gathered_outputs`; `gathered_ahead` + `answered_by` for a library's block that calls its
modulations itself): on gloo each collective below a few hundred KB costs ~2 ms whatever its size.
"""
from __future__ import annotations

import contextlib

import torch


def _split_of(model: torch.nn.Module):
    """The model's tensor split while a job is bound to it, else None (a whole model, or the cost model's)."""
    split = getattr(model, "tensor_split", None)
    return split if split is not None and split.comm is not None else None


def row_projections(model: torch.nn.Module, calls: list[tuple[torch.nn.Module, torch.Tensor]]) -> list[torch.Tensor]:
    """Each (layer, x) of `calls` as layer(x); on a tensor-split model, whose row-wise layers' products are partial
    sums, with one all-reduce for all of them (`all_reduce_together`), each bias added once after it. The results
    equal the layers' own reduced forwards: the same partial products, summed over the same ranks."""
    split = _split_of(model)
    if split is None:
        return [layer(x) for layer, x in calls]
    partials, biases = [], []
    for layer, x in calls:
        forward = layer.forward
        if not isinstance(forward, RowwiseForward):
            raise ValueError(f"row_projections: {type(layer).__name__} is not a row-wise layer (a ParaDiT bug)")
        out, bias = forward.partial(x)
        partials.append(out)
        biases.append(bias)
    summed = split.all_reduce_together(partials)
    return [out + bias.to(out.dtype) if bias is not None else out for out, bias in zip(summed, biases)]


def summed_partials(model: torch.nn.Module, partials: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs a family computed without their row-wise layers' all-reduce (a mixture of experts sums its experts'
    partial products first): summed over the tensor group in one all-reduce, or as they are on a whole model."""
    split = _split_of(model)
    return split.all_reduce_together(partials) if split is not None else partials


def gathered_outputs(model: torch.nn.Module, calls: list[tuple[torch.nn.Module, torch.Tensor]]) -> list[torch.Tensor]:
    """Each (layer, x) of `calls` as layer(x); where the layers keep 1/N of their outputs ("gather" style), one
    all-gather for all of them (a model's modulations, all read from the step's time embedding, need one
    collective per step instead of one per block)."""
    split = _split_of(model)
    if (split is None or not calls
            or not all(isinstance(l.forward, GatherForward) for l, _ in calls)):
        return [layer(x) for layer, x in calls]
    partials = [layer.forward.forward(x) for layer, x in calls]
    widths = [p.shape[-1] for p in partials]
    ranks = [r.split(widths, dim=-1) for r in split.comm.all_gather(torch.cat(partials, dim=-1).contiguous(),
                                                                     split.group, op="tensor")]
    return [torch.cat([pieces[j] for pieces in ranks], dim=-1) for j in range(len(calls))]


def gathered_ahead(model: torch.nn.Module, calls: list[tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]]
                   ) -> dict[torch.nn.Module, torch.Tensor]:
    """For blocks a library runs whole (diffusers' forward calls each modulation inside it): each (module, its
    gathered layer, that layer's input) of `calls` computed up front by `gathered_outputs` (one all-gather for all),
    as {module: its output} for `answered_by`; {} without a tensor split (the modules then run as they are)."""
    if _split_of(model) is None:
        return {}
    outputs = gathered_outputs(model, [(layer, x) for _, layer, x in calls])
    return {module: out for (module, _, _), out in zip(calls, outputs)}


@contextlib.contextmanager
def answered_by(outputs: dict[torch.nn.Module, torch.Tensor]):
    """While the block runs, each module of `outputs` returns its tensor (computed ahead from the same input),
    whatever it is called with; afterwards its own forward again. A module the block does not call is left as
    it was: nothing carries over to another block or step."""
    before = {module: module.__dict__.get("forward") for module in outputs}
    for module, out in outputs.items():
        module.forward = lambda *args, _out=out, **kwargs: _out
    try:
        yield
    finally:
        for module, forward in before.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def rms_norms(model: torch.nn.Module, calls: list[tuple[torch.nn.Module, torch.Tensor]]) -> list[torch.Tensor]:
    """Each (norm, x) of `calls` as norm(x); where the norms run over a tensor split's whole width ("norm" style),
    their sums of squares all-reduced together, then each norm's arithmetic (as `NormForward`)."""
    split = _split_of(model)
    if split is None or not all(isinstance(n.forward, NormForward) for n, _ in calls):
        return [norm(x) for norm, x in calls]
    squares = split.all_reduce_together([x.to(torch.float32).pow(2).sum(-1, keepdim=True) for _, x in calls])
    return [norm.forward.apply(x, sq) for (norm, x), sq in zip(calls, squares)]


class RowwiseForward:
    """A row-wise layer's forward: its partial product without the bias (whatever kind of linear layer it is:
    the storage kinds all read `bias` when they run), summed over the group, then the bias once."""

    def __init__(self, layer: torch.nn.Module, split):
        self.forward, self.layer, self.split = type(layer).forward.__get__(layer), layer, split

    def partial(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this rank's partial product, the bias to add once after the sum)."""
        params = self.layer._parameters
        bias = params.get("bias")
        params["bias"] = None
        try:
            out = self.forward(x)
        finally:
            params["bias"] = bias
        return out.contiguous(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.partial(x)
        out = self.split.all_reduce(out)
        return out + bias.to(out.dtype) if bias is not None else out


class VocabForward:
    """An embedding table holding rows [index n, (index + 1) n) of the vocabulary (Megatron's vocab-parallel
    embedding): an id outside them looks up row 0 and is zeroed, so the group's sum gives every id its one rank's
    row (a sum with zeros: exact)."""

    def __init__(self, table: torch.nn.Module, split):
        self.forward, self.table, self.split = type(table).forward.__get__(table), table, split

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.num_embeddings
        local = ids - self.split.index * rows
        outside = (local < 0) | (local >= rows)
        out = self.forward(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0)
        return self.split.all_reduce(out.contiguous())


class GatherForward:
    """A layer that keeps 1/N of its outputs: computed, then all-gathered into the whole output."""

    def __init__(self, layer: torch.nn.Module, split):
        self.forward, self.split = type(layer).forward.__get__(layer), split

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.split.all_gather(self.forward(x))


class NormForward:
    """An RMSNorm over a column-wise layer's whole output, on this rank's columns: the sum of squares all-reduced,
    then diffusers' RMSNorm arithmetic (float32 statistics, the weight's half type kept)."""

    def __init__(self, norm: torch.nn.Module, split):
        self.norm, self.split = norm, split
        if type(norm).__name__ != "RMSNorm":
            raise ValueError(f"a {type(norm).__name__} cannot run over a tensor-parallel split (only RMSNorm)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.split.all_reduce(x.to(torch.float32).pow(2).sum(-1, keepdim=True)))

    def apply(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """The norm of this rank's columns `x`, given the group's sum of squares of each row."""
        norm = self.norm
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        out = x * torch.rsqrt(squares / (x.shape[-1] * self.split.degree) + eps)
        weight, bias = norm.weight, getattr(norm, "bias", None)
        if weight is None:
            return out.to(x.dtype)
        if weight.dtype in (torch.float16, torch.bfloat16):
            out = out.to(weight.dtype)
        out = out * weight
        return out + bias if bias is not None else out


# The forward each split style gives its layers (strategies/tensor.parallelize_tensor installs them).
SPLIT_FORWARDS = {"rowwise": RowwiseForward, "norm": NormForward, "gather": GatherForward, "vocab": VocabForward}
