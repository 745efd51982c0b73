# Two commands on a fresh machine: `make run` (the whole lifecycle on configs/tiny.yaml) and `make test`.
# Both create .venv on first use and reinstall only when pyproject.toml changes.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/tiny.yaml
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); modules stay whole (tests/fixtures/scheduling.py)
TEST_WORKERS ?= 2

.PHONY: run test install install-test bench clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first and pinned: here that takes the CPU build on disk; a bare `torch` pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(BIN)/eightfold run $(CONFIG) $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(BIN)/eightfold bench run all

clean:
	rm -rf .eightfold .pytest_cache
