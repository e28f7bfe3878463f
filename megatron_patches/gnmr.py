"""GNMR inside megatron-core: per-unit norms in the clip-norm all-reduce, plan applied per step.

``apply(model, block, optimizer=...)`` wires a GNMR runtime into a megatron-core training run:

* **No extra collective.** megatron-core already all-reduces one number per step, the squared
  gradient norm, over the grad-stats group (``optimizer.get_grad_norm_fp32``, model-parallel
  group for the plain optimizer), after ``finalize_model_grads`` has reduced the gradients over
  data parallel and with its own filters for shared and tensor-parallel duplicate parameters. The
  patched function computes, from the very same ``grads_for_norm``, the squared norm of each
  unit's local shards and puts megatron's own squared total in the last slot: the all-reduce
  carries U + 2 numbers (units, rest, total) instead of 1, and megatron receives the same total
  norm it would have computed (same fp32 arithmetic for that slot).
* **Per-layer precision.** ``get_fp8_context`` as imported by ``TransformerBlock`` is replaced:
  a layer unit on the recovery path gets the backend's recovery region (``te_fp8``: FP8 off or a
  stronger recipe) instead of megatron's per-layer FP8 context, by global layer number. megatron
  calls it per layer only for non-delayed recipes; with delayed scaling it enters one outer
  region, and the ``te_fp8`` backend's per-module inner regions carry the plan (the design
  megatron's "first/last layers in BF16" cannot use with delayed scaling). Without
  ``config.fp8`` (CPU, emulated backends) megatron enters no context and the backend's
  switched operators carry the plan.
* **The plan.** ``optimizer.step`` is wrapped: after megatron's step, if the update was applied,
  the controller scores the norms captured in that all-reduce and the backend runs the new plan
  from the next step (every micro-batch, pipeline stage and recomputation of it).
* **State.** :meth:`MegatronGNMR.state_dict` is a plain dict to store as a common (non-sharded)
  entry of a megatron checkpoint, identical on every rank; :meth:`load_state_dict` restores it.
  With megatron's rerun state machine, ``install_rerun_hooks`` snapshots the plan at the start
  of each iteration so a rerun replays the same plan.

Version gate: the fused norm relies on megatron-core 0.16's ``get_grad_norm_fp32`` and
``get_main_grads_for_grad_norm`` (renamed in 0.19, tensor return in 0.17+). On other versions
``apply`` refuses with the version it found, unless ``fused_norm=False``, which computes the
per-unit norms with GNMR's own single all-reduce instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.integrations.session import IntegrationSession

__all__ = [
    "FUSED_NORM_VERSIONS", "MegatronGNMR", "apply", "current", "megatron_series", "remove",
]  # fmt: skip

logger = logging.getLogger(__name__)

FUSED_NORM_VERSIONS: tuple[str, ...] = ("0.16",)
"""megatron-core ``major.minor`` series whose clip-norm path the fused patch was checked on."""

_CURRENT: list[MegatronGNMR] = []
_LAYER_NAME = re.compile(r"\blayers\.(\d+)$")
_ORIGINALS: dict[str, Any] = {}


def megatron_series() -> str:
    """The installed megatron-core's ``major.minor`` (what the version gates compare)."""
    from megatron.core import package_info

    return ".".join(str(package_info.__version__).split(".")[:2])


