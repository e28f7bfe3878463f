"""What every framework integration holds: the runtime, the backend and the skipped-step count.

Also the wiring of docs/algorithm.md#damage-term's error term that every integration shares:
:func:`check_error_source` refuses ``gnmr.gamma`` with a backend that reports no error sums
(before the framework starts), :func:`error_source` turns the backend's measuring on and returns
the ``error_fn`` for :class:`~gnmr_dist.distributed.GNMRRuntime`. :func:`refuse_probe` is the
refusal of ``gnmr.probe`` by the integrations that do not run it (megatron-core).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.core import Decision, GNMRController
from gnmr_dist.core.integrity import open_state, seal
from gnmr_dist.distributed import GNMRRuntime, Plan, UnitRegistry
from gnmr_dist.distributed.monitor import ErrorFn
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.telemetry import TraceHeader, TraceWriter

__all__ = [
    "SUMMED",
    "IntegrationSession",
    "Interval",
    "check_error_source",
    "error_source",
    "open_trace",
    "refuse_probe",
    "telemetry_scalars",
]


def check_error_source(block: GNMRBlock, backend: PrecisionBackend | None) -> None:
    """``ValueError`` when ``gnmr.gamma`` is set and ``backend`` reports no error sums."""
    if block.policy.gamma is None or (backend is not None and backend.reports_errors):
        return
    raise ValueError(
        f"gnmr.gamma is set but gnmr.backend={block.backend!r} reports no per-unit error sums "
        "(the section 2.1 error term; act_quant, fp8_emulated and int8 report them, te_fp8 does "
        "not yet); choose one of those backends or leave gnmr.gamma unset"
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
    if block.policy.gamma is None or backend is None:
        return None
    backend.track_errors(num_units, every=block.error_every)
    return backend.error_sums


SUMMED = ("num_exceed", "num_exceed_eligible", "num_active", "num_nonfinite", "num_error_exceed")
"""The decision counts an :class:`Interval` sums (the others are per-step states)."""


class Interval:
    """What the decisions since the last log add up to, for loggers that log every N steps
    (Trainer's ``logging_steps``): the way Trainer averages its loss over its interval, so a
    spike between two logs shows in the next one.

    :meth:`add` takes each decision, the global gradient norm and the units that *ran* the
    recovery path during that step; :meth:`drain` returns the sums and resets. The entries:
    ``steps`` (decisions), ``step`` (the last controller step), ``max_risk`` (the largest risk of
    the interval), the :data:`SUMMED` counts, ``recovered_unit_steps``, ``global_grad_norm`` (the
    mean), and per recovered unit the steps it ran recovery at.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.steps, self.last_step = 0, 0
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

    def drain(self, names: Sequence[str]) -> tuple[dict[str, float], dict[str, list[int]]]:
        """(scalars, the steps each recovered unit ran recovery at, by name); then reset.
        Empty when no decision came since the last drain."""
        if not self.steps:
            return {}, {}
        scalars = {
            "steps": float(self.steps),
            "step": float(self.last_step),
            "max_risk": self.max_risk,
            **self.sums,
            "recovered_unit_steps": float(sum(len(v) for v in self.recovered.values())),
            "global_grad_norm": self.norm_sum / self.steps,
        }
        scalars.update({f"recovered/{names[u]}": float(len(v)) for u, v in self.recovered.items()})
        steps = {names[u]: list(v) for u, v in sorted(self.recovered.items())}
        self._reset()
        return scalars, steps


def telemetry_scalars(decision: Decision, global_norm: float) -> dict[str, float]:
    """The scalars every integration logs per decision (names without the ``gnmr/`` prefix):
    the decision's :class:`~gnmr_dist.core.decision.Telemetry` counts and the global
    gradient norm."""
    return {**decision.telemetry.as_dict(), "global_grad_norm": float(global_norm)}


def open_trace(
    block: GNMRBlock, registry: UnitRegistry, done: int, **meta: Any
) -> TraceWriter | None:
    """The block's JSON-lines trace (``log.trace``; ``None`` when off), opened on rank 0 by
    every integration: a header with the unit names, eligibility, policy, backend and
    granularity (plus ``meta``), then one record per decision. ``done``: the decisions taken
    before this run's first record; a resumed run drops the records after them."""
    if block.log.trace is None:
        return None
    header = TraceHeader(
        registry.names,
        tuple(registry.eligible.tolist()),
        block.policy,
        {"backend": block.backend, "units": block.units, **meta},
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

    def _apply_plan(self) -> None:
        if self.backend is not None:
            self.backend.apply(self.runtime.plan.active, self.runtime.plan.step)

    def state_dict(self) -> dict[str, Any]:
        """Controller state, unit names, plan and skipped-step count (plain, rank-identical,
        ``weights_only``-safe), sealed with a per-field checksum."""
        return seal({**self.runtime.state_body(), "skipped": self.skipped})

    def reset(self) -> None:
        """Start the controller fresh (``on_missing_state`` / ``on_corrupt_state`` ``"fresh"``)
        and apply its empty plan."""
        self.runtime.reset()
        self.skipped = 0
        self._apply_plan()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (any parallel layout) and apply the restored plan.

        Raises ``ValueError`` when the state does not match its checksum
        (:class:`~gnmr_dist.core.integrity.StateIntegrityError`, naming each altered field) or
        breaks an invariant of the algorithm (naming the entry); nothing is restored then. A
        state without a checksum (an earlier release) loads with a warning.
        """
        body = open_state(state, "GNMR state")
        skipped = body.get("skipped", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"GNMR state is corrupted: skipped={skipped!r} is not a count")
        self.runtime.restore(body)
        self.skipped = skipped
        self._apply_plan()
