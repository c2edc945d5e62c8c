"""PARADIT_PROFILE_DIR: each worker writes its ops' CPU times per job (torch.profiler's table) into that folder, so a
strategy's time can be broken down on the workers themselves; without it nothing is written."""
from __future__ import annotations

import os

import pytest

from conftest import make_job
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.runtime.worker import PROFILE_ENV

pytestmark = pytest.mark.timeout(180)


def test_each_rank_writes_its_job_profile(tiny_path, tmp_path, monkeypatch):
    from parallel_runtime.spec import StrategySpec

    folder = tmp_path / "profile"
    monkeypatch.setenv(PROFILE_ENV, str(folder))  # the workers inherit it when they start
    client = RuntimeClient("cpu:2", threads_per_worker=1)
    try:
        client.run(make_job(tiny_path, strategy=StrategySpec(ulysses_degree=2)))
    finally:
        client.shutdown()
    tables = sorted(os.listdir(folder))
    assert [name.split("-")[0] for name in tables] == ["rank0", "rank1"] and all(n.endswith("-1.txt") for n in tables)
    for name in tables:
        text = (folder / name).read_text()
        assert "Self CPU time total" in text and "attention" in text  # the blocks' own ops, timed one by one
