"""tests/gpu: the checks that need a CUDA device (`make test-gpu`).

Without one, each test module here is collected as a single skipped item, without being imported: nothing
touches CUDA and nothing heavy loads, so `make test` on a CPU machine passes over the folder in milliseconds
(and `make test-gpu` there reports the skips and succeeds). The folder is a package (`__init__.py`) so that
this conftest does not shadow tests/conftest.py, whose helpers the tests import.
"""
from __future__ import annotations

import pytest
import torch

REASON = "needs a CUDA device; run `make test-gpu` on a GPU machine"


class _NeedsCuda(pytest.Item):
    def runtest(self):  # never reached: the skip marker stops it at setup
        pytest.skip(REASON)

    def reportinfo(self):
        return self.path, 0, self.name


class _SkippedModule(pytest.Module):
    def collect(self):
        item = _NeedsCuda.from_parent(self, name="needs_cuda")
        item.add_marker(pytest.mark.skip(reason=REASON))
        return [item]


def pytest_pycollect_makemodule(module_path, parent):
    if not torch.cuda.is_available():
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="session")
def gpu() -> str:
    return "cuda:0"
