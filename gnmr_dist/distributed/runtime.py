"""The per-step glue: monitor -> controller -> the plan for the next step.

At the gradient-accumulation boundary, once the gradients are final (data-parallel reduced) and
before the optimizer consumes them, :meth:`GNMRRuntime.step` computes the global per-unit norms
(one all-reduce), feeds them to the controller and publishes a :class:`Plan`: the units that run
the recovery path for the whole next step, every micro-batch, pipeline stage and activation
recomputation included. Every rank runs the same controller on the same reduced vector, so every
rank holds the same plan without further communication.

With ``gnmr.gamma`` set (docs/algorithm.md#damage-term) the runtime also needs an error source,
``error_fn`` (the precision backend's ``error_sums``): the monitor then reduces the error sums
``B(u)`` in the same all-reduce as the norms, and the controller receives ``e_t(u) = B(u) /
G_t``, the bound over the global gradient norm (:meth:`UnitNorms.relative_errors`). Without
``gamma`` the error source is ignored: the same single U + 1 all-reduce, bit-identical
decisions.

The controller is built from the registry: the units' costs of the compute-share budget
(docs/algorithm.md#compute-share; ``w(u) = g x size(u)`` with ``g`` the GEMMs of ``gnmr.gemms``,
``W = 3 x sum size``, sizes agreed by every rank at start, :meth:`UnitRegistry.costs`), and the
mask of ``gnmr.pinned``, resolved once with the registry's global unit names. The integration
passes the learning rate the optimizer applied at the step (``lr=``, for the lr_decay clock).
A step the framework skipped (non-finite gradients) goes to :meth:`GNMRRuntime.skip`, which
leaves the controller untouched and counts it (:mod:`gnmr_dist.distributed.accounting`).

An optional check (``check_consistency=True``) proves that claim at run time: one all-gather of a
hash of each rank's decision, and a ``RuntimeError`` naming the ranks that disagree. It costs a
second collective per step, so it is meant for bring-up and tests, not for production runs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gnmr_dist.core import Decision, GNMRConfig, GNMRController
from gnmr_dist.distributed.accounting import (
    GEMM_ORDER,
    AccountingSummary,
    NonFinite,
    RunAccounting,
)
from gnmr_dist.distributed.comm import Group, all_gather_objects
from gnmr_dist.distributed.monitor import ErrorFn, GradFn, GradNormMonitor, UnitNorms
from gnmr_dist.distributed.units import UnitRegistry
from gnmr_dist.state import RunState, read_run, write_run

__all__ = ["GNMRRuntime", "Plan", "build_controller", "check_same_decision", "decision_digest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Which units run the recovery path during optimizer step ``step``."""

    step: int
    """1-based optimizer step the plan applies to."""
    active: frozenset[int]
    """Unit ids on the recovery path."""
    names: tuple[str, ...]
    """Their global names, in id order."""
    measure_errors: bool = False
    """Whether step ``step`` measures the damage term's error sums (``gnmr.gamma`` set and
    ``step`` a multiple of ``gnmr.error_every``): decided with the plan and handed down with
    it, so an integration reduces them with that step's norms without asking the runtime."""

    def __contains__(self, unit: object) -> bool:
        return unit in self.active


def decision_digest(decision: Decision) -> str:
    """A short hash of everything a decision consists of (step, sets and risk bits)."""
    h = hashlib.sha256()
    h.update(repr((decision.step, decision.active, decision.candidates)).encode())
    h.update(decision.risk.numpy().tobytes())
    return h.hexdigest()[:16]


def _check_error_source(error_fn: ErrorFn | None, monitor: GradNormMonitor) -> None:
    """With ``gnmr.gamma`` set: an error source that reports, or a ``ValueError`` saying why not.

    A block read by :class:`~gnmr_dist.integrations.config.GNMRBlock` has already refused
    ``gamma`` with a backend whose class reports no error sums; this is the guard for a runtime
    built by hand, and for a backend that declares ``reports_errors`` but returns ``None``."""
    if error_fn is None:
        raise ValueError(
            "gnmr.gamma is set, so the runtime needs per-unit error sums "
            "(docs/algorithm.md#damage-term): pass error_fn=backend.error_sums after "
            "backend.track_errors(registry.num_units), with a precision backend that reports "
            "them (act_quant, fp8_emulated, int8, te_fp8); without one (no backend) leave "
            "gnmr.gamma unset"
        )
    if error_fn(monitor.device) is None:
        owner = getattr(error_fn, "__self__", None)
        if owner is None:
            name = getattr(error_fn, "__qualname__", None) or repr(error_fn)
        else:
            name = f"the {getattr(owner, 'name', '') or type(owner).__qualname__} backend"
        raise ValueError(
            f"gnmr.gamma is set but the error source ({name}) returned None instead of the "
            "float64 [U] error sums (docs/algorithm.md#damage-term): a backend whose class sets "
            "reports_errors = True must return them from error_sums once track_errors was "
            "called; fix its error_sums, or set its reports_errors = False (a block with "
            "gnmr.gamma naming it is then refused when it is read), or leave gnmr.gamma unset"
        )


