"""Opt-in CPU compatibility for Megatron-LM's own training loop (``megatron.training``).

megatron-core 0.17+ wheels ship ``megatron/training``: ``pretrain()``, the argument parser, the
LR schedules, checkpointing and the TensorBoard / W&B writers. On a host without CUDA that
loop stops on a few hard-wired CUDA calls outside megatron-core's model code (which the rest
of :mod:`~gnmr_dist.testing.megatron_cpu` redirects). This module redirects those, from
``enable_cpu_compat(training=True)``; like the rest it is never active when CUDA is available.

What is patched, and why (run against 0.17.1; the call sites also read in 0.19.2, whose
``megatron.training`` does not import on Python 3.11: ``megatron/training/models/hybrid.py``
imports ``typing.override``, new in 3.12, so it has not run here):

* The name ``torch`` inside every loaded ``megatron.training`` module and in
  ``megatron.core.rerun_state_machine`` (driven by the loop: it saves and restores the CUDA
  RNG around every step) -> a stand-in module that forwards every attribute to ``torch`` except
  the tensor factories (``device='cuda'`` becomes the CPU: the loop builds its loss sums, flags
  and iteration counters that way) and ``cuda``, which is :class:`_CpuCuda` (what it reports,
  and why, is in its docstring). The rest of torch, and every module outside
  ``megatron.training``, sees the real ``torch.cuda``.
* The CUDA RNG stream (:class:`~gnmr_dist.testing.megatron_cpu.rng.CudaRng`) -> its own state,
  apart from the CPU generator's, as on a GPU; ``training.train_step`` and ``training.evaluate``
  -> the originals with the CUDA stream swapped into the CPU generator for their duration (where
  dropout draws). Checkpoints then save and restore the two streams separately
  (``torch_rng_state``, ``cuda_rng_state``), and what draws from the CPU stream between a
  ``--load`` and the first step (the data loaders' base seed) no longer shifts the dropout
  masks: a resumed run with dropout on is the uninterrupted run, bit for bit.
* ``initialize._warmup_jit_function`` -> nothing: it compiles CUDA fusions that are off on CPU.
* ``torch.Tensor.cuda`` -> the identity. ``get_batch_on_this_tp_rank`` moves each batch with
  ``.cuda(non_blocking=True)``; without CUDA the original can only raise. (Not patched, so
  unverified on CPU: docs/megatron.md, "CPU compatibility".)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from gnmr_dist.testing.megatron_cpu.device import (
    _cpu_current_device,
    _cpu_synchronize,
    _CpuStream,
    _CpuTorch,
    _tensor_cuda_identity,
)
from gnmr_dist.testing.megatron_cpu.rng import (
    CUDA_RNG,
    _cpu_get_rng_state,
    _cpu_set_rng_state,
)

__all__ = ["training_patch_plan"]


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


_NO_GPU_ARCH = types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0)
"""Device properties of the CPU: no GPU architecture (compute capability 0.0). megatron reads
``major`` for performance hints and refuses GPU-only kernels (e.g. grouped GEMM) below 8."""


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as ``megatron.training`` sees it on a CPU host: its one device is the CPU.

    ``is_available()`` is True (so ``initialize_megatron``'s "Megatron requires CUDA." assertion
    passes: the loop *has* its device), ``device_count()`` is 1 (``_initialize_distributed`` then
    initialises model parallelism and ``_set_random_seed`` seeds the tensor-parallel RNG tracker,
    both skipped with no device; ``set_device`` does nothing and no ``device_id`` reaches
    ``init_process_group``), the RNG state is the CPU default generator's (the state megatron's
    checkpoints save as ``cuda_rng_state`` and restore), streams are
    :class:`~gnmr_dist.testing.megatron_cpu.device._CpuStream` (DDP is built on a side stream),
    memory queries report 0, the compute capability is 0.0 (no GPU architecture: megatron's own
    checks then refuse GPU-only kernels such as grouped GEMM) and ``empty_cache`` /
    ``synchronize`` do nothing. Any other ``torch.cuda`` attribute is the real one (it raises
    without CUDA, as it would have).
    """

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda for megatron.training on a CPU-only host")
        self.is_available = lambda: True
        self.device_count = lambda: 1
        self.current_device = _cpu_current_device
        self.set_device = _nothing
        self.synchronize = _cpu_synchronize
        self.empty_cache = _nothing
        self.get_rng_state = _cpu_get_rng_state
        self.set_rng_state = _cpu_set_rng_state
        self.Stream = lambda *args, **kwargs: _CpuStream()
        self.current_stream = lambda *args, **kwargs: _CpuStream()
        self.stream = lambda *args, **kwargs: contextlib.nullcontext()
        self.set_stream = _nothing
        self.memory_allocated = _zero
        self.max_memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_reserved = _zero
        self.memory_stats: Callable[..., dict[str, Any]] = lambda *args, **kwargs: {}
        self.get_device_capability = lambda *args, **kwargs: (0, 0)
        self.get_device_properties = lambda *args, **kwargs: _NO_GPU_ARCH

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TrainingTorch(_CpuTorch):
    """``torch`` as ``megatron.training`` sees it: ``torch.cuda`` is :class:`_CpuCuda`, and the
    tensor factories turn ``device='cuda'`` into the CPU (as :class:`_CpuTorch` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CpuCuda()


def _skip_jit_warmup() -> None:
    """CPU stand-in for ``initialize._warmup_jit_function``: it runs megatron's fused
    bias-GeLU / bias-dropout-add kernels on CUDA tensors to compile them; on CPU those fusions
    are off (``gnmr_dist.testing.megatron_cpu``'s required config), so there is nothing to warm
    up."""


_LOOP_CORE_MODULES = frozenset({"megatron.core.rerun_state_machine"})
"""megatron-core modules that only the training loop drives and that touch CUDA state: the
rerun state machine saves and restores ``torch.cuda.get_rng_state()`` around every step."""


def _training_modules() -> list[types.ModuleType]:
    """Every loaded ``megatron.training`` module that binds the name ``torch`` to torch itself.

    Read from ``sys.modules`` after importing ``megatron.training.training`` (which imports
    the loop's modules), so the list follows each release's layout (0.19 splits ``utils``
    into a package) instead of a hard-coded one.
    """
    importlib.import_module("megatron.training.training")
    return [
        module
        for name, module in sorted(sys.modules.items())
        if (name.startswith("megatron.training") or name in _LOOP_CORE_MODULES)
        and getattr(module, "torch", None) is torch
    ]


def training_patch_plan() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for the ``megatron.training`` patches.

    Importing ``megatron.training`` here is what makes the plan: 0.16 wheels have none (the
    version table's ``has_training``), and the caller refuses before this is reached. Modules
    of ``megatron.training`` imported after the patches are applied keep the real ``torch``.
    """
    shim = _TrainingTorch()
    plan: list[tuple[Any, str, Any]] = [(module, "torch", shim) for module in _training_modules()]
    initialize = importlib.import_module("megatron.training.initialize")
    training = importlib.import_module("megatron.training.training")
    plan.append((initialize, "_warmup_jit_function", _skip_jit_warmup))
    plan.append((torch.Tensor, "cuda", _tensor_cuda_identity))
    plan.append((CUDA_RNG, "separate", True))
    plan += [(training, name, _on_cuda_stream(getattr(training, name))) for name in _STEPPERS]
    return plan


_STEPPERS = ("train_step", "evaluate")
"""The loop's functions that run the model (dropout draws there)."""


def _on_cuda_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` run with the CUDA RNG stream in the CPU generator."""

    @functools.wraps(original)
    def stepped(*args: Any, **kwargs: Any) -> Any:
        with CUDA_RNG.swapped_in():
            return original(*args, **kwargs)

    return stepped
