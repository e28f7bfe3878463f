"""GNMR inside megatron-core: per-unit norms in the clip-norm all-reduce, plan applied per step.

``enable(model, block, optimizer=...)`` wires a GNMR runtime into a megatron-core training run
and returns its handle, also a context manager (``with enable(...) as gnmr:`` undoes it at the
end of the block); ``disable()`` undoes it. ``apply`` / ``remove`` are the deprecated names of
both, for one release. docs/megatron.md ("megatron_patches.enable") has the full account.

* **Attribution.** megatron's clip norm reads the ``.grad`` of every *main* parameter the
  optimizer steps (the name of the list is in :mod:`gnmr_dist.integrations.megatron.versions`);
  each is mapped once, through the optimizer's own parallel lists, to the model parameter it
  stands for and so to its unit. A shard lies inside its parameter's unit and squared norms add
  over any partition, so summing the shards' squares over the grad-stats group is exact.
* **No extra collective, one read.** ``get_grad_norm_fp32`` is replaced where it is called: it
  computes megatron's norm with the same multi-tensor kernel, the per-tensor norms of the same
  launch, and all-reduces ``[megatron's squared total, units, rest, unattributed]`` in megatron's
  one all-reduce (total first: gloo then sums it in megatron's own order, bitwise). The decision
  is taken when the next step first needs the plan. With ``gamma`` the backend's error sums ride
  the same all-reduce (``e = B / G``).
* **The guard.** An unattributed gradient, units at zero under a positive total, or a rest share
  above ``gnmr.attribution.max_rest_share`` stops the run with the cause named (or warns once).
* **Per-layer precision.** ``get_fp8_context`` / ``get_fp4_context`` as ``TransformerBlock``
  (and 0.19's recompute) import them give a recovery layer the backend's recovery region instead
  of megatron's per-layer context; operator units are switched on the operators themselves.
* **Refused:** Megatron-FSDP, ``--fp4-format`` without FP4 GEMMs, an emulated backend with
  gradient-accumulation fusion (:func:`enable` names each).

Several model chunks per rank form one registry (global ``layer_number``); the state is a plain
common checkpoint entry; ``install_rerun_hooks`` replays a rerun's plan.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.te_runtime import check_fp4_device
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.megatron.attribution import leaf_optimizers
from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS
from gnmr_dist.integrations.megatron.session import MegatronGNMR
from gnmr_dist.integrations.megatron.versions import SeriesInfo, megatron_series, series_info
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.session import check_error_source, refuse_probe
from gnmr_dist.integrations.switch import deprecated

__all__ = [
    "MegatronGNMR",
    "current",
    "disable",
    "enable",
    "leaf_optimizers",
    "megatron_series",
]

logger = logging.getLogger(__name__)

_CURRENT: list[MegatronGNMR] = []
_PATCHES = Patches("megatron_patches")


def _fused_grad_norm(original: Any) -> Any:
    """``get_grad_norm_fp32`` that also reduces the per-unit squared norms (same all-reduce)."""

    def get_grad_norm_fp32(
        grads_for_norm: Any, norm_type: float = 2, grad_stats_parallel_group: Any = None
    ) -> Any:
        handle = current()
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else grads_for_norm
        grads = list(grads)
        dtensor = any(type(g).__name__ == "DTensor" for g in grads)
        if handle is None or not handle.collecting or float(norm_type) != 2.0 or dtensor:
            return original(grads, norm_type, grad_stats_parallel_group)
        return handle.norm_with_units(grads, grad_stats_parallel_group, original)

    return get_grad_norm_fp32


CONTEXT_FUNCTIONS = ("get_fp8_context", "get_fp4_context")
"""megatron's per-layer precision contexts (``fp8_utils`` / ``fp4_utils``, same signature)."""

CONTEXT_IMPORTERS = ("megatron.core.transformer.transformer_block", "megatron.core.recompute")
"""Modules that import them by name at module level (``recompute``: 0.19's full recompute)."""


def _plan_context(original: Any) -> Any:
    """megatron's ``get_fp8_context`` / ``get_fp4_context`` whose per-layer contexts follow the
    GNMR plan (global layer number)."""

    def get_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        context = original(config, layer_no, is_init)
        handle = current()
        if handle is None or is_init or layer_no < 0:
            return context  # build-time and outer (delayed-recipe) contexts stay megatron's
        return handle.layer_context(layer_no, context)

    get_context.__name__ = getattr(original, "__name__", "get_context")
    return get_context


def _wrap_optimizer(optimizer: Any) -> None:
    """``step`` brackets the step's norm collection; ``step_with_ready_grads`` reads the
    gradients itself when megatron computed no norm (``clip_grad == 0``)."""
    step, ready = optimizer.step, optimizer.step_with_ready_grads

    def gnmr_step(*args: Any, **kwargs: Any) -> Any:
        handle = current()
        if handle is None:
            return step(*args, **kwargs)
        handle.begin_step()
        try:
            result = step(*args, **kwargs)
        except BaseException:
            handle.collecting = False
            raise
        handle.after_step(bool(result[0]) if isinstance(result, tuple) else bool(result))
        return result

    def gnmr_step_with_ready_grads(*args: Any, **kwargs: Any) -> Any:
        handle = current()
        if handle is not None and handle.collecting and handle._sums is None:
            handle.own_norms(optimizer)
        return ready(*args, **kwargs)

    _PATCHES.set(optimizer, "step", gnmr_step)  # an instance attribute over the class method
    _PATCHES.set(optimizer, "step_with_ready_grads", gnmr_step_with_ready_grads)


