"""The GNMR runtime of one megatron-core model (:class:`MegatronGNMR`): the per-unit norms
inside megatron's clip-norm all-reduce, the error term, the guard, the per-layer precision
context and the step bracket; :mod:`gnmr_dist.integrations.megatron.gnmr` installs it.

Per step the controller also gets the learning rate the optimizer applies at that step, read
from its parameter groups as the step starts (:func:`applied_lr`: megatron's scheduler moves it
only after ``optimizer.step()``, so what Megatron-LM's loop logs as ``learning-rate`` at an
iteration is the next step's). A step megatron skips (an fp16 overflow: its optimizer returns
before the clip norm) is read once more, with one all-reduce of GNMR's own on that step only,
so the runtime counts and names its non-finite units (:meth:`GNMRRuntime.skip`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.core import Decision
from gnmr_dist.distributed import Plan
from gnmr_dist.distributed.monitor import IndexCache, UnitNorms, index_tensor
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.megatron.attribution import (
    GradAttribution,
    guard_violation,
    leaf_optimizers,
)
from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS, MEGATRON_OPERATORS
from gnmr_dist.integrations.megatron.versions import SeriesInfo
from gnmr_dist.integrations.session import IntegrationSession, error_source

__all__ = ["MegatronGNMR", "applied_lr"]

logger = logging.getLogger(__name__)

_LAYER_NAME = re.compile(r"\blayers\.(\d+)$")


class MegatronGNMR(IntegrationSession):
    """The GNMR runtime of one megatron-core model (``megatron_patches.current()``): what
    ``megatron_patches.enable`` returns, also a context manager whose exit disables it."""

    _disable: Callable[[], None] | None = None
    """Set by ``megatron_patches.enable`` (which imports this module, so the handle is given
    the undo rather than importing it): what leaving a ``with`` block calls."""

    def __enter__(self) -> MegatronGNMR:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._disable is not None:
            self._disable()

    def __init__(
        self,
        model: Sequence[nn.Module],
        block: GNMRBlock,
        backend: PrecisionBackend | None,
        *,
        fused: bool,
        optimizer: Any,
        info: SeriesInfo,
        pg_collection: Any,
    ) -> None:
        """``pg_collection``: megatron-core's ``ProcessGroupCollection`` of the run, read for
        ``tp`` (replicated parameters count on its rank 0), ``mp`` (the per-unit sums add up
        over it) and ``dp_cp`` (DDP's mean); nothing is looked up in ``parallel_state``."""
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
            tp_group=pg_collection.tp,
            eligible_fn=backend.is_eligible if backend is not None else None,
            operator_types=MEGATRON_OPERATORS.all_types() | registered_operator_types(),
            marks=MEGATRON_MARKS,
        )
        if backend is not None:
            backend.wrap(self.registry.local_modules)
        self._dp_group = pg_collection.dp_cp
        self._dp = dist.get_world_size(self._dp_group)
        self.runtime = GNMRRuntime(
            self.registry,
            block.policy,
            group=pg_collection.mp,
            check_group=dist.group.WORLD,
            check_consistency=block.check_consistency,
            error_fn=error_source(block, backend, self.registry.num_units),
            error_scale=1.0 / self._dp,
            error_every=block.error_every,  # DDP's mean over DP
            gemms=block.gemms,
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
        self._lr: float | None = None  # the learning rate of the step being collected
        self.last_lr: float | None = None
        """The learning rate the optimizer applied at the last decided step (``None``: none
        readable)."""
        self._skipped_units: list[int] = []  # non-finite units of skipped attempts, not decided
        self.last_skipped: tuple[int, ...] = ()
        """The non-finite units of the attempts megatron skipped before the last decided step
        (a unit once per attempt): the trace record's ``skipped_nonfinite``."""
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
        # the error sums ride the same all-reduce as the norms (no extra collective)
        errors = self._local_errors(group, device)  # once per step, damage term only
        if errors is not None:
            units = torch.cat([units, errors])
        total_sq = total.float() ** 2.0
        result = None
        if self.fused or original is None:  # one all-reduce, carrying the units along
            # megatron's entry first: gloo reduces element 0 of any vector in the order it
            # reduces megatron's own 1-element one, so its total stays bitwise its own
            vector = torch.cat([total_sq.reshape(1), units])
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
            total_sq, units = vector[:1], vector[1:]
            if original is not None:
                result = self._megatron_result(clip_grads, total_sq)
        else:
            # unfused: GNMR's own all-reduce first, then megatron's untouched call
            dist.all_reduce(units, op=dist.ReduceOp.SUM, group=group)
            result = original(grads, 2.0, group)
            total_sq = torch.as_tensor(result, dtype=torch.float, device=device).reshape(1) ** 2
        if errors is not None:
            # split the reduced vector back: the tail is the step's error sums
            units, self._errors = units[: -errors.numel()], units[-errors.numel() :]
        self._accumulate(units, total_sq)
        return result

    def _local_errors(self, group: Any, device: torch.device) -> torch.Tensor | None:
        """float32 [U]: this rank's damage-term error sums ``B(u)``, in the reduced gradient's
        units, for the first norm call of a step (``None`` without ``gnmr.gamma`` or later).

        ``B`` is linear in the output gradients, so megatron's loss scale (fp16) is divided out
        and the DP mean of DDP (``1/dp``) applied. The clip-norm group spans the data-parallel
        ranks only with the distributed optimizer; with the plain optimizer the DP partials are
        summed first: one extra all-reduce of U values over DP, the one collective the error
        term adds there.
        """
        if not self.runtime.plan.measure_errors or self._errors is not None:
            return None  # no gnmr.gamma, a step gnmr.error_every skips, or taken already
        errors = self.runtime.monitor.local_error_sums().to(device)  # times 1/dp
        errors = errors / self._loss_scale(device)
        # the plain optimizer's grad-stats group has no DP ranks: sum their partials here
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
        # a step may call the norm more than once (ChainedOptimizer: once per leaf)
        self._sums = units if self._sums is None else self._sums + units
        self._total_sq = total_sq if self._total_sq is None else self._total_sq + total_sq
        self._start_host_copy()

    def _start_host_copy(self) -> None:
        """Copy the step's sums to the host without waiting (CUDA: pinned buffer + event)."""
        assert self._sums is not None and self._total_sq is not None
        parts = [self._sums, self._total_sq]
        vector = torch.cat(parts if self._errors is None else [*parts, self._errors])
        # on a CPU the vector is the host copy: no event to wait for
        if vector.device.type != "cuda":
            self._host, self._ready = vector, None
            return
        if self._host is None or self._host.numel() != vector.numel() or self._ready is None:
            self._host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
        # no sync after the step: the decision waits on this event when the plan is needed
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
        """An optimizer step starts: settle the last decision, read the learning rate this step
        applies, collect this step's norms."""
        self.settle()
        self._sums, self._total_sq, self._host, self._ready = None, None, None, None
        self._errors = None
        # read before the scheduler moves it: the lr this step applies (lr_t)
        self._lr = applied_lr(self.optimizer)
        self.collecting = True

    def after_step(self, update_successful: bool) -> None:
        """The step is done: its norms are decided on when the next step first needs the plan;
        a skipped step's are counted by the runtime at once (:meth:`_skip`)."""
        self.collecting = False
        if not update_successful:
            self._skip()
            return
        if self._host is None:
            raise RuntimeError(
                "gnmr: megatron's optimizer step computed no gradient norm and GNMR read none "
                f"(optimizer {type(self.optimizer).__name__}): this optimizer class is not "
                "supported by megatron_patches"
            )
        # carry-forward: the decision is taken lazily, at the next step's first forward,
        # so the host copy of the sums has landed by then
        self.pending = True
        if self.backend is not None:
            # the backend asks before its first forward; without one, settle now
            self.backend.before_forward = self.settle
        else:
            self.settle()

    def _skip(self) -> None:
        """megatron skipped the update: the controller's history stays as it is, the step's
        non-finite units are counted (and the run's first named) by :meth:`GNMRRuntime.skip`.

        megatron skips when its grad scaler finds an inf or NaN, reduced over the grad-stats
        group, and returns before its clip norm; the gradients it checked are read here with
        one all-reduce over that same group (every rank of it skips alike)."""
        if self._host is None:
            self._skipped_sums()
        self._sums = None
        self.skipped += 1
        norms = self._host_norms(check=False)
        self._host = self._ready = None
        bad = self.runtime.skip(norms)
        self._skipped_units.extend(bad)
        step = self.runtime.controller.step_count + 1
        logger.warning(
            "gnmr: megatron skipped the update of step %d (non-finite norms in %d of %d units); "
            "controller history untouched",
            step,
            len(bad),
            self.registry.num_units,
        )

    def _skipped_sums(self) -> None:
        """The per-unit sums of a step megatron skipped before its clip norm (no error term)."""
        from megatron.core.optimizer import clip_grads

        leaves = list(leaf_optimizers(self.optimizer))  # as ChainedOptimizer.get_grad_norm
        grads = [g for leaf in leaves for g in getattr(leaf, self.info.grads_for_norm)()]
        group = leaves[0].get_grad_stats_parallel_group()
        device = grads[0].device if grads else self.runtime.monitor.device
        total, per_tensor = self._l2(clip_grads, grads, device)
        units = self._by_slot(grads, per_tensor, device)
        vector = torch.cat([total.float().reshape(1) ** 2, units])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
        self._sums, self._total_sq = vector[1:], vector[:1]
        self._start_host_copy()

    def _host_norms(self, check: bool = True) -> UnitNorms:
        """The step's reduced sums, on the host, as :class:`UnitNorms` (``check``: the
        attribution guard first)."""
        if self._ready is not None:
            self._ready.synchronize()
        assert self._host is not None
        vector = self._host.to(device="cpu", dtype=torch.float64)
        u = self.registry.num_units
        sums, total, errors = vector[: u + 2], float(vector[u + 2].sqrt()), vector[u + 3 :]
        if check:
            self._check_attribution(sums)
        return UnitNorms(
            sums[:u].sqrt(),
            float(sums[u].sqrt()),
            global_norm=total,
            error_sums=errors if errors.numel() else None,
        )

    def settle(self) -> None:
        """Take the pending decision (host copy of the reduced sums) and apply its plan."""
        if not self.pending:
            return
        self.pending = False
        if self.backend is not None:
            self.backend.before_forward = None
        self.runtime.observe(self._host_norms(), lr=self._lr)
        self.last_lr = self._lr
        self.last_skipped, self._skipped_units = tuple(self._skipped_units), []
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


def applied_lr(optimizer: Any) -> float | None:
    """The learning rate ``optimizer`` applies at its next step: that of its first parameter
    group on megatron's default schedule (``default_config``, the group megatron's own
    ``get_canonical_lr_for_logging`` reads, the same on every rank), else of its first group;
    ``None`` without one."""
    groups = list(getattr(optimizer, "param_groups", None) or ()) if optimizer is not None else []
    chosen = next((g for g in groups if g.get("default_config", False)), None)
    if chosen is None and groups:
        chosen = groups[0]
    lr = None if chosen is None else chosen.get("lr")
    return None if lr is None else float(lr)


def _spans(group: Any, dp_group: Any) -> bool:
    """Whether ``group`` contains every rank of this rank's ``dp_group``."""
    ranks = set(dist.get_process_group_ranks(group)) if group is not None else None
    return ranks is None or set(dist.get_process_group_ranks(dp_group)) <= ranks
