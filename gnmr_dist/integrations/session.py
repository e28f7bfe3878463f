"""What every framework integration holds: the runtime, the backend and the skipped-step count.

Also the wiring of docs/algorithm.md#damage-term's error term that every integration shares:
:func:`check_error_source` refuses ``gnmr.gamma`` with a backend that reports no error sums
(before the framework starts), :func:`error_source` turns the backend's measuring on and returns
the ``error_fn`` for :class:`~gnmr_dist.distributed.GNMRRuntime`. :func:`refuse_probe` is the
refusal of ``gnmr.probe`` by the integrations that do not run it (megatron-core).

And what every integration reports of the run's accounting (docs/telemetry.md#accounting): the
``accounting/*`` scalars of its logger (:class:`AccountingLog`), the trace record's fields
(:func:`trace_fields`) and the end-of-run lines (:func:`summary_lines`,
:meth:`IntegrationSession.summary_lines`, which each integration writes where its console line
goes).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.core import Decision, GNMRController
from gnmr_dist.distributed import AccountingSummary, GNMRRuntime, Plan, UnitRegistry
from gnmr_dist.distributed.accounting import GEMM_ORDER
from gnmr_dist.distributed.monitor import ErrorFn, UnitNorms
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.state import RunState, write_run
from gnmr_dist.telemetry import TraceHeader, TraceWriter

__all__ = [
    "SUMMED",
    "AccountingLog",
    "IntegrationSession",
    "Interval",
    "check_error_source",
    "error_source",
    "open_trace",
    "refuse_probe",
    "summary_lines",
    "telemetry_scalars",
    "trace_fields",
]


def check_error_source(block: GNMRBlock, backend: PrecisionBackend | None) -> None:
    """``ValueError`` when ``gnmr.gamma`` is set and ``backend`` reports no error sums (a block
    read by :meth:`GNMRBlock.from_dict` has refused it already; this guards one built by
    hand)."""
    if block.measure_errors_every is None or (backend is not None and backend.reports_errors):
        return
    raise ValueError(
        f"gnmr.gamma is set but gnmr.backend={block.backend!r} reports no per-unit error sums "
        "(the damage term, docs/algorithm.md#damage-term; act_quant, fp8_emulated, int8 and "
        "te_fp8 report them); choose one of those backends or leave gnmr.gamma unset"
    )


def refuse_probe(block: GNMRBlock, where: str) -> None:
    """``ValueError`` when ``gnmr.probe`` is set: ``where`` (megatron-core) does not run it."""
    if block.probe is None or not block.enabled:
        return
    raise ValueError(
        f"{where}: gnmr.probe is supported under DeepSpeed (gnmr_dist.deepspeed) and the "
        "benchmark harness; megatron-core would need its pipeline schedule run twice more per "
        "probe step (every unit low-cost, then recovery), which is not implemented: drop the "
        "gnmr.probe key"
    )


def error_source(
    block: GNMRBlock, backend: PrecisionBackend | None, num_units: int
) -> ErrorFn | None:
    """The runtime's ``error_fn``: ``backend.error_sums`` with measuring on, or ``None``.

    ``None`` without ``gnmr.gamma`` (nothing is measured, nothing extra is reduced). With it,
    checks the backend (:func:`check_error_source`) and calls
    ``backend.track_errors(num_units, every=block.error_every)``; call it after ``backend.wrap``
    and before training, and give the runtime the same ``error_every``.
    """
    check_error_source(block, backend)
    # the block's fact, decided once when it was read (gamma on, and its pacing)
    every = block.measure_errors_every
    if every is None or backend is None:
        return None
    # the backend measures on the same steps the runtime's plans say (error_every)
    backend.track_errors(num_units, every=every)
    return backend.error_sums


SUMMED = ("num_exceed", "num_exceed_eligible", "num_active", "num_nonfinite", "num_error_exceed")
"""The decision counts an :class:`Interval` sums (the others are per-step states)."""


class Interval:
    """What the decisions since the last log add up to, for loggers that log every N steps
    (Trainer's ``logging_steps``): the way Trainer averages its loss over its interval, so a
    spike between two logs shows in the next one.

    :meth:`add` takes each decision, the global gradient norm and the units that *ran* the
    recovery path during that step; :meth:`skip` each attempt the framework skipped (no
    decision), with its non-finite units; :meth:`drain` returns the sums and resets. The
    entries: ``steps`` (decisions), ``step`` (the last controller step), ``skipped_steps``
    (attempts the framework skipped), ``max_risk`` (the largest risk of the interval), the
    :data:`SUMMED` counts (``num_nonfinite`` also counts the skipped attempts' non-finite units,
    as the run's accounting does), ``recovered_unit_steps``, ``global_grad_norm`` (the mean),
    and per recovered unit the steps it ran recovery at. An interval of skipped attempts only
    has no ``max_risk`` and no ``global_grad_norm``.
    """

    def __init__(self) -> None:
        self.last_step = 0
        self._reset()

    def _reset(self) -> None:
        self.steps, self.skipped = 0, 0
        self.max_risk, self.norm_sum = -math.inf, 0.0
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.recovered: dict[int, list[int]] = {}

    def add(self, decision: Decision, global_norm: float, ran: Collection[int]) -> None:
        """One decision; ``ran``: the units on the recovery path during its step."""
        t = decision.telemetry
        self.steps += 1
        self.last_step = decision.step
        self.max_risk = max(self.max_risk, t.max_risk)
        self.norm_sum += float(global_norm)
        for key in SUMMED:
            self.sums[key] += getattr(t, key)
        for u in ran:
            self.recovered.setdefault(int(u), []).append(decision.step)

    def skip(self, nonfinite: int, step: int) -> None:
        """An attempt the framework skipped, with its ``nonfinite`` units; ``step``: the last
        controller step (the skipped attempt is retried as step ``step + 1``)."""
        self.skipped += 1
        self.last_step = step
        self.sums["num_nonfinite"] += nonfinite

    def drain(self, names: Sequence[str]) -> tuple[dict[str, float], dict[str, list[int]]]:
        """(scalars, the steps each recovered unit ran recovery at, by name); then reset.
        Empty when neither a decision nor a skipped attempt came since the last drain."""
        if not self.steps and not self.skipped:
            return {}, {}
        scalars = {
            "steps": float(self.steps),
            "step": float(self.last_step),
            "skipped_steps": float(self.skipped),
            **self.sums,
            "recovered_unit_steps": float(sum(len(v) for v in self.recovered.values())),
        }
        if self.steps:
            scalars["max_risk"] = self.max_risk
            scalars["global_grad_norm"] = self.norm_sum / self.steps
        scalars.update({f"recovered/{names[u]}": float(len(v)) for u, v in self.recovered.items()})
        steps = {names[u]: list(v) for u, v in sorted(self.recovered.items())}
        self._reset()
        return scalars, steps


def telemetry_scalars(decision: Decision, global_norm: float) -> dict[str, float]:
    """The scalars every integration logs per decision (names without the ``gnmr/`` prefix):
    the decision's :class:`~gnmr_dist.core.decision.Telemetry` counts and the global
    gradient norm."""
    return {**decision.telemetry.as_dict(), "global_grad_norm": float(global_norm)}


class AccountingLog:
    """The run's accounting as logger scalars (names without the ``gnmr/`` prefix), for a
    framework's logger: the totals at every call and, to keep logs small, one entry per unit
    whose count changed since the previous call (so never a zero one)::

        accounting/recovered_unit_steps, accounting/nonfinite_unit_steps,
        accounting/recovered_share, accounting/recovered_flops_share (when the costs are known),
        accounting/recovered_steps/<gemm> (fprop, dgrad, wgrad),
        accounting/first_nonfinite_step, accounting/first_nonfinite_unit (once there is one),
        accounting/recovered/<unit name>, accounting/nonfinite/<unit name> (run totals)

    Every value is a run total, so a resumed run continues the series."""

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def scalars(self, summary: AccountingSummary, names: Sequence[str]) -> dict[str, float]:
        """The scalars of ``summary`` (module docstring of this class)."""
        p = "accounting/"
        out = {
            f"{p}recovered_unit_steps": float(summary.recovered_unit_steps),
            f"{p}nonfinite_unit_steps": float(summary.nonfinite_unit_steps),
            f"{p}recovered_share": summary.recovered_share,
        }
        if summary.recovered_flops_share is not None:
            out[f"{p}recovered_flops_share"] = summary.recovered_flops_share
        for i, g in enumerate(GEMM_ORDER):
            out[f"{p}recovered_steps/{g}"] = float(summary.recovered_gemms[:, i].sum())
        first = summary.first_nonfinite
        if first is not None:
            out[f"{p}first_nonfinite_step"] = float(first.step)
            out[f"{p}first_nonfinite_unit"] = float(first.unit)
        rec, bad = summary.recovered, summary.nonfinite
        last = self._last or (torch.zeros_like(rec), torch.zeros_like(bad))
        for what, now, before in (("recovered", rec, last[0]), ("nonfinite", bad, last[1])):
            for u in torch.nonzero(now != before).flatten().tolist():
                out[f"{p}{what}/{names[u]}"] = float(now[u])
        self._last = (rec, bad)
        return out


def trace_fields(
    runtime: GNMRRuntime, norms: UnitNorms, skipped: Sequence[int] = (), skipped_steps: int = 0
) -> dict[str, Any]:
    """The accounting fields of the trace record of the decision just taken (each only where
    it applies, so other records read as before): ``nonfinite``, the units whose norm was
    non-finite at this step; ``skipped_steps``, how many attempts of this step the framework
    skipped before it (``skipped_steps``, given by the integrations that count them);
    ``skipped_nonfinite``, the non-finite units of those attempts (``skipped``);
    ``first_nonfinite``, on the record of the run's first non-finite event's step,
    ``{"step", "unit", "name", "skipped"}``."""
    out: dict[str, Any] = {}
    decision = runtime.last_decision
    if decision is None:
        return out
    if decision.telemetry.num_nonfinite:
        out["nonfinite"] = torch.nonzero(~torch.isfinite(norms.norms)).flatten().tolist()
    if skipped_steps:
        out["skipped_steps"] = int(skipped_steps)
    if skipped:
        out["skipped_nonfinite"] = sorted(skipped)  # a unit once per skipped attempt
    first = runtime.first_nonfinite if (out or runtime.accounting.skipped_first[0]) else None
    if first is not None and first.step == decision.step:
        out["first_nonfinite"] = first.as_dict()
    return out


def summary_lines(summary: AccountingSummary, names: Sequence[str]) -> list[str]:
    """The end-of-run lines of the accounting (docs/telemetry.md#accounting)::

    gnmr: 120 steps, 14 units: recovered 96 of 1680 unit-steps (5.714%), 4.102% of the
        units' linear FLOPs (fprop 96, dgrad 96, wgrad 96 unit-steps)
    gnmr: non-finite gradient norms in 1 unit-step (1 on steps the framework skipped);
        first at step 12: unit 5 model.layers.0.mlp.down_proj
    """
    s = summary
    flops = (
        f", {100 * s.recovered_flops_share:.3f}% of the units' linear FLOPs"
        if s.recovered_flops_share is not None
        else " (linear FLOPs share unknown: some unit's shapes are not readable)"
    )
    gemms = ", ".join(f"{g} {int(s.recovered_gemms[:, i].sum())}" for i, g in enumerate(GEMM_ORDER))
    lines = [
        f"gnmr: {s.steps} steps, {s.num_units} units: recovered {s.recovered_unit_steps} of "
        f"{s.steps * s.num_units} unit-steps ({100 * s.recovered_share:.3f}%){flops} "
        f"({gemms} unit-steps)"
    ]
    first = s.first_nonfinite
    if first is None:
        lines.append("gnmr: no non-finite gradient norm in the run")
        return lines
    skipped = int(s.skipped_nonfinite.sum())
    where = ", a step the framework skipped" if first.skipped else ""
    lines.append(
        f"gnmr: non-finite gradient norms in {s.nonfinite_unit_steps} unit-steps ({skipped} on "
        f"steps the framework skipped); first at step {first.step}: unit {first.unit} "
        f"{names[first.unit]}{where}"
    )
    return lines


def open_trace(
    block: GNMRBlock, registry: UnitRegistry, done: int, **meta: Any
) -> TraceWriter | None:
    """The block's JSON-lines trace (``log.trace``; ``None`` when off), opened on rank 0 by
    every integration: a header with the unit names, eligibility, policy, backend and
    granularity (plus ``meta``), then one record per decision. ``done``: the decisions taken
    before this run's first record; a resumed run drops the records after them. The header's
    meta also holds ``gemms`` when the block recovers fewer than three, and ``unit_sizes``
    (each unit's ``sum in x out``) when every unit's shapes are readable: with them a replay
    rebuilds the costs ``w = len(gemms) x size``, ``W = 3 x sum size``."""
    if block.log.trace is None:
        return None
    extra: dict[str, Any] = {}
    if len(block.gemms) < len(GEMM_ORDER):
        extra["gemms"] = list(block.gemms)
    if registry.costs() is not None and registry.sizes is not None:
        extra["unit_sizes"] = list(registry.sizes)
    header = TraceHeader(
        registry.names,
        tuple(registry.eligible.tolist()),
        block.policy,
        {"backend": block.backend, "units": block.units, **extra, **meta},
    )
    return TraceWriter(block.log.trace, header, resume_after=done or None)


class IntegrationSession:
    """Base of ``engine.gnmr`` (DeepSpeed) and ``megatron_patches.current()`` (megatron-core)."""

    runtime: GNMRRuntime
    backend: PrecisionBackend | None
    skipped: int

    @property
    def controller(self) -> GNMRController:
        """The controller (identical on every rank)."""
        return self.runtime.controller

    @property
    def plan(self) -> Plan:
        """The plan the current step runs with."""
        return self.runtime.plan

    @property
    def last_decision(self) -> Decision | None:
        """The decision of the last applied optimizer step."""
        return self.runtime.last_decision

    def summary(self) -> AccountingSummary:
        """The run's accounting now (the same on every rank)."""
        return self.runtime.summary()

    def summary_lines(self) -> list[str]:
        """:func:`summary_lines` of the run so far."""
        return summary_lines(self.runtime.summary(), self.runtime.registry.names)

    def _apply_plan(self) -> None:
        if self.backend is not None:
            # the backend switches units at the step boundary, for every micro-batch of the step
            self.backend.apply(self.runtime.plan.active, self.runtime.plan.step)

    def snapshot(self) -> RunState:
        """The runtime's :meth:`~gnmr_dist.distributed.GNMRRuntime.snapshot` with what the
        integration keeps: the skipped-step count and the skipped attempts no trace record
        reported yet (:meth:`_pending`)."""
        return replace(self.runtime.snapshot(), skipped=self.skipped, pending=self._pending())

    def _pending(self) -> tuple[int, list[int]]:
        """``(attempts, non-finite unit ids)`` skipped since the last decision (none here)."""
        return 0, []

    def state_dict(self) -> dict[str, Any]:
        """:meth:`snapshot` as one sealed dict (:func:`gnmr_dist.state.write_run`): plain,
        rank-identical and ``weights_only``-safe, what the integration writes to disk."""
        return write_run(self.snapshot())

    def reset(self) -> None:
        """Start the controller fresh (``on_missing_state`` / ``on_corrupt_state`` ``"fresh"``)
        and apply its empty plan."""
        self.runtime.reset()
        self.skipped = 0
        self._apply_plan()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (any parallel layout) and apply the restored plan.

        Raises ``ValueError`` when the state does not match its checksum
        (:class:`~gnmr_dist.state.StateIntegrityError`, naming each altered field) or breaks an
        invariant of the algorithm (naming the entry); nothing is restored then. A state without
        a checksum (an earlier release) loads with a warning.
        """
        self.restore(self.runtime.read(state, "GNMR state"))

    def restore(self, run: RunState) -> None:
        """Take over a checked run state (:meth:`GNMRRuntime.read`) and apply its plan."""
        self.runtime.restore(run)
        # None: a runtime's own state (no integration count in it)
        self.skipped = run.skipped or 0
        self._apply_plan()