def build_controller(
    registry: UnitRegistry, config: GNMRConfig | None, gemms: Collection[str] = GEMM_ORDER
) -> GNMRController:
    """The controller over ``registry``'s units: its eligibility, the costs of the
    compute-share budget (when every unit's shapes are readable; ``gnmr.max_share`` refuses
    otherwise, naming the units) and the ``gnmr.pinned`` mask over the global unit names."""
    cfg = config if config is not None else GNMRConfig()
    costs = registry.costs(len(gemms))
    if cfg.max_share is not None and costs is None:
        unsized = registry.unsized()
        raise ValueError(
            f"gnmr.max_share needs every unit's linear shapes (its cost, docs/algorithm.md"
            f"#compute-share), but {len(unsized)} of {registry.num_units} units have none "
            f"readable (first: {unsized[:3]}): nn.Linear, megatron-core's parallel linears and "
            "Transformer Engine's linears are read; exclude the others or drop gnmr.max_share"
        )
    # without every unit's size there are no costs: max_share was refused above
    sizes = registry.sizes if costs is not None else None
    return GNMRController.for_units(
        registry.names, cfg, registry.eligible, sizes=sizes, gemms=len(gemms)
    )


def check_same_decision(decision: Decision, group: Group | None) -> None:
    """Raise ``RuntimeError`` naming the ranks whose decision differs from rank 0's."""
    # a digest, not the decision: one small object per rank, and equal digests mean
    # equal steps, sets and risk bits
    entries = all_gather_objects((decision_digest(decision), decision.active), group)
    if all(e[0] == entries[0][0] for e in entries):
        return
    by_digest: dict[str, list[int]] = {}
    for rank, (digest, _) in enumerate(entries):
        by_digest.setdefault(digest, []).append(rank)
    detail = "; ".join(
        f"ranks {ranks} chose active={entries[ranks[0]][1]} (digest {d})"
        for d, ranks in by_digest.items()
    )
    raise RuntimeError(
        f"GNMR decisions differ across ranks at step {decision.step}: {detail}. Ranks were fed "
        "different norm vectors: check that the monitor's group spans every rank that holds a "
        "gradient shard and that all ranks built the same units."
    )


