"""One gloo rank's process groups as a worker builds them: each collective comm.py issues runs on them with the
strategies' dtypes, and every group is bounded by the configured collective timeout. The NCCL twin, with Ring's
send-to-itself, is tests/gpu/test_cuda_process_groups.py."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from one_rank_groups import run_one_rank

pytestmark = pytest.mark.timeout(120)

CONFIGURED = timedelta(seconds=271)  # no backend's default (gloo 1800 s, NCCL 600 s), so a fallback shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_gloo_rank_runs_every_collective_under_the_configured_timeout(dtype):
    found = run_one_rank("gloo", torch.device("cpu"), CONFIGURED, dtype)
    assert not dist.is_initialized()  # nothing left behind for the next test
    assert len(found["timeouts"]) == 5 and set(found["timeouts"].values()) == {CONFIGURED}, found["timeouts"]
    assert len(found["checked"]) == 10, found["checked"]
