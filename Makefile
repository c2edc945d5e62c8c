# Two entry points, each doing all set-up on a fresh machine (a virtualenv in .venv):
#   make demo   - the main job on an embedded tiny Flux model with CPU workers
#   make test   - the test suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

$(VENV)/.ready: requirements.txt constraints.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt torch==2.13.0
	$(VPY) -m pip install -q -c constraints.txt -r requirements.txt pytest pytest-timeout
	touch $@

venv: $(VENV)/.ready

demo: $(VENV)/.ready
	$(VPY) -m parallel_runtime demo

bench: $(VENV)/.ready
	$(VPY) -m parallel_runtime bench

test: $(VENV)/.ready
	$(VPY) -m pytest -q tests

.PHONY: venv demo bench test
