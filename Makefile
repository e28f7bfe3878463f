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

# megatron-core: the venv holds 0.17.1, the image's release, which ships Megatron-LM's
# megatron.training (so gnmr-megatron-pretrain runs from this venv). 0.17+ declare Requires-Python
# >= 3.12 but ship cp311 wheels whose only hard dependencies (torch, numpy, packaging) are in the
# venv, hence --no-deps --ignore-requires-python.
# Extra releases the CPU tests also run on (tests/integrations/megatron/settings.py), each in its own --target
# folder that a test worker puts first on sys.path. 0.19.2 imports triton when megatron.core is
# imported (pipeline_parallel.schedules -> transformer.moe.paged_stash -> moe.ops.paged_stash,
# unguarded); 3.7.1 is the triton that torch 2.13's CUDA wheel pins, and it imports without a GPU.
MCORE_MAIN   := 0.17.1
MCORE_EXTRA  := 0.16.1 0.19.2
MCORE_DIR    := $(VENV)/mcore
MCORE_STAMPS := $(MCORE_EXTRA:%=$(MCORE_DIR)/%/.installed)
MCORE_EXTRA_PKGS_0.19.2 := triton==3.7.1

# torchtitan 0.3 (not a dependency: tests/integrations/test_torchtitan.py runs the GNMR converter
# against its real classes) in its own --target folder, which that test module appends to
# sys.path; its models import triton, the 3.7.1 that torch 2.13's CUDA wheel pins (it imports
# without a GPU; pip's cache already holds it for megatron-core 0.19.2).
TITAN_DIR  := $(VENV)/torchtitan
TITAN_PKGS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
	torchdata==0.11.0 torch_checkpointing==0.1.1 triton==3.7.1

.PHONY: venv mcore-versions torchtitan lint format typecheck test demo bench clean gpu-carry

venv: $(STAMP)

mcore-versions: $(MCORE_STAMPS)

torchtitan: $(TITAN_DIR)/.installed

$(TITAN_DIR)/.installed: $(STAMP) Makefile
	rm -rf $(TITAN_DIR)
	$(PIP) install --quiet --no-deps --target $(TITAN_DIR) $(TITAN_PKGS)
	touch $@

$(STAMP): setup.py pyproject.toml requirements/cpu.txt requirements/constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel "setuptools>=64"
	# torch first and pinned: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-build-isolation -r requirements/cpu.txt -c requirements/constraints-cpu.txt
	$(PIP) install --quiet --no-deps --ignore-requires-python megatron-core==$(MCORE_MAIN)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

$(MCORE_DIR)/%/.installed: $(STAMP)
	rm -rf $(MCORE_DIR)/$*
	$(PIP) install --quiet --no-deps --ignore-requires-python --target $(MCORE_DIR)/$* \
		megatron-core==$* $(MCORE_EXTRA_PKGS_$*)
	touch $@

# What a GPU run of benchmarks/gpu/torchao_check.py carries beside the checkout (the ignored
# folder build/gpu, 3.4 MB): torchao's wheel, the pinned one, installed there with --target.
gpu-carry: venv
	$(PIP) download --quiet --no-deps torchao==0.18.0 -d build/gpu
	$(PIP) download --quiet --no-deps -d build/gpu torchtitan==0.3.0 spmd_types==0.2.3 \
		tyro==1.0.17 docstring-parser==0.18.0 torchdata==0.11.0 torch_checkpointing==0.1.1

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Tests marked `isa` (figures from torch's bf16 GEMM kernels) run a second time with oneDNN and
# MKL held to a lower instruction set: AVX2 where the CPU has AVX-512 (with or without bf16 and
# AMX), SSE4.1 where it has only AVX2. A test that holds on one kind of CPU only fails here.
ISA_LOWER := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo AVX2 || echo SSE41)
MKL_LOWER := $(if $(filter AVX2,$(ISA_LOWER)),AVX2,SSE4_2)

test: lint typecheck mcore-versions torchtitan
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	ONEDNN_MAX_CPU_ISA=$(ISA_LOWER) MKL_ENABLE_INSTRUCTIONS=$(MKL_LOWER) \
		$(BIN)/python -m pytest $(PYTEST_ARGS) -m isa --durations=5 || test $$? -eq 5

demo: venv
	rm -rf runs/demo
	$(BIN)/torchrun --standalone --nproc_per_node 2 \
		-m gnmr_dist.cli.ds_pretrain --config configs/demo_deepspeed.hjson --run-dir runs/demo --title "make demo"

bench: venv
	$(BIN)/python -m benchmarks.overhead.controller

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
