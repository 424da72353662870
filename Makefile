# megatron_dapo make targets. `make install && make train` and `make test` are the two set-up
# commands of the README; everything runs from the repo's own files.
SHELL := /bin/bash
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
CONFIG ?= configs/tiny_cpu.yaml
export PYTHONHASHSEED := 0

.PHONY: install train test test-all lint bench clean

# torch==2.13.0 first: on the CPU machines it is a CPU build on local disk (an unpinned torch
# would pull a multi-GB CUDA build). A stamp file keeps a re-run to a quick up-to-date check.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH (set PY=...)"; exit 2; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

train: install
	$(BIN)/python -m megatron_dapo.train --config $(CONFIG) $(ARGS)

# The default suite: everything but the `slow` and `gpu` markers; well under 30 min on 2 cores.
test: install
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(ARGS)

test-all: install
	$(BIN)/python -m pytest -q -m "not gpu" $(ARGS)

lint: install
	$(BIN)/ruff check megatron_dapo kernels tests benchmarks
	$(BIN)/python tools/check_line_counts.py

bench: install
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
