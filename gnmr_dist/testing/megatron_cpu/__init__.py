"""
megatron-core assumes a GPU. On a host without CUDA the code paths that tests need (building a
``GPTModel`` from the local layer spec, tensor, sequence, pipeline and interleaved (virtual)
pipeline parallelism over gloo, the ``get_forward_backward_func()`` schedules, megatron's
``DistributedDataParallel`` with fp32 or bf16 grad buffers, ``get_megatron_optimizer`` with the
plain, the bf16 (``Float16OptimizerWithFloat16Params``) and the distributed optimizer, and the
fp32 grad-norm / clipping helpers) fail on a handful of hard-wired CUDA calls. This module
redirects exactly those, reversibly, and refuses to do anything when CUDA is available: it is
never active on a GPU.

Checked against megatron-core 0.16.1, 0.17.1 and 0.19.2 (the version table,
:data:`gnmr_dist.integrations.megatron.versions.SERIES`; ``SUPPORTED_MEGATRON_VERSIONS`` is its
keys). The stand-ins are split by what they stand in for, each module listing its patches and
the reason for each:

* :mod:`~gnmr_dist.testing.megatron_cpu.device`: ``torch.cuda``'s device, synchronize and
  stream; the name ``torch`` inside four megatron modules; ``Tensor.cuda`` around the tied
  embedding set-up.
* :mod:`~gnmr_dist.testing.megatron_cpu.rng`: the CUDA RNG and its tracker.
* :mod:`~gnmr_dist.testing.megatron_cpu.optimizer`: the grad-norm / clipping kernels, the
  optimizers' CUDA type checks, the distributed optimizer's checkpoint state.
* :mod:`~gnmr_dist.testing.megatron_cpu.norm`: the torch norm under sequence parallelism.
* :mod:`~gnmr_dist.testing.megatron_cpu.training`: Megatron-LM's own loop
  (``megatron.training``).
* :mod:`~gnmr_dist.testing.megatron_cpu.writer`: the async checkpoint writer's own process
  (the one patch here, its target, carries the stand-ins into it).
* :mod:`~gnmr_dist.testing.megatron_cpu.config`: :func:`cpu_transformer_config`.

What is not patched (so unverified on CPU): docs/megatron.md, "CPU compatibility". The
patches are process-wide while enabled (module attributes, not thread- or scope-local).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gnmr_dist.integrations.megatron.versions import (
    SERIES,
    SeriesInfo,
    installed_version,
    series_of,
)
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.testing.megatron_cpu.config import cpu_transformer_config
from gnmr_dist.testing.megatron_cpu.device import (
    _cpu_current_device,
    _cpu_current_stream,
    _cpu_setup_embeddings,
    _cpu_synchronize,
    _CpuTorch,
)
from gnmr_dist.testing.megatron_cpu.norm import _cpu_torch_norm_new
from gnmr_dist.testing.megatron_cpu.optimizer import (
    _cpu_clip_grad_by_total_norm,
    _cpu_distopt_load_state_dict,
    _cpu_distopt_sharded_state_dict,
    _cpu_l2_norm,
    _cpu_multi_tensor_applier,
    _cpu_optimizer_init,
    _cpu_scale,
    _cpu_set_main_param_states,
)
from gnmr_dist.testing.megatron_cpu.rng import (
    _cpu_get_rng_state,
    _cpu_manual_seed,
    _cpu_set_rng_state,
    _cpu_tracker_add,
    _cpu_tracker_fork,
)
from gnmr_dist.testing.megatron_cpu.writer import writer_loop

__all__ = [
    "SUPPORTED_MEGATRON_VERSIONS",
    "cpu_compat",
    "cpu_transformer_config",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
]

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSIONS: tuple[str, ...] = tuple(SERIES)
"""megatron-core ``major.minor`` series whose sources these patches were checked against: the
keys of the version table (0.16.1, 0.17.1, 0.19.2; 0.18 was not checked)."""

_LOCK = threading.Lock()
_APPLIED = Patches("cpu compat")
_TRAINING_ON: list[bool] = []
"""Non-empty while :mod:`gnmr_dist.testing.megatron_cpu.training`'s patches are on."""


# --------------------------------------------------------------------------- patch plan


def _checked_series(version: str) -> SeriesInfo:
    """The version table's row of ``version``'s series; raises unless the table lists it."""
    series = series_of(version)
    info = SERIES.get(series)
    if info is None:
        raise RuntimeError(
            f"megatron_patches.cpu was checked against megatron-core "
            f"{', '.join(v + '.x' for v in SERIES)}; found {version}. "
            f"Verify the patched call sites against its sources, then add a {series!r} row to "
            f"gnmr_dist.integrations.megatron.versions.SERIES."
        )
    return info


