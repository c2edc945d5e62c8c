"""Every process group a worker builds bounds its collectives by the configured timeout, not the backend's default.

new_group does not inherit the default group's timeout: without one it falls back to the backend's own (gloo 30 min,
NCCL 10 min), so a collective on a strategy's group would outlive WatchdogConfig.collective_timeout_s, the
backstop the README promises. Two real gloo ranks build the groups as a worker does (WorkerState.comm_for over
the strategies that need every kind of group) and report each group's timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CONFIGURED_S = 271.0  # no backend's default (gloo 1800 s, NCCL 600 s), so a group that fell back to one shows

RANK = r"""
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from parallel_runtime.distributed.comm import group_timeout
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.runtime.worker import WorkerState

rank, store_path, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
torch.set_num_threads(1)
timeout = timedelta(seconds=seconds)
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timeout)
state = WorkerState(rank, 2, torch.device("cpu"), timeout)
# PipeFusion: the data group, both link directions and the control group; sharded Ulysses: the weights group.
for topology in (Topology(pipefusion=2), Topology(ulysses=2, shard_weights=True)):
    state.comm_for(topology)
groups = {"default": dist.group.WORLD, **{repr(key): pg for key, pg in state.groups._groups.items()}}
print(json.dumps({name: group_timeout(pg).total_seconds() for name, pg in groups.items()}))
dist.destroy_process_group()
"""


def test_every_group_of_a_worker_times_out_as_configured(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(tmp_path / "store"), str(CONFIGURED_S)],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # default, data (0, 1), control, both links, weights (0, 1): every kind the pool makes.
    assert reports[0].keys() == reports[1].keys() and len(reports[0]) == 6, reports
    assert all(seconds == CONFIGURED_S for report in reports for seconds in report.values()), reports
