# gnmr-dist developer commands. `make test` and `make demo` bootstrap .venv from a bare machine
# (Python >= 3.10 with venv) and are idempotent: the venv is rebuilt only when a pin changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip
PYTEST_ARGS ?=

# Compiled DeepSpeed ops (CPU shared-memory comm) are cached here between runs.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export DS_BUILD_OPS := 0

.PHONY: venv lint format typecheck test demo bench clean

venv: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements/cpu.txt requirements/constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel "setuptools>=64"
	# torch first and pinned: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-build-isolation -r requirements/cpu.txt -c requirements/constraints-cpu.txt
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: venv
	rm -rf runs/demo
	$(BIN)/torchrun --nproc_per_node 2 --master_port $${MASTER_PORT:-29531} \
		-m gnmr_dist.cli.ds_pretrain --config configs/demo_deepspeed.hjson --run-dir runs/demo --title "make demo"

bench: venv
	$(BIN)/python -m benchmarks.controller

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