def _wrapping(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> tuple[Any, str, Any]:
    """The plan entry that replaces ``owner.name`` by ``wrapper`` of it (a CPU twin)."""
    return owner, name, wrapper(getattr(owner, name))


def _patch_plan(version: str | None = None) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for every patch, in application order.

    ``version``: the megatron-core version the plan is for (default: the installed one); the
    patches that only some series need are chosen by it. Raises ``RuntimeError`` when a target
    no longer exists, so a renamed call site fails loudly instead of being silently added.
    """
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    version = installed_version() if version is None else version
    info = _checked_series(version)
    cpu_torch = _CpuTorch()
    seed = _cpu_manual_seed(mrandom.model_parallel_cuda_manual_seed)
    clip = _cpu_clip_grad_by_total_norm(clip_grads.clip_grad_by_total_norm_fp32)
    torch_users = (schedules, transformer_utils, clip_grads, mcore_optimizer)
    float16 = mcore_optimizer.Float16OptimizerWithFloat16Params
    plan: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        (mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add),
        (mrandom.CudaRNGStatesTracker, "fork", _cpu_tracker_fork),
        *((m, "model_parallel_cuda_manual_seed", seed) for m in (mrandom, tensor_parallel)),
        *((m, "torch", cpu_torch) for m in torch_users),
        (clip_grads, "multi_tensor_applier", _cpu_multi_tensor_applier),
        (clip_grads, "l2_norm_impl", _cpu_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", _cpu_scale),
        *((m, "clip_grad_by_total_norm_fp32", clip) for m in (clip_grads, mcore_optimizer)),
        _wrapping(LanguageModule, "setup_embeddings_and_output_layer", _cpu_setup_embeddings),
        _wrapping(float16, "__init__", _cpu_optimizer_init),
        _wrapping(DistributedOptimizer, "__init__", _cpu_optimizer_init),
        _wrapping(DistributedOptimizer, "sharded_state_dict", _cpu_distopt_sharded_state_dict),
        _wrapping(DistributedOptimizer, "load_state_dict", _cpu_distopt_load_state_dict),
        _wrapping(
            DistributedOptimizer, "_set_main_param_and_optimizer_states", _cpu_set_main_param_states
        ),
        _wrapping(WrappedTorchNorm, "__new__", _cpu_torch_norm_new),
        (PersistentAsyncCaller, "async_loop", staticmethod(writer_loop)),
    ]
    if info.grad_sync_current_stream:
        plan.append((torch.cuda, "current_stream", _cpu_current_stream))
    for owner, name, _ in plan:
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron_patches.cpu: {getattr(owner, '__name__', owner)}.{name} does not "
                f"exist in megatron-core {version}; re-check the patched call sites"
            )
    return plan


def _restore_all() -> None:
    _TRAINING_ON.clear()
    _APPLIED.restore()


# --------------------------------------------------------------------------- public API


def is_cpu_compat_enabled() -> bool:
    """Whether the CPU patches are currently applied."""
    return bool(_APPLIED)


def enable_cpu_compat(*, training: bool = False) -> None:
    """Apply the CPU patches to megatron-core (idempotent).

    ``training=True`` also applies :mod:`gnmr_dist.testing.megatron_cpu.training`, for
    Megatron-LM's own training loop (``megatron.training.pretrain``); it needs a series whose wheel
    ships ``megatron.training`` (the version table's ``has_training``: 0.17+). It may be asked for
    after the core patches are on.

    Raises:
        RuntimeError: CUDA is available (this module is never active on a GPU), the installed
            megatron-core is not in ``SUPPORTED_MEGATRON_VERSIONS``, or ``training`` is asked
            of a series without ``megatron.training``.
        ImportError: megatron-core is not installed.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_patches.cpu is never active on a GPU: torch.cuda.is_available() is True. "
            "Run megatron-core natively on CUDA instead."
        )
    with _LOCK:
        version = installed_version()
        info = _checked_series(version)
        if training and not info.has_training:
            raise RuntimeError(
                f"megatron_patches.cpu: training=True needs megatron.training, which "
                f"megatron-core {version} does not ship (0.17+ wheels do)"
            )
        plan = [] if _APPLIED else _patch_plan()
        add_training = training and not _TRAINING_ON
        if add_training:
            from gnmr_dist.testing.megatron_cpu.training import training_patch_plan

            plan += training_patch_plan()
        try:
            for owner, name, replacement in plan:
                _APPLIED.set(owner, name, replacement)
        except BaseException:
            _restore_all()
            raise
        if add_training:
            _TRAINING_ON.append(True)
        if plan:
            logger.info(
                "cpu compat enabled for megatron-core %s (%d patches)", version, len(_APPLIED)
            )


def disable_cpu_compat() -> None:
    """Restore every patched attribute to its original object (no-op when not enabled)."""
    with _LOCK:
        if _APPLIED:
            _restore_all()
            logger.info("cpu compat disabled")


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Context manager: enable the CPU patches; on exit, disable them if this call enabled them."""
    was_enabled = is_cpu_compat_enabled()
    enable_cpu_compat()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_compat()
