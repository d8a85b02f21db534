# Two commands for a newcomer: `make demo` and `make test`. Everything is installed into .venv.
# torch is installed first and pinned, so that a CPU machine takes the CPU build from local disk instead of
# pulling a multi-GB CUDA build. Override on a GPU box: `make setup TORCH_SPEC='torch==2.13.0' EXTRAS=dev,gpu`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
PYTEST_ARGS ?=

.PHONY: setup test test-all lint demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

demo: setup
	$(VENV)/bin/pivotrl-pipeline submit configs/quickstart.yaml

bench: setup
	$(PY) -m benchmarks.generation --quick --json storage/bench/generation.json
	$(PY) -m benchmarks.gps --quick --json storage/bench/gps.json
	$(PY) -m benchmarks.planner --quick --json storage/bench/planner.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
