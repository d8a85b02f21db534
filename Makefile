# Two commands for a newcomer: `make demo` and `make test`. Everything is installed into .venv.
# uv installs torch, pinned, with the rest; it is handed pip's local wheel folders (find-links), so a CPU machine
# takes the CPU build from local disk instead of pulling a multi-GB CUDA build. pip is the fallback
# (see docs/decisions.md#set-up-installs-with-uv).
# Override on a GPU box: `make setup TORCH_SPEC='torch==2.13.0' EXTRAS=dev,gpu FIND_LINKS=`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
PYTEST_ARGS ?=
# `make test` runs the tests that time nothing and start no cluster (core's policy, the simulator, the tasks,
# the engines) on TEST_JOBS processes, then the rest one at a time (docs/decisions.md, "The default suite
# runs its clock-free tests on both cores")
TEST_JOBS ?= 2
PARALLEL_TESTS := tests/core tests/sim tests/tasks tests/engines
# pip's configured local wheel folders, for uv, which does not read pip's configuration (asked only when installing)
FIND_LINKS = $(foreach d,$(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u),--find-links $(d))

# apt-get as root (CI, containers); `make browser-test APT='sudo apt-get'` elsewhere
APT ?= apt-get

.PHONY: setup test test-all lint demo bench clean browser-setup browser-test dashboard-screenshot

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	-$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -q $(FIND_LINKS) "$(TORCH_SPEC)" -e ".[$(EXTRAS)]" \
		|| ($(PY) -m pip install -q "$(TORCH_SPEC)" && $(PY) -m pip install -q -e ".[$(EXTRAS)]")
	@touch $@

# With PYTEST_ARGS (a file, a -k), one run as given, one test at a time.
test: setup
	$(PY) -m ruff check .
ifeq ($(strip $(PYTEST_ARGS)),)
	@status=0; \
	$(PY) -m pytest -q -m "not slow" -n $(TEST_JOBS) $(PARALLEL_TESTS) || status=$$?; \
	$(PY) -m pytest -q -m "not slow" $(addprefix --ignore=,$(PARALLEL_TESTS)) || status=$$?; \
	exit $$status
else
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)
endif

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

# The /pivotrl dashboard page in headless Chromium (Debian's package; Playwright from the `browser` extra).
browser-setup: setup
	@command -v chromium >/dev/null || ($(APT) update && $(APT) install -y chromium)
	$(PY) -m pip install -q -e ".[$(EXTRAS),browser]"

browser-test: browser-setup
	$(PY) -m pytest -q -m slow tests/runtime/test_dashboard_browser.py $(PYTEST_ARGS)

# docs/dashboard.png, the README's screenshot: the same test on the quickstart (bootstrap cached in storage/)
dashboard-screenshot: browser-setup
	PIVOTRL_DASHBOARD_CONFIG=configs/quickstart.yaml PIVOTRL_DASHBOARD_SCREENSHOT=docs/dashboard.png \
		$(PY) -m pytest -q -m slow tests/runtime/test_dashboard_browser.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
