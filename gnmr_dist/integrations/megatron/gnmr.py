"""GNMR inside megatron-core: per-unit norms in the clip-norm all-reduce, plan applied per step.

``apply(model, block, optimizer=...)`` wires a GNMR runtime into a megatron-core training run.

**What the per-unit norms are made of.** megatron's clip norm reads one list of gradients,
``optimizer.<grads_for_norm>()`` (the name is in :mod:`megatron_patches.versions`): the
``.grad`` of every *main* parameter the optimizer steps, filtered for shared parameters and
tensor-parallel duplicates. Which tensors those are depends on the setting:

=========================================  =================================================
setting                                    the gradient megatron norms, per main parameter
=========================================  =================================================
fp32, plain optimizer                      the model parameter's ``main_grad`` buffer view
bf16/fp16 (Float16 optimizer)              ``model_param.main_grad.float()``: a fresh copy
distributed optimizer                      ``main_grad.view(-1)[start:end].float()``: this
                                           DP rank's contiguous (possibly empty) slice
=========================================  =================================================

So a gradient is attributed by *what it is*, never by the identity of a model tensor: each main
parameter is mapped once, through the optimizer's own parallel lists (``float16_groups`` <->
``fp32_from_float16_groups``, ``model_float16_groups`` <-> ``shard_fp32_from_float16_groups``,
...; chained optimizers recursively), to the model parameter it stands for and so to its unit;
at each norm call the list megatron hands over is matched to the main parameters whose
``.grad`` it holds. A shard of a parameter lies inside that parameter's unit, and squared norms
add over any partition, so summing the shards' squares over the grad-stats group gives each
unit's exact squared norm.

**No extra collective, one read.** ``get_grad_norm_fp32`` is replaced in the modules that call
it (version table). Inside an optimizer step it computes megatron's l2 norm with the same
multi-tensor kernel, asking it for the per-tensor norms of the same launch (one read of each
gradient), adds their squares per unit slot, and all-reduces ``[megatron's squared total,
units, rest, unattributed]`` (U + 3 float32 numbers) in the one all-reduce megatron makes, over
the grad-stats group megatron passes (model-parallel group, or the whole distributed-optimizer
group). megatron gets back the total it would have computed, as a float (0.16) or as a device
tensor (0.17+, when TE's tensor-scale kernel exists: no host sync). Its entry comes first
because a reduction's order per element depends on where the element sits in the vector: gloo
sums element 0 of any vector in the order it sums megatron's own one-element vector, so there
the total is bitwise megatron's (docs/megatron.md, "Observe mode: what stays equal"). The
host needs the vector to decide; it is copied asynchronously and the decision is taken when the
next step first needs the plan. With ``fused_norm=False`` the same sums ride a separate
all-reduce of GNMR's own. When megatron computes no norm in a step (``clip_grad == 0`` with a
plain optimizer), the same gradients are read at the start of ``step_with_ready_grads``
(prepared, unscaled, not clipped) with one all-reduce of GNMR's own.

**The error term (docs/algorithm.md#damage-term, ``gnmr.gamma``).** The backend's per-unit error
sums ``B(u)`` (linear in the output gradients: divided by megatron's loss scale, times DDP's
``1/dp``) ride the first clip-norm all-reduce of the step as U more numbers. That group spans the
data-parallel ranks only with the distributed optimizer; with the plain optimizer the DP
partials are summed first, in one extra all-reduce of U values over DP (the one collective the
term adds there). The controller receives ``e = B / G`` (``G``: the global gradient norm).

**The guard.** A mapping that misses leaves the units at zero and the rest slot holding the
whole gradient: the controller would score 1.0 forever and never act. Every step, after the
reduction, an unattributed gradient, units at zero under a positive total, or a rest share above
``gnmr.attribution.max_rest_share`` stops the run with the cause named (or warns once).

**Per-layer precision.** ``get_fp8_context`` and ``get_fp4_context`` as imported by
``TransformerBlock`` (and by 0.19's ``megatron.core.recompute``, full recomputation) are replaced:
a layer unit on the recovery path gets the backend's recovery region (``te_fp8``: FP8/FP4 off or
a stronger FP8 recipe) instead of megatron's per-layer FP8 or FP4 context (its
``--first-last-layers-bf16`` layers included), by global layer number. Operator units are
switched by the backend on the operators themselves (``te_quant_params``).

**FP4.** megatron's ``--fp4-format`` runs TE's NVFP4 recipe, which needs FP4 GEMMs (compute
capability 10.0+). :func:`apply` refuses a model whose config asks for FP4 on any other device,
naming it: on a CPU megatron's ``get_fp4_context`` silently returns a null context without TE,
and on Hopper TE fails inside its autocast after switching its global state on.

**Layouts.** Several model chunks per rank (virtual pipeline) form one registry: megatron's
layers carry their global ``layer_number``, so unit names do not depend on the layout. Sequence
parallelism needs nothing here: norm weights are summed over TP by ``finalize_model_grads``
before the optimizer step and megatron's filter counts them on TP rank 0 only.

**State.** :meth:`MegatronGNMR.state_dict` is a plain dict to store as a common (non-sharded)
entry of a megatron checkpoint, identical on every rank; :meth:`load_state_dict` restores it.
With megatron's rerun state machine, ``install_rerun_hooks`` snapshots the plan at the start
of each iteration so a rerun replays the same plan.
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

__all__ = [
    "MegatronGNMR",
    "apply",
    "current",
    "leaf_optimizers",
    "megatron_series",
    "remove",
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
    """The runtime installed by :func:`apply` (None when not applied)."""
    return _CURRENT[0] if _CURRENT else None


def apply(
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
    refuse_probe(parsed, "megatron_patches.apply")
    chunks = list(model) if isinstance(model, Sequence) else [model]
    handle = current()
    if handle is not None and [id(c) for c in handle.model] == [id(c) for c in chunks]:
        return handle
    info = series_info(what="megatron_patches.apply")
    _refuse_unsupported(chunks, parsed, optimizer)
    remove()
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
                f"megatron_patches.apply: backend {block.backend!r} runs megatron's linears "
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
                "megatron_patches.apply: Megatron-FSDP (use_megatron_fsdp) hands the clip norm "
                "DTensor shards GNMR cannot attribute yet; use the distributed optimizer "
                "(use_distributed_optimizer=True) instead"
            )


def _install(handle: MegatronGNMR, optimizer: Any, info: SeriesInfo) -> None:
    for home in info.norm_call_sites:
        try:
            module = importlib.import_module(home)
        except ImportError:  # an optional optimizer module whose extra deps are absent
            continue
        original = module.get_grad_norm_fp32
        _PATCHES.set(module, "get_grad_norm_fp32", _fused_grad_norm(original))
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
    _CURRENT.append(handle)


def remove() -> None:
    """Undo :func:`apply`: original functions back, backend unwrapped (no-op if not applied)."""
    _PATCHES.restore()
    while _CURRENT:
        handle = _CURRENT.pop()
        if handle.backend is not None:
            handle.backend.before_forward = None
            handle.backend.unwrap()