class MegatronGNMR(IntegrationSession):
    """The GNMR runtime of one megatron-core model (``megatron_patches.current()``)."""

    def __init__(self, model: Sequence[nn.Module], block: Any, backend: Any, fused: bool) -> None:
        from megatron.core import parallel_state as ps

        from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

        self.model, self.block, self.backend, self.fused = list(model), block, backend, fused
        self.registry = UnitRegistry.from_model(
            self.model[0], granularity=block.units, include=block.include,
            exclude=block.exclude, group=dist.group.WORLD,
            tp_group=ps.get_tensor_model_parallel_group(),
            eligible_fn=backend.is_eligible if backend is not None else None,
        )  # fmt: skip
        if backend is not None:
            backend.wrap(self.registry.local_modules)
        self.runtime = GNMRRuntime(
            self.registry, block.policy, group=ps.get_model_parallel_group(),
            check_group=dist.group.WORLD, check_consistency=block.check_consistency,
        )  # fmt: skip
        self._slot_of_grad: dict[int, int] = {}
        self.pending: Any = None
        self.skipped = 0
        self._apply_plan()

    # ------------------------------------------------------------------ the fused norm

    def slot_of(self, grad: torch.Tensor) -> int:
        """The unit slot of one of megatron's ``grads_for_norm`` (the rest slot if unknown)."""
        if not self._slot_of_grad:
            self._slot_of_grad = self._grad_slots()
        return self._slot_of_grad.get(id(grad), self.registry.num_units)

    def _grad_slots(self) -> dict[int, int]:
        from gnmr_dist.distributed.monitor import default_grad

        slots = {}
        for p, slot in zip(self.registry.params, self.registry.param_slots.tolist(), strict=True):
            grad = default_grad(p)
            if grad is not None:
                slots[id(grad)] = slot
        return slots

    # ------------------------------------------------------------------ per-layer precision

    def layer_context(self, layer_no: int, default: Any) -> Any:
        """The precision context of global layer ``layer_no`` (0-based) under the plan.

        A layer unit on the recovery path gets the backend's recovery region (``te_fp8``: FP8
        off, or its stronger recipe) in place of megatron's per-layer FP8 context; every other
        layer keeps megatron's. Operator-granularity plans are applied by the backend on the
        operators themselves, so they leave the layer context alone.
        """
        uid = self._layer_units().get(layer_no)
        region = getattr(self.backend, "recovery_region", None)
        if uid is None or region is None or uid not in self.runtime.plan.active:
            return default
        return region()

    def _layer_units(self) -> dict[int, int]:
        if not hasattr(self, "_layers"):
            self._layers = {
                int(m.group(1)): uid
                for uid, name in enumerate(self.registry.names)
                if (m := _LAYER_NAME.search(name)) is not None
            }
        return self._layers

    # ------------------------------------------------------------------ per step

    def after_step(self, update_successful: bool) -> None:
        """Score the step's norms (from the clip all-reduce) and plan the next step."""
        norms, self.pending = self.pending, None
        if not update_successful:
            self.skipped += 1
            logger.warning("gnmr: megatron skipped the update; controller history untouched")
            return
        if norms is None:  # no clip-norm this step (or not fused): one all-reduce of our own
            norms = self.runtime.monitor.compute()
        self.runtime.observe(norms)
        self._apply_plan()

    def install_rerun_hooks(self) -> None:
        """Chain onto megatron's rerun state machine: a rerun replays the same plan."""
        from megatron.core import rerun_state_machine as rsm_module

        rsm = rsm_module.get_rerun_state_machine()
        save, restore = rsm.state_save_func, rsm.state_restore_func

        def state_save() -> Any:
            other = save() if save is not None else None
            if self.backend is None:
                return {"gnmr": None, "other": other}
            ran = self.backend.report()  # the plan this iteration runs with
            return {"gnmr": (sorted(ran.planned), ran.step), "other": other}

        def state_restore(state: Any) -> None:
            if self.backend is not None and state.get("gnmr") is not None:
                active, step = state["gnmr"]
                self.backend.apply(active, step)
            if restore is not None and state.get("other") is not None:
                restore(state["other"])

        rsm.state_save_func, rsm.state_restore_func = state_save, state_restore


def _fused_grad_norm(original: Any) -> Any:
    """``get_grad_norm_fp32`` that also reduces the per-unit squared norms (same all-reduce)."""

    def get_grad_norm_fp32(
        grads_for_norm: Any, norm_type: float = 2, grad_stats_parallel_group: Any = None
    ) -> float:
        handle = current()
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else grads_for_norm
        dtensor = any(type(g).__name__ == "DTensor" for g in grads)
        if handle is None or not handle.fused or float(norm_type) != 2.0 or dtensor:
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)  # type: ignore[no-any-return]
        return _reduce_with_units(handle, list(grads), grad_stats_parallel_group)

    return get_grad_norm_fp32


def _reduce_with_units(handle: MegatronGNMR, grads: list[torch.Tensor], group: Any) -> float:
    from megatron.core.optimizer import clip_grads

    from gnmr_dist.distributed.monitor import sum_of_squares_by_slot, unit_norms_from_total

    u = handle.registry.num_units
    device = grads[0].device if grads else torch.device("cpu")
    units = sum_of_squares_by_slot(grads, [handle.slot_of(g) for g in grads], u + 1, device)
    if grads:  # megatron's own total, computed exactly as the original does
        flag = torch.zeros(1, dtype=torch.int, device=device)
        total, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
        total_sq = total.float() ** 2
    else:
        total_sq = torch.zeros(1, dtype=torch.float, device=device)
    # [unit 0 .. unit U-1, rest, megatron's total]: one all-reduce instead of megatron's one
    vector = torch.cat([units.float(), total_sq.reshape(1)])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    total_norm = float(vector[-1].item() ** 0.5)
    norms = unit_norms_from_total(vector[:-1].double())
    handle.pending = type(norms)(norms.norms, norms.rest_norm, global_norm=total_norm)
    return total_norm