def current() -> MegatronGNMR | None:
    """The runtime installed by :func:`enable` (None when not enabled)."""
    return _CURRENT[0] if _CURRENT else None


def enable(
    model: nn.Module | Sequence[nn.Module],
    block: GNMRBlock | Mapping[str, Any],
    *,
    optimizer: Any = None,
    fused_norm: bool = True,
    pg_collection: Any = None,
) -> MegatronGNMR:
    """Install GNMR on a megatron-core model (idempotent for the same model).

    Args:
        model: the model chunk(s) of this rank, as built (DDP-wrapped or not); a list of
            chunks with virtual pipeline parallelism.
        block: a :class:`gnmr_dist.integrations.config.GNMRBlock` or its dict form.
        optimizer: megatron's optimizer (``get_megatron_optimizer``'s result). Its ``step`` is
            wrapped to feed the controller, and its structures say which gradient belongs to
            which unit. Required for training; ``None`` only to inspect units and plans.
        fused_norm: carry the per-unit norms in megatron's clip-norm all-reduce; ``False`` adds
            GNMR's own small all-reduce per step (same gradients, same pre-clip values).
        pg_collection: megatron-core's ``ProcessGroupCollection`` of the model (its ``tp``,
            ``mp`` and ``dp_cp`` groups are used), as megatron-core's own modules take it;
            default: ``ProcessGroupCollection.use_mpu_process_groups()``, the groups
            ``parallel_state.initialize_model_parallel`` made.
    """
    parsed = GNMRBlock.of(block)
    refuse_probe(parsed, "megatron_patches.enable")
    chunks = list(model) if isinstance(model, Sequence) else [model]
    handle = current()
    # idempotent for the same chunks: a second enable returns the handle it made
    if handle is not None and [id(c) for c in handle.model] == [id(c) for c in chunks]:
        return handle
    info = series_info(what="megatron_patches.enable")
    # refused before anything is patched, so a refusal leaves megatron as it was
    _refuse_unsupported(chunks, parsed, optimizer)
    disable()
    backend = parsed.build_backend(MEGATRON_OPERATORS)
    check_error_source(parsed, backend)  # gnmr.gamma needs a backend that reports error sums
    groups = pg_collection if pg_collection is not None else _mpu_groups()
    handle = MegatronGNMR(
        chunks,
        parsed,
        backend,
        fused=fused_norm,
        optimizer=optimizer,
        info=info,
        pg_collection=groups,
    )
    _install(handle, optimizer, info)
    return handle


def _mpu_groups() -> Any:
    """The groups ``parallel_state`` holds, as megatron-core's ``ProcessGroupCollection``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "mp", "dp_cp"])


def _configs(chunks: Sequence[nn.Module]) -> list[Any]:
    return [c for c in (getattr(_unwrap(m), "config", None) for m in chunks) if c is not None]


def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module  # type: ignore[assignment]
    return module


def _refuse_unsupported(chunks: Sequence[nn.Module], block: GNMRBlock, optimizer: Any) -> None:
    """Settings GNMR cannot handle, refused before anything is patched."""
    emulated = block.backend not in (None, "te_fp8")
    for config in _configs(chunks):
        if getattr(config, "fp4", None):
            check_fp4_device(f"megatron-core's --fp4-format {config.fp4} (config.fp4)")
        if emulated and getattr(config, "gradient_accumulation_fusion", False):
            raise ValueError(
                f"megatron_patches.enable: backend {block.backend!r} runs megatron's linears "
                "with its own autograd, which has no fused weight-gradient accumulation: set "
                "gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion) or use "
                "backend 'te_fp8'"
            )
    for leaf in leaf_optimizers(optimizer) if optimizer is not None else ():
        ddp_config = getattr(leaf, "ddp_config", None)
        if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(
            ddp_config, "use_custom_fsdp", False
        ):
            raise ValueError(
                "megatron_patches.enable: Megatron-FSDP (use_megatron_fsdp) hands the clip norm "
                "DTensor shards GNMR cannot attribute yet; use the distributed optimizer "
                "(use_distributed_optimizer=True) instead"
            )


def _install(handle: MegatronGNMR, optimizer: Any, info: SeriesInfo) -> None:
    # replaced where each module calls it (bound by from-import), not in clip_grads alone
    for home in info.norm_call_sites:
        try:
            module = importlib.import_module(home)
        except ImportError:  # an optional optimizer module whose extra deps are absent
            continue
        original = module.get_grad_norm_fp32
        _PATCHES.set(module, "get_grad_norm_fp32", _fused_grad_norm(original))
    # the per-layer contexts are replaced where TransformerBlock imported them
    for home in CONTEXT_IMPORTERS:
        try:
            module = importlib.import_module(home)
        except ImportError:  # recompute is a module of 0.19 only
            continue
        for name in CONTEXT_FUNCTIONS:
            if hasattr(module, name):
                _PATCHES.set(module, name, _plan_context(getattr(module, name)))
    if optimizer is not None:
        _wrap_optimizer(optimizer)
    handle._disable = disable  # the with-block's exit (the handle's module cannot import this)
    _CURRENT.append(handle)


def disable() -> None:
    """Undo :func:`enable`: original functions back, backend unwrapped (no-op if not applied)."""
    _PATCHES.restore()
    while _CURRENT:
        handle = _CURRENT.pop()
        if handle.backend is not None:
            handle.backend.before_forward = None
            handle.backend.unwrap()


apply = deprecated("megatron_patches.apply", "megatron_patches.enable", enable)
remove = deprecated("megatron_patches.remove()", "megatron_patches.disable()", disable)
