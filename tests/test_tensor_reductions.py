"""Tensor parallelism's joined collectives and vocab-parallel embedding, rank by rank in one process.

Two ranks' shards of the same layers run one after the other over a recording communicator: the first pass records
what each rank would send, the second hands every rank its peer's record. The tests count the collectives (one for
a block's reductions that need not wait for each other) and compare with the unsplit layers. End to end (two
workers, gloo) the same paths run under HiDream I1's and HiDream O1's tensor2 tests.
"""
from __future__ import annotations

import torch

from parallel_runtime.strategies.tensor import TensorSplit
from parallel_runtime.strategies.tensor_calls import (SPLIT_FORWARDS, answered_by, gathered_ahead, gathered_outputs,
                                                      rms_norms, row_projections)

# Two partial products summed vs one whole matmul: the same terms added in another order, fp32 round-off.
ROUND_OFF = 1e-6


class RecordingComm:
    """A two-rank group seen from one rank: each collective is recorded; where `peer` holds the other rank's
    record of the same call, the result includes it, else the call answers as if the peer sent zeros (all-reduce)
    or a copy (all-gather)."""

    def __init__(self, index: int, peer: list | None = None):
        self.index, self.peer, self.sent = index, peer, []

    def group(self, name):
        return "tensor"

    def _other(self, t):
        return self.peer[len(self.sent) - 1] if self.peer is not None else None

    def all_reduce(self, t, group, op="tensor"):
        self.sent.append(t.clone())
        other = self._other(t)
        return t if other is None else t + other if self.index == 0 else other + t

    def all_gather(self, t, group, op="tensor"):
        self.sent.append(t.clone())
        other = self._other(t)
        other = t if other is None else other
        return [t, other] if self.index == 0 else [other, t]


class Model(torch.nn.Module):
    """Rank `index`'s half of: a vocabulary, two out-projections with biases, two whole-width q/k norms and two
    modulation layers, cut as the tensor plan cuts them (row-wise: input columns; gather: output rows)."""

    def __init__(self, whole: dict, index: int):
        super().__init__()
        half = lambda t, dim: t.chunk(2, dim=dim)[index].clone()  # noqa: E731
        self.table = torch.nn.Embedding.from_pretrained(half(whole["table"], 0))
        self.outs = torch.nn.ModuleList()
        for w, b in whole["outs"]:
            out = torch.nn.Linear(w.shape[1] // 2, w.shape[0])
            out.weight.data, out.bias.data = half(w, 1), b.clone()
            self.outs.append(out)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(8, eps=1e-6) for _ in range(2))
        for norm, w in zip(self.norms, whole["norms"]):
            norm.weight.data = half(w, 0)
        self.mods = torch.nn.ModuleList()
        for w, b in whole["mods"]:
            mod = torch.nn.Linear(w.shape[1], w.shape[0] // 2)
            mod.weight.data, mod.bias.data = half(w, 0), half(b, 0)
            self.mods.append(mod)


def whole_weights(generator) -> dict:
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    return {"table": r(10, 6), "outs": [(r(6, 8), r(6)), (r(6, 8), r(6))], "norms": [r(16), r(16)],
            "mods": [(r(12, 6), r(12)), (r(24, 6), r(24))]}


def split_model(whole: dict, index: int, comm: RecordingComm) -> Model:
    model = Model(whole, index)
    split = TensorSplit(index, 2, joined={"table": "vocab", "outs.0": "rowwise", "outs.1": "rowwise",
                                          "norms.0": "norm", "norms.1": "norm", "mods.0": "gather", "mods.1": "gather"})
    for name, kind in split.joined.items():
        module = model.get_submodule(name)
        module.forward = SPLIT_FORWARDS[kind](module, split)
    model.tensor_split, split.comm, split.group = split, comm, "tensor"
    return model


def both_ranks(whole: dict, run):
    """run(model) on each rank twice: once recording, once with the peer's records; returns (results, comms)."""
    first = [RecordingComm(i) for i in range(2)]
    for i in range(2):
        run(split_model(whole, i, first[i]))
    comms = [RecordingComm(i, first[1 - i].sent) for i in range(2)]
    return [run(split_model(whole, i, comms[i])) for i in range(2)], comms


def test_vocab_parallel_embedding_equals_the_whole_table_bit_for_bit():
    whole = whole_weights(torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 4, 5, 9, 3, 7, 5]])  # both halves (rows 0-4 on rank 0, 5-9 on rank 1), repeats
    (a, b), comms = both_ranks(whole, lambda m: m.table(ids))
    expected = torch.nn.functional.embedding(ids, whole["table"])
    assert torch.equal(a, expected) and torch.equal(b, expected)  # a row plus zeros: exact
    assert [len(c.sent) for c in comms] == [1, 1]
    assert torch.equal(comms[0].sent[0][0, 2], torch.zeros(6))  # id 5 is rank 1's: rank 0 sends zeros for it


