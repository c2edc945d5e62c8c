# Two entry points, each doing all set-up on a fresh machine (a virtualenv in .venv):
#   make demo   - the main job on an embedded tiny Flux model with CPU workers
#   make test   - the test suite
#   make test-gpu - the checks that need a CUDA device (tests/gpu; skipped without one)
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

$(VENV)/.ready: requirements.txt constraints.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt torch==2.13.0
	$(VPY) -m pip install -q -c constraints.txt -r requirements.txt pytest pytest-timeout comfyui-workflow-templates-json
	touch $@

venv: $(VENV)/.ready

demo: $(VENV)/.ready
	$(VPY) -m parallel_runtime demo

bench: $(VENV)/.ready
	$(VPY) -m parallel_runtime bench

test: $(VENV)/.ready
	$(VPY) -m pytest -q --durations=25 tests

test-gpu: $(VENV)/.ready
	@$(VPY) -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
	$(VPY) -m pytest -q -rs tests/gpu

.PHONY: venv demo bench test test-gpu
