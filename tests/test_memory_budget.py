"""What a worker reports it holds and has free, and the budget the client plans a job with (planning/memory.py).

- The stale K/V a stock sampler's displaced patch (or PipeFusion) call keeps for the next call is held, as the
  weights are: the next call's need counts its K/V buffers, so the budget must not count them as spent too.
- On CUDA, the blocks torch's caching allocator reserved but no tensor uses are free: it serves new tensors from
  them first. mem_get_info alone counts them as taken, and after an out-of-memory error (or any job, without an
  empty_cache behind it) they can be most of the card.

No GPU here: the CUDA cases fake the card (torch.cuda.mem_get_info, memory_reserved, memory_allocated) with a
caching allocator's bookkeeping, in whole GiB.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_job
from parallel_runtime.models.tiny import TINY
from parallel_runtime.planning.memory import rank_budgets, worker_report
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(300)

GiB = 2**30


class FakeCard:
    """A CUDA device as torch's caching allocator and the driver see it: tensors take reserved blocks, which the
    allocator keeps when the tensors die; what it has not reserved (less the CUDA context) is the driver's free."""

    def __init__(self, total: int, context: int):
        self.total, self.context, self.allocated, self.reserved = total, context, 0, 0

    def allocate(self, n: int) -> None:
        if n > self.reserved - self.allocated + self.free_in_driver():
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB")
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)

    def release(self, n: int) -> None:
        self.allocated -= n  # the blocks stay reserved, as torch's allocator keeps them until empty_cache

    def free_in_driver(self) -> int:
        return self.total - self.context - self.reserved

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free_in_driver(), self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)


def _budget(models: list[dict], **held) -> int:
    return rank_budgets(["cuda:0"], [worker_report(torch.device("cuda", 0), models, **held)])[0]


def _model(nbytes: int) -> dict:
    return {"name": "flux", "path": "flux.safetensors", "weight_dtype": "default", "quantized_matmul": False,
            "bytes": nbytes}


def test_budget_after_a_stale_kv_call_still_fits_that_call(monkeypatch):
    """24 GiB card, 1 GiB context, 10 GiB of weights: 0.9 x 13 + 10 = 21.7 GiB before the first call. The call
    keeps 6 GiB of stale K/V for the next (and its activations' blocks were returned to the driver). Held, the
    K/V leaves 0.9 x 7 + 16 = 22.3 GiB; counted as spent, 16.3 GiB, so a call needing 21 GiB (its 6 GiB of K/V
    included) would be refused at the second step of a sampler that ran its first."""
    card = FakeCard(24 * GiB, 1 * GiB)
    card.install(monkeypatch)
    card.allocate(10 * GiB)
    weights = [_model(10 * GiB)]
    before = _budget(weights)
    card.allocate(6 * GiB)  # the stale K/V, kept after the call
    after = _budget(weights, stale_kv_bytes=6 * GiB)
    assert after >= before
    assert after == int(0.9 * 7 * GiB) + 16 * GiB


def test_budget_after_an_out_of_memory_error_counts_the_cached_blocks_free(monkeypatch):
    """A job's activations took 12 GiB, then its next 20 GiB allocation failed (an injected out-of-memory error);
    its tensors are gone, their blocks still reserved. The next job may use them: the budget is what it was before
    that job (0.9 x 13 + 10 GiB), not 0.9 x 1 + 10 GiB, which the driver's free alone gives."""
    card = FakeCard(24 * GiB, 1 * GiB)
    card.install(monkeypatch)
    card.allocate(10 * GiB)
    weights = [_model(10 * GiB)]
    before = _budget(weights)
    card.allocate(12 * GiB)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        card.allocate(20 * GiB)
    card.release(12 * GiB)
    assert card.free_in_driver() == 1 * GiB  # what mem_get_info says
    assert _budget(weights) == before == int(0.9 * 13 * GiB) + 10 * GiB


def test_a_stale_kv_call_reports_its_buffers_as_held(client2, tiny_path):
    """Two CPU workers, displaced patch 2: a stock sampler's call (cond and uncond chunks batched) keeps every
    attention layer's K/V over the whole sequence for the next call, and the workers' answer to a ping counts them
    as held: 2 (K, V) x 2 chunks x (7 + 64) rows x 128 (4 heads of 32) x 4 bytes x 4 layers = 581,632 bytes on
    each rank. The run's last call drops them, and the report with them."""
    expected = 2 * 2 * (7 + 8 * 8) * TINY.num_heads * TINY.head_dim * 4 * (TINY.num_layers + TINY.num_single_layers)
    strategy = S(patch_degree=2, warmup_steps=1)
    job = make_job(tiny_path, strategy, size=16)
    call = dataclasses.replace(job, latent=torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(0)),
                               timestep=torch.full((2,), 0.5), call_step=0, call_last=False)
    resident = [stats["resident_bytes"] for stats in client2.run(call).stats]
    reports = client2.ping()
    assert [r["held_bytes"] for r in reports] == [n + expected for n in resident]
    assert [r["stale_kv_bytes"] for r in reports] == [expected, expected]
    client2.run(dataclasses.replace(call, call_step=1, call_last=True))
    assert [r["held_bytes"] for r in client2.ping()] == resident