def test_row_projections_reduce_two_layers_in_one_all_reduce():
    g = torch.Generator().manual_seed(1)
    whole = whole_weights(g)
    x, y = torch.randn(1, 5, 8, generator=g), torch.randn(1, 3, 8, generator=g)  # two streams' rows

    def run(model):
        half = lambda t: t.chunk(2, dim=-1)[model.tensor_split.index]  # noqa: E731
        return row_projections(model, [(model.outs[0], half(x)), (model.outs[1], half(y))])

    (a, b), comms = both_ranks(whole, run)
    assert [len(c.sent) for c in comms] == [1, 1]  # one collective for both layers
    for got in (a, b):
        for out, rows, (w, bias) in zip(got, (x, y), whole["outs"]):
            expected = rows @ w.T + bias  # the bias once, after the sum
            assert (out - expected).norm() / expected.norm() < ROUND_OFF
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_rms_norms_sum_every_norms_statistics_in_one_all_reduce():
    g = torch.Generator().manual_seed(2)
    whole = whole_weights(g)
    q, k = torch.randn(1, 4, 16, generator=g), torch.randn(1, 4, 16, generator=g)

    def run(model):
        half = lambda t: t.chunk(2, dim=-1)[model.tensor_split.index]  # noqa: E731
        return rms_norms(model, [(model.norms[0], half(q)), (model.norms[1], half(k))])

    (a, b), comms = both_ranks(whole, run)
    assert [len(c.sent) for c in comms] == [1, 1]
    for index, got in enumerate((a, b)):
        for out, rows, w in zip(got, (q, k), whole["norms"]):
            expected = torch.nn.functional.rms_norm(rows, (16,), w, eps=1e-6).chunk(2, dim=-1)[index]
            assert (out - expected).norm() / expected.norm() < ROUND_OFF


def test_gathered_outputs_gather_every_modulation_at_once():
    g = torch.Generator().manual_seed(3)
    whole = whole_weights(g)
    t = torch.randn(2, 6, generator=g)  # two samples' time embeddings
    (a, b), comms = both_ranks(whole, lambda m: gathered_outputs(m, [(m.mods[0], t), (m.mods[1], t)]))
    assert [len(c.sent) for c in comms] == [1, 1]
    for got in (a, b):
        for out, (w, bias) in zip(got, whole["mods"]):
            assert out.shape == (2, w.shape[0])
            expected = t @ w.T + bias
            assert (out - expected).norm() / expected.norm() < ROUND_OFF


def test_without_a_tensor_split_the_helpers_call_the_layers():
    whole = whole_weights(torch.Generator().manual_seed(4))
    model = Model(whole, 0)
    x = torch.randn(1, 2, 4)
    assert torch.equal(row_projections(model, [(model.outs[0], x)])[0], model.outs[0](x))
    assert torch.equal(rms_norms(model, [(model.norms[0], torch.ones(1, 2, 8))])[0],
                       model.norms[0](torch.ones(1, 2, 8)))
    t = torch.randn(1, 6)
    assert torch.equal(gathered_outputs(model, [(model.mods[0], t)])[0], model.mods[0](t))


def test_modulations_gathered_ahead_answer_their_blocks_then_restore_the_modules():
    """Kandinsky 6's path: diffusers' block calls its modulation itself; every block's share is gathered in one
    collective ahead, each module answers with its own result inside the `with`, and runs as before after it."""
    g = torch.Generator().manual_seed(5)
    whole = whole_weights(g)
    t = torch.randn(1, 6, generator=g)

    def run(model):
        wrappers = [torch.nn.Sequential(mod) for mod in model.mods]  # the modules diffusers' block would call
        ahead = gathered_ahead(model, [(w, w[0], t) for w in wrappers])
        with answered_by(ahead):
            inside = [w(torch.zeros(1)) for w in wrappers]  # the input is not read again
        assert all("forward" not in w.__dict__ for w in wrappers)  # restored: nothing carries to the next step
        return inside

    (a, b), comms = both_ranks(whole, run)
    assert [len(c.sent) for c in comms] == [1, 1]
    for got in (a, b):
        for out, (w, bias) in zip(got, whole["mods"]):
            expected = t @ w.T + bias
            assert (out - expected).norm() / expected.norm() < ROUND_OFF
    plain = Model(whole, 0)  # no tensor split: nothing computed ahead, the modules run as they are
    assert gathered_ahead(plain, [(plain.mods[0], plain.mods[0], t)]) == {}
