# Two commands do all set-up on a fresh machine:
#   make run    # creates .venv, installs pdserve, runs a local cluster (1 prefill + 1 decode worker,
#               # bundled tiny model), streams a few requests through the SDK, prints TTFT/TBT, shuts down
#   make test   # creates .venv, installs pdserve + dev tools, runs the test suite
PYTHON ?= python3
VENV ?= .venv
# NOTE: pinned so a CPU machine takes the local CPU wheel and never pulls multi-GB CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup run test lint mutation bench-offline clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/pdserve demo

test: setup
	OMP_NUM_THREADS=2 $(VENV)/bin/pytest -q --durations=15

# Deliberate small bugs in the engine core, one at a time, in a throwaway copy of the tree; prints the
# mutation score and every survivor (tests/mutation.py lists the modules and their tests).
mutation: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m tests.mutation

lint: setup
	$(VENV)/bin/ruff check cluster workers transfer deploy bench tests
	$(VENV)/bin/mypy --config-file setup.cfg cluster workers transfer

bench-offline: setup
	$(VENV)/bin/pdserve bench offline

clean:
	rm -rf $(VENV) build *.egg-info
