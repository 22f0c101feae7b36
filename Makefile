# Two commands do all set-up on a fresh machine:
#   make run    # creates .venv, installs pdserve, runs a local cluster (1 prefill + 1 decode worker,
#               # bundled tiny model), streams a few requests through the SDK, prints TTFT/TBT, shuts down
#   make test   # creates .venv, installs pdserve + dev tools, runs the test suite
PYTHON ?= python3
VENV ?= .venv
# NOTE: pinned so a CPU machine takes the local CPU wheel and never pulls multi-GB CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
# GPU machines (`make setup-gpu`): torch's CUDA build from PyTorch's wheel index for that CUDA version
# (cu126, cu128, cu130, ...: pick the newest your NVIDIA driver supports; `nvidia-smi` shows it).
CUDA ?= cu128
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/$(CUDA)
GPU_STAMP := $(VENV)/.pdserve-gpu-installed
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup setup-gpu run test test-faults lint mutation bench-offline wheel clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# A GPU machine: the CUDA build of torch first (pip then keeps it), pdserve with the [gpu] and [bench]
# extras, and a check that torch sees a GPU. Fails loudly on a CPU-only torch instead of serving on CPU.
setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch --index-url $(TORCH_INDEX_URL)
	$(PIP) install -q -e '.[gpu,bench,dev]'
	$(VENV)/bin/python -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count()); sys.exit(0 if ok else 'torch sees no CUDA device: check the driver and CUDA=...')"
	touch $(GPU_STAMP) $(STAMP)

# A non-editable wheel (configs, dashboards and the bundled model included) in dist/.
wheel: setup
	$(PIP) wheel --no-deps --no-build-isolation -w dist .

run: setup
	$(VENV)/bin/pdserve demo

test: setup
	$(VENV)/bin/lint-imports --no-cache
	OMP_NUM_THREADS=2 $(VENV)/bin/pytest -q --durations=15

# Every fault test (kill -9, a dead thread, a stopped worker, migration, the soak, the two-host faults)
# under two busy processes at normal priority (`--loaded`, tests/conftest.py): a user's machine is rarely
# idle when a worker dies. `make test` runs the decisive ones that way too (@pytest.mark.loaded).
FAULT_TESTS := tests/e2e/test_elastic.py tests/e2e/test_control_plane.py tests/e2e/test_soak.py tests/e2e/test_replicas.py \
	tests/e2e/test_two_hosts.py tests/e2e/test_early_admission.py tests/cluster/test_router_migration.py \
	tests/e2e/test_cluster.py::test_killed_decode_worker_migrates_or_fails_only_its_requests \
	tests/e2e/test_cluster.py::test_a_dead_prefill_worker_while_the_decode_side_is_reserved_migrates_and_leaks_nothing \
	tests/e2e/test_tensor_parallel_cluster.py::test_kill_9_of_rank_1_of_the_decode_worker_fails_it_as_a_unit_and_loses_no_stream \
	tests/workers/test_tensor_parallel.py::test_a_rank_that_dies_fails_the_engine_and_close_leaves_no_process \
	tests/e2e/test_host_tier_cluster.py tests/cluster/test_failed_transfers.py tests/e2e/test_prefix_pulls.py

test-faults: setup
	OMP_NUM_THREADS=2 $(VENV)/bin/pytest -q --durations=15 --loaded $(FAULT_TESTS)

# Deliberate small bugs in the engine core, one at a time, in a throwaway copy of the tree; prints the
# mutation score and every survivor (tests/support/mutation.py lists the modules and their tests).
mutation: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m tests.support.mutation

lint: setup
	$(VENV)/bin/ruff check cluster workers transfer deploy bench tests
	$(VENV)/bin/mypy --config-file setup.cfg cluster workers transfer
	$(VENV)/bin/lint-imports --no-cache

bench-offline: setup
	$(VENV)/bin/pdserve bench offline

clean:
	rm -rf $(VENV) build *.egg-info
