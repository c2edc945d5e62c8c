"""ComfyUI's quantized kernel path under a split forward pass (weights/input_amax.py, strategies/forward_amax.py).

nvfp4's kernel path quantizes a layer's input at one global scale from amax(|x|) over the whole input, as ComfyUI's
single device computes it over every token of the pass. A rank holds part of the pass, so it takes that amax over
the ranks of the pass: a layer's token rows split that way equal the whole layer bit for bit; only nvfp4 kernel
layers without a stored input_scale need it (fp8 at scale 1 or the file's, mxfp8 per block and int8 per row quantize
each token alone); an input q, k and v share is reduced once; and one forward pass under CFG-2 or displaced patch
equals one worker. Ulysses-2 and Ring-2 end to end: test_comfy_quant.py's nvfp4 kernel test.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")

from conftest import rel_err  # noqa: E402
from test_comfy_quant import FORMATS, _matmul_job, _one_layer_file, _one_worker_latents, comfy_quant_twins  # noqa: E402
from test_families import job  # noqa: E402
from parallel_runtime.distributed.comm import Group  # noqa: E402
from parallel_runtime.distributed.topology import Topology  # noqa: E402
from parallel_runtime.spec import StrategySpec as S  # noqa: E402
from parallel_runtime.strategies.forward_amax import forward_amax_reduce  # noqa: E402
from parallel_runtime.weights.checkpoint import open_checkpoint  # noqa: E402
from parallel_runtime.weights.input_amax import InputAmax  # noqa: E402
from parallel_runtime.weights.storage import Storage  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _layer(path: str, bias: torch.Tensor, storage: Storage):
    with open_checkpoint(path) as reader:
        return reader.read_kept("l.weight", None, None, "cpu").linear(bias, storage)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nvfp4_token_rows_at_the_pass_amax_equal_the_whole_layer(tmp_path, dtype):
    """Ulysses-2's two token shards of one input, each quantized at the amax of both (the hook's reduce stands in for
    the other rank), give the whole layer's output bit for bit; at their own amax they are 7e-2 off."""
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 256), torch.randn(64), torch.randn(4, 161, 256, dtype=dtype)
    path, _ = _one_layer_file(tmp_path, "nvfp4", w, b)
    storage = Storage(dtype, kernel_formats=frozenset({"nvfp4"}))
    layer = _layer(path, b, storage)
    assert layer.input_amax is storage.input_amax
    whole = layer(x)  # no reduce set (serial): comfy-kitchen's own scale (test_comfy_quant's kernel tests)
    shards = (x[:, :81], x[:, 81:])
    storage.input_amax.reduce = lambda amax: torch.maximum(amax, x.abs().amax().float())
    assert torch.equal(torch.cat([layer(s) for s in shards], dim=1), whole)
    storage.input_amax.reduce = None
    assert rel_err(torch.cat([layer(s) for s in shards], dim=1).float(), whole.float()) > 1e-2  # measured 7.2e-2


def test_only_nvfp4_kernel_layers_without_a_stored_input_scale_take_the_pass_amax(tmp_path):
    """fp8 (scale 1 without a stored one), int8 (per row, ConvRot too) and mxfp8 (per 32 values) quantize each token
    alone; an nvfp4 layer with the file's input_scale quantizes at it (as ComfyUI), and the dequantize path not at
    all: none of them asks the hook."""
    torch.manual_seed(1)
    w, b, x = torch.randn(64, 128), torch.randn(64), torch.randn(9, 128)
    storage = Storage(torch.float32, kernel_formats=frozenset({"float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"}))
    for fmt in FORMATS:
        path, _ = _one_layer_file(tmp_path, fmt, w, b)
        assert (_layer(path, b, storage).input_amax is storage.input_amax) == (fmt == "nvfp4"), fmt
        assert _layer(path, b, Storage(torch.float32)).input_amax is None  # dequantize path
    scale = x.abs().amax() / (448 * 6) * 1.5  # a calibrated static scale
    path, qt = _one_layer_file(tmp_path, "nvfp4", w, b, input_scale=scale)
    layer = _layer(path, b, storage)
    assert layer.input_amax is None
    storage.input_amax.reduce = lambda amax: pytest.fail("a stored input_scale needs no reduce")
    assert torch.equal(layer(x), F.linear(ck_tensor.QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout", scale=scale),
                                          qt, b))


