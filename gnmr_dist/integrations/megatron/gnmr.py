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
gradient), adds their squares per unit slot, and all-reduces ``[units, rest, unattributed,
megatron's squared total]`` (U + 3 float32 numbers) in the one all-reduce megatron makes, over
the grad-stats group megatron passes (model-parallel group, or the whole distributed-optimizer
group). megatron gets back the total it would have computed, as a float (0.16) or as a device
tensor (0.17+, when TE's tensor-scale kernel exists: no host sync). The host needs the vector
to decide; it is copied asynchronously and the decision is taken when the next step first needs
the plan. With ``fused_norm=False`` the same sums ride a separate all-reduce of GNMR's own.
When megatron computes no norm in a step (``clip_grad == 0`` with a plain optimizer), the same
gradients are read at the start of ``step_with_ready_grads`` (prepared, unscaled, not
clipped) with one all-reduce of GNMR's own.

**The error term (DESIGN.md 2.1, ``gnmr.gamma``).** The backend's per-unit error sums ``B(u)``
(linear in the output gradients: divided by megatron's loss scale, times DDP's ``1/dp``) ride
the first clip-norm all-reduce of the step as U more numbers. That group spans the
data-parallel ranks only with the distributed optimizer; with the plain optimizer the DP
partials are summed first, in one extra all-reduce of U values over DP (the one collective the
term adds there). The controller receives ``e = B / G`` (``G``: the global gradient norm).

**The guard.** A mapping that misses leaves the units at zero and the rest slot holding the
whole gradient: the controller would score 1.0 forever and never act. Every step, after the
reduction, an unattributed gradient, units at zero under a positive total, or a rest share above
``gnmr.attribution.max_rest_share`` stops the run with the cause named (or warns once).

**Per-layer precision.** ``get_fp8_context`` as imported by ``TransformerBlock`` is replaced:
a layer unit on the recovery path gets the backend's recovery region (``te_fp8``: FP8 off or a
stronger recipe) instead of megatron's per-layer FP8 context, by global layer number. Operator
units are switched by the backend on the operators themselves.

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
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.core import Decision
from gnmr_dist.distributed import Plan
from gnmr_dist.distributed.monitor import IndexCache, UnitNorms, index_tensor
from gnmr_dist.integrations.megatron.versions import SeriesInfo, megatron_series, series_info
from gnmr_dist.integrations.session import (
    IntegrationSession,
    check_error_source,
    error_source,
    refuse_probe,
)

__all__ = ["MegatronGNMR", "apply", "current", "megatron_series", "remove"]

logger = logging.getLogger(__name__)

_CURRENT: list[MegatronGNMR] = []
_LAYER_NAME = re.compile(r"\blayers\.(\d+)$")
_ORIGINALS: dict[str, Any] = {}


# ---------------------------------------------------------------------- attribution


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizers that own main parameters (a ``ChainedOptimizer`` recursively)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
        return
    for sub in chained:
        yield from leaf_optimizers(sub)


_PAIRED_GROUPS = (
    # DistributedOptimizer: model params <-> this rank's main shards
    ("model_float16_groups", "shard_fp32_from_float16_groups"),
    ("model_float16_groups", "shard_float16_groups"),  # precision-aware optimizer
    ("model_fp32_groups", "shard_fp32_groups"),
    # Float16OptimizerWithFloat16Params: model params <-> fp32 main copies
    ("float16_groups", "fp32_from_float16_groups"),
    ("fp32_from_fp32_groups", "fp32_from_fp32_groups"),
)


def main_to_model(optimizer: Any) -> dict[int, nn.Parameter]:
    """``id(main parameter) -> model parameter`` from one leaf optimizer's own structures.

    An optimizer without paired groups (megatron's ``FP32Optimizer``) steps the model
    parameters themselves.
    """
    pairs: dict[int, nn.Parameter] = {}
    found = False
    for model_attr, main_attr in _PAIRED_GROUPS:
        model_groups, main_groups = (
            getattr(optimizer, model_attr, None),
            getattr(optimizer, main_attr, None),
        )
        if model_groups is None or main_groups is None:
            continue
        found = True
        for model_group, main_group in zip(model_groups, main_groups, strict=True):
            pairs.update({id(m): p for p, m in zip(model_group, main_group, strict=True)})
    if not found:
        pairs = {id(p): p for p in optimizer.get_parameters()}
    return pairs


class GradAttribution:
    """Maps the gradients of megatron's clip-norm list to unit slots.

    Slots ``0..U-1`` are units, ``U`` the rest (parameters outside every unit), ``U + 1`` the
    unattributed bucket: a gradient that is no main parameter's, or a main parameter the
    optimizer structures do not pair with a model parameter. The guard refuses any mass there.
    The pairing is built once, at :func:`apply` (the optimizer's parameter groups are fixed).
    """

    def __init__(self, slot_of_param: dict[int, int], num_units: int, optimizer: Any) -> None:
        unattributed = num_units + 1
        self.unattributed = unattributed
        self._mains: list[tuple[nn.Parameter, int]] = []
        for leaf in leaf_optimizers(optimizer) if optimizer is not None else ():
            model_of = main_to_model(leaf)
            for main in leaf.get_parameters():
                model = model_of.get(id(main))
                slot = unattributed if model is None else slot_of_param.get(id(model))
                self._mains.append((main, unattributed if slot is None else slot))

    def slots(self, grads: Sequence[torch.Tensor]) -> list[int]:
        """The slot of each gradient of one clip-norm call."""
        by_grad: dict[int, int] = {}
        for main, slot in self._mains:
            for attr in ("grad", "decoupled_grad"):
                grad = getattr(main, attr, None)
                if grad is not None:
                    by_grad[id(grad)] = slot
        return [by_grad.get(id(g), self.unattributed) for g in grads]


def guard_violation(sums: torch.Tensor, max_rest_share: float) -> str | None:
    """Why the reduced ``[units..., rest, unattributed]`` sums of squares cannot be trusted."""
    units, rest, lost = float(sums[:-2].sum()), float(sums[-2]), float(sums[-1])
    total = units + rest + lost
    if lost > 0:
        return (
            f"{lost / total:.1%} of the squared gradient norm megatron's clip norm reads could not "
            "be attributed to a parameter of the model GNMR was applied to (is `optimizer` the "
            "one built for these model chunks? was a parameter added after apply()?)"
        )
    if total > 0 and units == 0:
        return (
            "the units received no gradient while the total norm is "
            f"{total**0.5:.4g}: every unit would score 1.0 and never be selected"
        )
    if total > 0 and max_rest_share < 1 and rest / total > max_rest_share:
        return (
            f"{rest / total:.1%} of the squared gradient norm is outside every unit (limit "
            f"gnmr.attribution.max_rest_share={max_rest_share}): check include/exclude"
        )
    return None


# ---------------------------------------------------------------------- the session


class MegatronGNMR(IntegrationSession):
    """The GNMR runtime of one megatron-core model (``megatron_patches.current()``)."""

    def __init__(
        self,
        model: Sequence[nn.Module],
        block: Any,
        backend: Any,
        *,
        fused: bool,
        optimizer: Any,
        info: SeriesInfo,
    ) -> None:
        from megatron.core import parallel_state as ps

        from gnmr_dist.backends import registered_operator_types
        from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

        self.model, self.block, self.backend, self.fused = list(model), block, backend, fused
        self.info, self.optimizer = info, optimizer
        self.registry = UnitRegistry.from_model(
            self.model,
            granularity=block.units,
            include=block.include,
            exclude=block.exclude,
            group=dist.group.WORLD,
            tp_group=ps.get_tensor_model_parallel_group(),
            eligible_fn=backend.is_eligible if backend is not None else None,
            operator_types=registered_operator_types(),
        )
        if backend is not None:
            backend.wrap(self.registry.local_modules)
        self._dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self._dp = dist.get_world_size(self._dp_group)
        self.runtime = GNMRRuntime(
            self.registry,
            block.policy,
            group=ps.get_model_parallel_group(),
            check_group=dist.group.WORLD,
            check_consistency=block.check_consistency,
            error_fn=error_source(block, backend, self.registry.num_units),
            error_scale=1.0 / self._dp,
            error_every=block.error_every,  # DDP's mean over DP
        )
        self.attribution = GradAttribution(
            self.registry.slot_of_param, self.registry.num_units, optimizer
        )
        self._index_cache: IndexCache = {}
        self._sums: torch.Tensor | None = None
        self._errors: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._ready: Any = None
        self._total_sq: torch.Tensor | None = None
        self.collecting = False
        self.pending = False
        self.skipped = 0
        self._warned = False
        self._apply_plan()

    # ------------------------------------------------------------------ the fused norm

    def norm_with_units(
        self, grads: list[torch.Tensor], group: Any, original: Callable[..., Any] | None
    ) -> Any:
        """megatron's ``get_grad_norm_fp32`` (L2), adding this call's per-unit sums to the step.

        ``original``: megatron's function, for the unfused path (GNMR's own all-reduce, then
        megatron's untouched); ``None`` when megatron computes no norm and only GNMR needs one.
        """
        from megatron.core.optimizer import clip_grads

        device = grads[0].device if grads else self.runtime.monitor.device
        total, per_tensor = self._l2(clip_grads, grads, device)
        units = self._by_slot(grads, per_tensor, device)
        errors = self._local_errors(group, device)  # once per step, section 2.1 only
        if errors is not None:
            units = torch.cat([units, errors])
        total_sq = total.float() ** 2.0
        result = None
        if self.fused or original is None:  # one all-reduce, carrying the units along
            vector = torch.cat([units, total_sq.reshape(1)])
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
            units, total_sq = vector[:-1], vector[-1:]
            if original is not None:
                result = self._megatron_result(clip_grads, total_sq)
        else:
            dist.all_reduce(units, op=dist.ReduceOp.SUM, group=group)
            result = original(grads, 2.0, group)
            total_sq = torch.as_tensor(result, dtype=torch.float, device=device).reshape(1) ** 2
        if errors is not None:
            units, self._errors = units[: -errors.numel()], units[-errors.numel() :]
        self._accumulate(units, total_sq)
        return result

    def _local_errors(self, group: Any, device: torch.device) -> torch.Tensor | None:
        """float32 [U]: this rank's section 2.1 error sums ``B(u)``, in the reduced gradient's
        units, for the first norm call of a step (``None`` without ``gnmr.gamma`` or later).

        ``B`` is linear in the output gradients, so megatron's loss scale (fp16) is divided out
        and the DP mean of DDP (``1/dp``) applied. The clip-norm group spans the data-parallel
        ranks only with the distributed optimizer; with the plain optimizer the DP partials are
        summed first: one extra all-reduce of U values over DP, the one collective the error
        term adds there.
        """
        if not self.runtime.errors_due() or self._errors is not None:
            return None  # no gnmr.gamma, a step gnmr.error_every skips, or taken already
        errors = self.runtime.monitor.local_error_sums().to(device)  # times 1/dp
        errors = errors / self._loss_scale(device)
        if self._dp > 1 and not _spans(group, self._dp_group):
            dist.all_reduce(errors, op=dist.ReduceOp.SUM, group=self._dp_group)
        return errors.float()

    def _loss_scale(self, device: torch.device) -> torch.Tensor:
        scale = self.optimizer.get_loss_scale() if self.optimizer is not None else None
        if scale is None:
            return torch.ones(1, dtype=torch.float64, device=device)
        return torch.as_tensor(scale, device=device).to(torch.float64).reshape(-1)[:1]

    def _l2(
        self, clip_grads: Any, grads: list[torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's multi-tensor l2 norm and the per-tensor norms of the same launch."""
        if not grads:
            return torch.zeros(1, dtype=torch.float, device=device), torch.zeros(0, device=device)
        flag = torch.zeros(1, dtype=torch.int, device=device)
        total, per_tensor = clip_grads.multi_tensor_applier(
            clip_grads.l2_norm_impl, flag, [grads], True
        )
        return total, per_tensor.reshape(-1)

    def _by_slot(
        self, grads: list[torch.Tensor], per_tensor: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """float32 [U + 2]: per-slot sums of squared per-tensor norms (float64 inside)."""
        out = torch.zeros(self.registry.num_units + 2, dtype=torch.float64, device=device)
        if grads:
            index = index_tensor(self.attribution.slots(grads), device, self._index_cache)
            out.index_add_(0, index, per_tensor.to(torch.float64).square())
        return out.float()

    def _megatron_result(self, clip_grads: Any, total_sq: torch.Tensor) -> Any:
        """What megatron's own function returns for this squared total (tensor or float)."""
        tensor_out = self.info.norm_may_be_tensor and (
            getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None
        )
        return total_sq.pow(0.5) if tensor_out else float(total_sq.item() ** 0.5)

    def _accumulate(self, units: torch.Tensor, total_sq: torch.Tensor) -> None:
        self._sums = units if self._sums is None else self._sums + units
        self._total_sq = total_sq if self._total_sq is None else self._total_sq + total_sq
        self._start_host_copy()

    def _start_host_copy(self) -> None:
        """Copy the step's sums to the host without waiting (CUDA: pinned buffer + event)."""
        assert self._sums is not None and self._total_sq is not None
        parts = [self._sums, self._total_sq]
        vector = torch.cat(parts if self._errors is None else [*parts, self._errors])
        if vector.device.type != "cuda":
            self._host, self._ready = vector, None
            return
        if self._host is None or self._host.numel() != vector.numel() or self._ready is None:
            self._host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
        self._host.copy_(vector, non_blocking=True)
        self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._ready.record()

    def own_norms(self, optimizer: Any) -> None:
        """megatron computed no norm this step: read its clip-norm list, one all-reduce."""
        grads = list(getattr(optimizer, self.info.grads_for_norm)())
        self.norm_with_units(grads, optimizer.get_grad_stats_parallel_group(), None)

    # ------------------------------------------------------------------ per-layer precision

    def layer_context(self, layer_no: int, default: Any) -> Any:
        """The precision context of global layer ``layer_no`` (0-based) under the plan.

        A layer unit on the recovery path gets the backend's ``recovery_region()`` (``te_fp8``:
        FP8 off, or its stronger recipe) in place of megatron's per-layer FP8 context; every other
        layer, and every layer of a backend without one (``None``), keeps megatron's.
        Operator-granularity plans are applied by the backend on the operators themselves, so
        they leave the layer context alone.
        """
        self.settle()
        uid = self._layer_units().get(layer_no)
        if uid is None or self.backend is None or uid not in self.runtime.plan.active:
            return default
        region = self.backend.recovery_region()
        return default if region is None else region

    def _layer_units(self) -> dict[int, int]:
        if not hasattr(self, "_layers"):
            self._layers = {
                int(m.group(1)): uid
                for uid, name in enumerate(self.registry.names)
                if (m := _LAYER_NAME.search(name)) is not None
            }
        return self._layers

    # ------------------------------------------------------------------ per step

    def begin_step(self) -> None:
        """An optimizer step starts: settle the last decision, collect this step's norms."""
        self.settle()
        self._sums, self._total_sq, self._host, self._ready = None, None, None, None
        self._errors = None
        self.collecting = True

    def after_step(self, update_successful: bool) -> None:
        """The step is done: its norms are decided on when the next step first needs the plan."""
        self.collecting = False
        if not update_successful:
            self._sums = self._host = None
            self.skipped += 1
            logger.warning("gnmr: megatron skipped the update; controller history untouched")
            return
        if self._host is None:
            raise RuntimeError(
                "gnmr: megatron's optimizer step computed no gradient norm and GNMR read none "
                f"(optimizer {type(self.optimizer).__name__}): this optimizer class is not "
                "supported by megatron_patches"
            )
        self.pending = True
        if self.backend is not None:
            self.backend.before_forward = self.settle
        else:
            self.settle()

    def settle(self) -> None:
        """Take the pending decision (host copy of the reduced sums) and apply its plan."""
        if not self.pending:
            return
        self.pending = False
        if self.backend is not None:
            self.backend.before_forward = None
        if self._ready is not None:
            self._ready.synchronize()
        assert self._host is not None
        vector = self._host.to(device="cpu", dtype=torch.float64)
        u = self.registry.num_units
        sums, total, errors = vector[: u + 2], float(vector[u + 2].sqrt()), vector[u + 3 :]
        self._check_attribution(sums)
        norms = UnitNorms(
            sums[:u].sqrt(),
            float(sums[u].sqrt()),
            global_norm=total,
            error_sums=errors if errors.numel() else None,
        )
        self.runtime.observe(norms)
        self._apply_plan()

    def _check_attribution(self, sums: torch.Tensor) -> None:
        guard = self.block.attribution
        why = guard_violation(sums, guard.max_rest_share)
        if why is None:
            return
        step = self.runtime.controller.step_count + 1
        message = f"gnmr: per-unit attribution failed at step {step} ({self.setting()}): {why}"
        if guard.action == "error":
            raise RuntimeError(
                message + ". Set gnmr.attribution.action='warn' to continue regardless."
            )
        if not self._warned:
            self._warned = True
            logger.warning("%s (gnmr.attribution.action='warn': warned once)", message)

    def setting(self) -> str:
        """The megatron setting the attribution runs under, for messages."""
        ddp = getattr(self.model[0], "ddp_config", None)
        leaves = (
            sorted({type(o).__name__ for o in leaf_optimizers(self.optimizer)})
            if (self.optimizer is not None)
            else []
        )
        return (
            f"megatron-core {self.info.checked.rsplit('.', 1)[0]}.x, optimizer {leaves}, "
            f"use_distributed_optimizer={getattr(ddp, 'use_distributed_optimizer', None)}, "
            f"grad_reduce_in_fp32={getattr(ddp, 'grad_reduce_in_fp32', None)}, "
            f"{len(self.model)} model chunk(s)"
        )

    @property
    def plan(self) -> Plan:
        """The plan the current step runs with (any pending decision taken first)."""
        self.settle()
        return self.runtime.plan

    @property
    def last_decision(self) -> Decision | None:
        """The decision of the last applied optimizer step (taken now if still pending)."""
        self.settle()
        return self.runtime.last_decision

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`IntegrationSession.state_dict`, after taking any pending decision."""
        self.settle()
        return super().state_dict()

    def install_rerun_hooks(self) -> None:
        """Chain onto megatron's rerun state machine: a rerun replays the same plan."""
        from megatron.core import rerun_state_machine as rsm_module

        rsm = rsm_module.get_rerun_state_machine()
        save, restore = rsm.state_save_func, rsm.state_restore_func

        def state_save() -> Any:
            other = save() if save is not None else None
            self.settle()
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


def _spans(group: Any, dp_group: Any) -> bool:
    """Whether ``group`` contains every rank of this rank's ``dp_group``."""
    ranks = set(dist.get_process_group_ranks(group)) if group is not None else None
    return ranks is None or set(dist.get_process_group_ranks(dp_group)) <= ranks


# ---------------------------------------------------------------------- the patches


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


def _plan_fp8_context(original: Any) -> Any:
    """``get_fp8_context`` whose per-layer contexts follow the GNMR plan (global layer number)."""

    def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        context = original(config, layer_no, is_init)
        handle = current()
        if handle is None or is_init or layer_no < 0:
            return context  # build-time and outer (delayed-recipe) contexts stay megatron's
        return handle.layer_context(layer_no, context)

    return get_fp8_context


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

    for name, fn in (("step", gnmr_step), ("step_with_ready_grads", gnmr_step_with_ready_grads)):
        _ORIGINALS[f"{name}:{id(optimizer)}"] = (optimizer, name, vars(optimizer).get(name))
        setattr(optimizer, name, fn)


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
        model: the model chunk(s) of this rank, as built (DDP-wrapped or not); a list of
            chunks with virtual pipeline parallelism.
        block: a :class:`gnmr_dist.integrations.config.GNMRBlock` or its dict form.
        optimizer: megatron's optimizer (``get_megatron_optimizer``'s result). Its ``step`` is
            wrapped to feed the controller, and its structures say which gradient belongs to
            which unit. Required for training; ``None`` only to inspect units and plans.
        fused_norm: carry the per-unit norms in megatron's clip-norm all-reduce; ``False`` adds
            GNMR's own small all-reduce per step (same gradients, same pre-clip values).
    """
    from gnmr_dist.integrations.config import GNMRBlock

    block = GNMRBlock.of(block)
    refuse_probe(block, "megatron_patches.apply")
    chunks = list(model) if isinstance(model, Sequence) else [model]
    handle = current()
    if handle is not None and [id(c) for c in handle.model] == [id(c) for c in chunks]:
        return handle
    info = series_info(what="megatron_patches.apply")
    _refuse_unsupported(chunks, block, optimizer)
    remove()
    backend = block.build_backend()
    check_error_source(block, backend)  # gnmr.gamma needs a backend that reports error sums
    handle = MegatronGNMR(chunks, block, backend, fused=fused_norm, optimizer=optimizer, info=info)
    _install(handle, optimizer, info)
    return handle


def _configs(chunks: Sequence[nn.Module]) -> list[Any]:
    return [c for c in (getattr(_unwrap(m), "config", None) for m in chunks) if c is not None]


def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module  # type: ignore[assignment]
    return module


def _refuse_unsupported(chunks: Sequence[nn.Module], block: Any, optimizer: Any) -> None:
    """Settings GNMR cannot handle, refused before anything is patched."""
    emulated = block.backend not in (None, "te_fp8")
    for config in _configs(chunks):
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
    from megatron.core.transformer import transformer_block

    for home in info.norm_call_sites:
        try:
            module = importlib.import_module(home)
        except ImportError:  # an optional optimizer module whose extra deps are absent
            continue
        original = getattr(module, "get_grad_norm_fp32")  # noqa: B009 (a megatron module)
        _ORIGINALS["norm:" + home] = original
        setattr(module, "get_grad_norm_fp32", _fused_grad_norm(original))  # noqa: B010
    _ORIGINALS["get_fp8_context"] = transformer_block.get_fp8_context
    transformer_block.get_fp8_context = _plan_fp8_context(transformer_block.get_fp8_context)
    if optimizer is not None:
        _wrap_optimizer(optimizer)
    _CURRENT.append(handle)


def remove() -> None:
    """Undo :func:`apply`: original functions back, backend unwrapped (no-op if not applied)."""
    from megatron.core.transformer import transformer_block

    for key, value in list(_ORIGINALS.items()):
        if key.startswith("norm:"):
            setattr(importlib.import_module(key[len("norm:") :]), "get_grad_norm_fp32", value)  # noqa: B010
        elif key == "get_fp8_context":
            transformer_block.get_fp8_context = value
        else:
            owner, name, instance_attr = value  # the instance attribute it had before, if any
            if instance_attr is None:
                delattr(owner, name)  # the class's method shows again
            else:
                setattr(owner, name, instance_attr)
        del _ORIGINALS[key]
    while _CURRENT:
        handle = _CURRENT.pop()
        if handle.backend is not None:
            handle.backend.before_forward = None
            handle.backend.unwrap()