class GNMRRuntime:
    """Owns the monitor, the controller and the current plan for one model.

    Args:
        registry: the model's units (built once with :meth:`UnitRegistry.from_model`).
        config: controller policy (ignored when ``controller`` is given).
        controller: an existing controller over ``registry.num_units`` units.
        group: the group the per-unit vector is all-reduced over (see :class:`GradNormMonitor`).
        grad_fn: how to read a parameter's gradient shard.
        check_group: ranks whose decisions must agree, for the optional check.
        check_consistency: hash-compare the decision across ``check_group`` every step.
        error_fn: ``device -> float64 [U]`` error sums of this rank (``backend.error_sums``,
            after ``backend.track_errors(registry.num_units)``); required with ``gnmr.gamma``,
            ignored without it.
        error_scale: factor on the local error sums before the reduction, the integration's
            gradient averaging factor (``1/dp`` for DeepSpeed's data-parallel mean).
        error_every: measure the error sums only on steps ``t`` with ``t % error_every == 0``
            (``gnmr.error_every``; the backend's ``track_errors(U, every=...)`` must say the
            same) and carry the last score ``e`` forward in between, as
            docs/algorithm.md#damage-term allows; the steps in between reduce the U + 1 vector only.
            Before the first measured step ``e = 0`` (the term is silent); :meth:`state_dict` keeps
            the carried ``e``.
        gemms: the GEMMs a recovered unit recovers (``gnmr.gemms``; default all three): the
            costs ``w(u)`` count them, and the accounting counts each one's recovered steps.
    """

    def __init__(
        self,
        registry: UnitRegistry,
        config: GNMRConfig | None = None,
        *,
        controller: GNMRController | None = None,
        group: Group | None = None,
        grad_fn: GradFn | None = None,
        check_group: Group | None = None,
        check_consistency: bool = False,
        error_fn: ErrorFn | None = None,
        error_scale: float = 1.0,
        error_every: int = 1,
        gemms: Collection[str] = GEMM_ORDER,
    ) -> None:
        if isinstance(error_every, bool) or not isinstance(error_every, int) or error_every < 1:
            raise ValueError(f"gnmr.error_every must be an integer >= 1, got {error_every!r}")
        # pacing fixed for the run: every plan below carries whether its step measures
        self.error_every = error_every
        self._last_errors: torch.Tensor | None = None
        self.registry = registry
        self.controller = controller or build_controller(registry, config, gemms)
        self.accounting = RunAccounting(registry.names, gemms, registry.sizes)
        # decided once here, at build: gamma off means no error source is read or reduced,
        # so the all-reduce stays the U + 1 vector and the decisions stay bit-identical
        self.uses_errors = self.controller.config.gamma is not None
        self.monitor = GradNormMonitor(
            registry,
            group=group,
            grad_fn=grad_fn,
            error_scale=error_scale,
            # without gamma the backend's sums are ignored even when it reports them
            error_fn=error_fn if self.uses_errors else None,
        )
        if self.uses_errors:
            _check_error_source(error_fn, self.monitor)
        # a controller passed in must index the same units the monitor reduces
        if self.controller.num_units != registry.num_units:
            raise ValueError(
                f"controller has {self.controller.num_units} units, "
                f"the registry {registry.num_units}"
            )
        # the ranks that reduce the norms together are the ones that must decide alike
        self.check_group = check_group if check_group is not None else group
        self.check_consistency = check_consistency
        self.plan = self._plan_for(self.controller.step_count + 1, ())
        self.last_decision: Decision | None = None
        self.last_norms: UnitNorms | None = None

    def reset(self) -> None:
        """Start afresh: a new controller history, no carried error score, an empty plan, zero
        counts."""
        self.controller.reset()
        self.accounting.reset()
        self._last_errors = None
        self.plan = self._plan_for(1, ())

    def errors_due(self) -> bool:
        """:attr:`Plan.measure_errors` of the step being scored now (the plan's fact; kept for
        callers that do not hold the plan)."""
        return self.plan.measure_errors

    def step(self, *, lr: float | None = None) -> Decision:
        """Score this step's gradients (one all-reduce) and set the plan for the next step;
        ``lr``: as :meth:`observe`."""
        return self.observe(self.monitor.compute(with_errors=self.plan.measure_errors), lr=lr)

    def observe(self, norms: UnitNorms, *, lr: float | None = None) -> Decision:
        """Feed already-reduced norms to the controller and publish the next plan.

        ``lr`` is the learning rate the optimizer applied at this step (its first parameter
        group): required while a key of the policy runs on the lr_decay clock, and otherwise
        only tracked (its peak, in the state), so an integration passes it at every step.

        With ``gnmr.gamma`` set, ``norms.error_sums`` must hold the reduced ``B(u)`` on the steps
        whose plan says :attr:`Plan.measure_errors`; the controller gets ``errors = B / G``
        (:meth:`UnitNorms.relative_errors`), on the other steps the last one.
        """
        # read before the decision replaces the plan: the accounting counts what ran this step
        ran = self.plan.active
        if not self.uses_errors:
            decision = self.controller.step(norms.norms, lr=lr)
        else:
            if not self.plan.measure_errors:  # carried (error_every): sums reduced anyway are stale
                errors = self._last_errors
                # before the first measured step the term is silent (e = 0), as the docs allow
                if errors is None:
                    errors = torch.zeros(self.registry.num_units, dtype=torch.float64)
            else:
                errors = norms.relative_errors()
            if errors is None:
                raise ValueError(
                    "gnmr.gamma is set but these norms carry no error sums: build UnitNorms with "
                    "error_sums= (the reduced B(u) of the backend's error_sums, "
                    "docs/algorithm.md#damage-term), or use the runtime's monitor, which reduces "
                    "them with the norms"
                )
            # carried forward to the steps error_every skips, and saved with the state
            self._last_errors = errors
            decision = self.controller.step(norms.norms, errors=errors, lr=lr)
        self.accounting.ran(ran)
        if self.check_consistency:
            check_same_decision(decision, self.check_group)
        # after the controller stepped: its first_nonfinite now includes this step
        self._name_first(decision.step, norms, skipped=False)
        self.last_norms, self.last_decision = norms, decision
        # the decision at step t is the plan of step t + 1 (every micro-batch of it)
        self.plan = self._plan_for(decision.step + 1, decision.active)
        if decision.active:
            logger.debug("step %d: recovery for %s", decision.step, self.plan.names)
        return decision

    def skip(self, norms: UnitNorms) -> tuple[int, ...]:
        """A step the framework skipped (its optimizer found non-finite gradients), with the
        step's reduced norms: the controller, its history and the plan stay as they are; the
        non-finite units are counted (:mod:`~gnmr_dist.distributed.accounting`) and, when the
        run had none before, the first is named in one warning. Returns their ids."""
        bad = tuple(torch.nonzero(~torch.isfinite(norms.norms)).flatten().tolist())
        if bad:
            # the skipped attempt is retried as the next step: it carries that step's number
            self._name_first(self.controller.step_count + 1, norms, skipped=True)
        return bad

    def _name_first(self, step: int, norms: UnitNorms, *, skipped: bool) -> None:
        """Count a skipped step's non-finite units; log the run's first non-finite event, once,
        when it is this step's (the same line on every rank: the norms are reduced)."""
        event = self.accounting.note(step, norms.norms, self.controller.first_nonfinite, skipped)
        if event is not None:
            logger.warning("%s", event.line(self.registry.num_units))

    @property
    def first_nonfinite(self) -> NonFinite | None:
        """The run's first non-finite gradient norm (``None``: none so far); its value and
        count are known when this process saw it (NaN and 0 after a resume)."""
        return self.accounting.first(self.controller.first_nonfinite)

    def summary(self) -> AccountingSummary:
        """The run's accounting now (:class:`~gnmr_dist.distributed.accounting.AccountingSummary`):
        per-unit and per-GEMM recovered steps, non-finite steps (skipped ones included), the
        recovered shares of unit-steps and of linear FLOPs, the first non-finite unit."""
        ctrl = self.controller
        return self.accounting.summary(
            ctrl.step_count, ctrl.recovered, ctrl.nonfinite, self.first_nonfinite
        )

    def _plan_for(self, step: int, active: tuple[int, ...]) -> Plan:
        names = tuple(self.registry.names[i] for i in active)
        # the error term's pacing is fixed at build (uses_errors, error_every): each plan
        # carries whether its step measures, so no layer asks for it per step
        measure = self.uses_errors and step % self.error_every == 0
        return Plan(step=step, active=frozenset(active), names=names, measure_errors=measure)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`snapshot` as one sealed dict of run-state format 3
        (:func:`gnmr_dist.state.write_run`), ``weights_only``-safe: what a caller of the runtime
        hands to ``torch.save``."""
        return write_run(self.snapshot())

    def snapshot(self) -> RunState:
        """The run's state as plain parts: the controller's (with the plan it runs next), the
        unit names, the runtime's accounting and, with ``error_every > 1``, the carried error
        score (``last_errors``), so a resumed run decides as an uninterrupted one between two
        measured steps."""
        # with error_every 1 every step measures, so there is nothing to carry
        errors = self._last_errors if self.uses_errors and self.error_every > 1 else None
        return RunState(
            controller=self.controller.snapshot(),
            unit_names=list(self.registry.names),
            accounting=self.accounting.state(),
            last_errors=None if errors is None else errors.clone(),
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (run-state format 1, 2 or 3) after
        :func:`gnmr_dist.state.read_run` checked all of it: its checksum (a state without one,
        from an earlier release, loads with a warning), the unit names (any layout), the
        controller part, the plan and the accounting. Nothing is restored from a state that
        fails."""
        self.restore(self.read(state))

    def read(self, state: Mapping[str, Any], what: str = "GNMR runtime state") -> RunState:
        """``state`` checked for this runtime's units and window (:func:`~gnmr_dist.state.
        read_run`), not yet restored."""
        window = self.controller.config.window
        return read_run(
            state,
            names=self.registry.names,
            window=window,
            policy_of=GNMRConfig.from_dict,
            what=what,
        )

    def restore(self, run: RunState) -> None:
        """Take over a checked :class:`~gnmr_dist.state.RunState`: the controller (its locks,
        latches and plan fitted to the current policy, :func:`gnmr_dist.state.fit`), the
        accounting and the carried error score; the plan the next step runs is the
        controller's."""
        ctrl = self.controller
        # read_run checked everything before this line: nothing below can refuse, so a
        # refused state leaves the runtime as it was
        ctrl.restore(run.controller)
        self.accounting.load(run.accounting, ctrl.recovered)
        self._last_errors = run.last_errors
        # one plan: the controller's, fitted to today's policy (gnmr_dist.state.fit)
        self.plan = self._plan_for(ctrl.step_count + 1, ctrl.plan)