def test_input_amax_reduces_an_input_once_and_again_after_it_changes():
    hook = InputAmax()
    x = torch.randn(3, 5)
    assert hook(x) is None  # nothing splits the pass: comfy-kitchen takes it from x
    calls = []
    hook.reduce = lambda amax: calls.append(amax) or amax * 2  # "the other rank" holds twice this rank's amax
    first = hook(x)
    assert torch.equal(first, 2 * x.abs().amax()) and hook(x) is first and len(calls) == 1  # q, k, v: one reduce
    x.mul_(3)  # changed in place: its version moved
    assert torch.equal(hook(x), 2 * x.abs().amax()) and len(calls) == 2
    hook(x.clone())
    assert len(calls) == 3
    assert hook(torch.empty(0, 5)) == 0  # a rank holding no rows of a stream still joins the reduce
    assert hook(torch.randn(4, dtype=torch.bfloat16)).dtype == torch.bfloat16  # comfy-kitchen divides x's dtype
    hook.reduce = hook.reduce  # a new strategy forgets the last input
    hook(x)
    assert len(calls) == 6


class _Comm:
    """The groups a Comm of `topology` gives `rank`, and the reduces asked of them."""

    def __init__(self, topology: Topology, rank: int):
        self.topology, self.rank, self.reduced = topology, rank, []

    def group(self, name: str) -> Group:
        groups = self.topology.sp_groups() if name == "sp" else self.topology.groups(name)
        ranks = next(g for g in groups if self.rank in g)
        return Group(ranks, ranks.index(self.rank))

    def all_reduce_max(self, t, group, op):
        self.reduced.append(tuple(group.ranks))
        return t


@pytest.mark.parametrize("strategy,batched,groups", [
    (S(), True, []),
    (S(pipefusion_degree=2), True, []),  # a stage holds every token of its patch
    (S(ulysses_degree=2), True, [(0, 1)]),
    (S(cfg_degree=2, ulysses_degree=2), True, [(0, 1), (0, 2)]),
    (S(cfg_degree=2, ulysses_degree=2), False, [(0, 1)]),  # one device runs the branches apart too
    (S(ulysses_degree=2, ring_degree=2), True, [(0, 1, 2, 3)]),
    (S(pipefusion_degree=2, ulysses_degree=2), True, [(0, 1)]),
    (S(patch_degree=2, tensor_degree=2), True, [(0, 2), (0, 1)]),
], ids=lambda v: v.label() if isinstance(v, S) else str(v))
def test_the_amax_spans_the_ranks_of_one_forward_pass(strategy, batched, groups):
    j = job(("kontext", "unused.safetensors"), strategy)
    if not batched:
        j = dataclasses.replace(j, negative=dataclasses.replace(j.negative, references=()))
    comm = _Comm(Topology.from_strategy(strategy), rank=0)
    reduce = forward_amax_reduce(comm, j)
    assert (reduce is None) == (not groups)
    if reduce is not None:
        reduce(torch.ones(()))
        assert comm.reduced == groups


def test_one_forward_pass_under_cfg_and_displaced_patch_equals_one_worker(client1, tmp_path, client2):
    """One step of a mixed nvfp4 file on the kernel path: CFG-2 (the branches one device batches) and displaced
    patch-2 (a warm-up step) equal one worker (measured 0; 0.15 for CFG-2 while each rank took its own amax). Each
    rank reduces at most once per quantized layer of the file (q, k and v share one input, as ComfyUI's fused qkv
    does), plus the reference tokens' embedding, which runs apart from the image's: 4 bytes each."""
    name = "kontext"
    quant, _ = comfy_quant_twins(tmp_path, name, "nvfp4")
    with open_checkpoint(quant) as reader:
        layers = len(reader.quant_layers())
    serial = _one_worker_latents(client1, name, quant, ("kernel",), steps=1)[0]
    for strategy in (S(cfg_degree=2), S(patch_degree=2, warmup_steps=1)):
        result = client2.run(_matmul_job(name, quant, "kernel", strategy, steps=1))
        assert rel_err(result.latent, serial) <= 1e-4, strategy  # EXACT_RTOL: the same arithmetic per row
        for stats in result.stats:
            sent, received = stats["traffic"]["by_op"]["input_amax"]
            assert sent == received and 0 < sent // 4 <= layers + 1, (strategy, sent)