def _plan_fp8_context(original: Any) -> Any:
    """``get_fp8_context`` whose per-layer contexts follow the GNMR plan (global layer number)."""

    def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        context = original(config, layer_no, is_init)
        handle = current()
        if handle is None or is_init or layer_no < 0:
            return context  # build-time and outer (delayed-recipe) contexts stay megatron's
        return handle.layer_context(layer_no, context)

    return get_fp8_context


def _wrap_step(optimizer: Any) -> None:
    step = optimizer.step

    def gnmr_step(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        handle = current()
        if handle is not None:
            handle.after_step(bool(result[0]) if isinstance(result, tuple) else bool(result))
        return result

    _ORIGINALS[f"step:{id(optimizer)}"] = (optimizer, vars(optimizer).get("step"))
    optimizer.step = gnmr_step


def current() -> MegatronGNMR | None:
    """The runtime installed by :func:`apply` (None when not applied)."""
    return _CURRENT[0] if _CURRENT else None


def apply(
    model: nn.Module | Sequence[nn.Module],
    block: Any,
    *,
    optimizer: Any = None,
    fused_norm: bool = True,
) -> MegatronGNMR:
    """Install GNMR on a megatron-core model (idempotent for the same model).

    Args:
        model: the model chunk(s) of this rank, as built (DDP-wrapped or not).
        block: a :class:`gnmr_dist.integrations.config.GNMRBlock` or its dict form.
        optimizer: megatron's optimizer; its ``step`` is wrapped to feed the controller.
        fused_norm: carry the per-unit norms in megatron's clip-norm all-reduce (checked
            versions only); ``False`` uses GNMR's own one all-reduce per step.
    """
    from gnmr_dist.backends import get_backend
    from gnmr_dist.integrations.config import GNMRBlock

    block = block if isinstance(block, GNMRBlock) else GNMRBlock.from_dict(block)
    chunks = list(model) if isinstance(model, Sequence) else [model]
    if len(chunks) != 1:
        raise NotImplementedError(
            "megatron_patches.apply: virtual pipeline parallelism (several model chunks per "
            "rank) is not supported yet; pass the one model chunk of this rank"
        )
    handle = current()
    if handle is not None and [id(c) for c in handle.model] == [id(c) for c in chunks]:
        return handle
    series = megatron_series()
    if fused_norm and series not in FUSED_NORM_VERSIONS:
        raise RuntimeError(
            f"megatron_patches: the fused clip-norm patch was checked on megatron-core "
            f"{', '.join(v + '.x' for v in FUSED_NORM_VERSIONS)}; found {series}. Pass "
            "fused_norm=False (GNMR then adds one small all-reduce per step) or verify "
            "optimizer.get_grad_norm_fp32 of this version and add it to FUSED_NORM_VERSIONS."
        )
    remove()
    backend = None
    if block.backend is not None:
        backend = get_backend(block.backend, low_cost=block.low_cost, recovery=block.recovery)
    handle = MegatronGNMR(chunks, block, backend, fused_norm)
    _install(handle, optimizer)
    return handle


def _install(handle: MegatronGNMR, optimizer: Any) -> None:
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.transformer import transformer_block

    _ORIGINALS["get_grad_norm_fp32"] = mcore_optimizer.get_grad_norm_fp32
    mcore_optimizer.get_grad_norm_fp32 = _fused_grad_norm(mcore_optimizer.get_grad_norm_fp32)
    _ORIGINALS["get_fp8_context"] = transformer_block.get_fp8_context
    transformer_block.get_fp8_context = _plan_fp8_context(transformer_block.get_fp8_context)
    if optimizer is not None:
        _wrap_step(optimizer)
    _CURRENT.append(handle)


def remove() -> None:
    """Undo :func:`apply`: original functions back, backend unwrapped (no-op if not applied)."""
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.transformer import transformer_block

    for key, value in list(_ORIGINALS.items()):
        if key == "get_grad_norm_fp32":
            mcore_optimizer.get_grad_norm_fp32 = value
        elif key == "get_fp8_context":
            transformer_block.get_fp8_context = value
        else:
            owner, instance_step = value  # the instance attribute it had before, if any
            if instance_step is None:
                del owner.step  # the class's method shows again
            else:
                owner.step = instance_step
        del _ORIGINALS[key]
    while _CURRENT:
        handle = _CURRENT.pop()
        if handle.backend is not None:
            handle.backend.unwrap()
