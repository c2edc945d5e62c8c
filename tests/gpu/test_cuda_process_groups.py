"""One NCCL rank's process groups as a worker builds them (the default group bound to the GPU with the configured
timeout, every other group through a GroupPool), running each collective comm.py issues with the strategies'
dtypes: uint8 weight bytes gathered into one tensor, all-to-alls with explicit (uneven-capable) splits, Ring's
batch_isend_irecv to itself. Every group must run under the configured timeout, not NCCL's 10 minutes. The gloo
twin runs in the CPU suite (tests/test_one_rank_groups.py)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from one_rank_groups import run_one_rank

pytestmark = pytest.mark.timeout(180)

CONFIGURED = timedelta(seconds=271)  # neither NCCL's 600 s nor gloo's 1800 s, so a group that fell back shows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_one_nccl_rank_runs_every_collective_under_the_configured_timeout(gpu, dtype):
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL (Windows): the runtime's multi-GPU path does not use it there")
    found = run_one_rank("nccl", torch.device(gpu), CONFIGURED, dtype)
    print(f"\n{dtype}: {found}")
    assert not dist.is_initialized()
    assert len(found["timeouts"]) == 5 and set(found["timeouts"].values()) == {CONFIGURED}, found["timeouts"]
    assert len(found["checked"]) == 12, found["checked"]  # the gloo run's 10 and Ring's and PipeFusion's self-sends
