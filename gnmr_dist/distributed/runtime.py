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

An optional check (``check_consistency=True``) proves that claim at run time: one all-gather of a
hash of each rank's decision, and a ``RuntimeError`` naming the ranks that disagree. It costs a
second collective per step, so it is meant for bring-up and tests, not for production runs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gnmr_dist.core import Decision, GNMRConfig, GNMRController
from gnmr_dist.core.integrity import open_state, seal
from gnmr_dist.core.state import StateMismatchError
from gnmr_dist.distributed.comm import Group, all_gather_objects
from gnmr_dist.distributed.monitor import ErrorFn, GradFn, GradNormMonitor, UnitNorms
from gnmr_dist.distributed.units import UnitRegistry

__all__ = ["GNMRRuntime", "Plan", "check_same_decision", "decision_digest"]

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

    def __contains__(self, unit: object) -> bool:
        return unit in self.active


def decision_digest(decision: Decision) -> str:
    """A short hash of everything a decision consists of (step, sets and risk bits)."""
    h = hashlib.sha256()
    h.update(repr((decision.step, decision.active, decision.candidates)).encode())
    h.update(decision.risk.numpy().tobytes())
    return h.hexdigest()[:16]


def _check_error_source(error_fn: ErrorFn | None, monitor: GradNormMonitor) -> None:
    """With ``gnmr.gamma`` set: an error source that reports, or a ``ValueError`` saying why not."""
    if error_fn is None:
        raise ValueError(
            "gnmr.gamma is set, so the runtime needs per-unit error sums "
            "(docs/algorithm.md#damage-term): "
            "pass error_fn=backend.error_sums after backend.track_errors(registry.num_units), "
            "with a precision backend that reports them (act_quant, fp8_emulated, int8); without "
            "one (no backend, or te_fp8) leave gnmr.gamma unset"
        )
    if error_fn(monitor.device) is None:
        raise ValueError(
            "gnmr.gamma is set but the precision backend reports no error sums (its error_sums "
            "returned None; te_fp8 does not report them yet): use act_quant, fp8_emulated or "
            "int8, or leave gnmr.gamma unset"
        )


def check_same_decision(decision: Decision, group: Group | None) -> None:
    """Raise ``RuntimeError`` naming the ranks whose decision differs from rank 0's."""
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
    ) -> None:
        if isinstance(error_every, bool) or not isinstance(error_every, int) or error_every < 1:
            raise ValueError(f"gnmr.error_every must be an integer >= 1, got {error_every!r}")
        self.error_every = error_every
        self._last_errors: torch.Tensor | None = None
        self.registry = registry
        self.controller = controller or GNMRController(
            registry.num_units, config, eligible=registry.eligible
        )
        self.uses_errors = self.controller.config.gamma is not None
        self.monitor = GradNormMonitor(
            registry,
            group=group,
            grad_fn=grad_fn,
            error_scale=error_scale,
            error_fn=error_fn if self.uses_errors else None,
        )
        if self.uses_errors:
            _check_error_source(error_fn, self.monitor)
        if self.controller.num_units != registry.num_units:
            raise ValueError(
                f"controller has {self.controller.num_units} units, "
                f"the registry {registry.num_units}"
            )
        self.check_group = check_group if check_group is not None else group
        self.check_consistency = check_consistency
        self.plan = Plan(step=self.controller.step_count + 1, active=frozenset(), names=())
        self.last_decision: Decision | None = None
        self.last_norms: UnitNorms | None = None

    def reset(self) -> None:
        """Start afresh: a new controller history, no carried error score, an empty plan."""
        self.controller.reset()
        self._last_errors = None
        self.plan = Plan(step=1, active=frozenset(), names=())

    def errors_due(self) -> bool:
        """Whether the step being scored now carries measured error sums (``gnmr.gamma`` set
        and the step a multiple of ``error_every``): the ``with_errors`` of the monitor."""
        step = self.controller.step_count + 1
        return self.uses_errors and step % self.error_every == 0

    def step(self) -> Decision:
        """Score this step's gradients (one all-reduce) and set the plan for the next step."""
        return self.observe(self.monitor.compute(with_errors=self.errors_due()))

    def observe(self, norms: UnitNorms) -> Decision:
        """Feed already-reduced norms to the controller and publish the next plan.

        With ``gnmr.gamma`` set, ``norms.error_sums`` must hold the reduced ``B(u)`` on the steps
        :meth:`errors_due` names; the controller gets ``errors = B / G``
        (:meth:`UnitNorms.relative_errors`), on the other steps the last one.
        """
        if not self.uses_errors:
            decision = self.controller.step(norms.norms)
        else:
            if not self.errors_due():  # carried (error_every); sums reduced anyway aren't measured
                errors = self._last_errors
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
            self._last_errors = errors
            decision = self.controller.step(norms.norms, errors=errors)
        if self.check_consistency:
            check_same_decision(decision, self.check_group)
        self.last_norms, self.last_decision = norms, decision
        self.plan = self._plan_for(decision.step + 1, decision.active)
        if decision.active:
            logger.debug("step %d: recovery for %s", decision.step, self.plan.names)
        return decision

    def _plan_for(self, step: int, active: tuple[int, ...]) -> Plan:
        return Plan(
            step=step, active=frozenset(active), names=tuple(self.registry.names[i] for i in active)
        )

    def state_dict(self) -> dict[str, Any]:
        """Controller state plus the unit names and the current plan (``weights_only``-safe),
        sealed with a per-field checksum (:mod:`gnmr_dist.core.integrity`); with
        ``error_every > 1`` also the carried error score (``last_errors``), so a resumed run
        decides as an uninterrupted one between two measured steps."""
        return seal(self.state_body())

    def state_body(self) -> dict[str, Any]:
        """:meth:`state_dict` without its checksum, for a layer that seals a larger state."""
        state: dict[str, Any] = {
            "controller": self.controller.state_dict(),
            "unit_names": list(self.registry.names),
            "plan_active": sorted(self.plan.active),
        }
        if self.uses_errors and self.error_every > 1 and self._last_errors is not None:
            state["last_errors"] = self._last_errors.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after checking its checksum (a state without one, from
        an earlier release, loads with a warning); the units must be the same (any layout)."""
        body = open_state(state, "GNMR runtime state")
        self.restore(body)

    def restore(self, state: Mapping[str, Any]) -> None:
        """Restore an already verified :meth:`state_body`: unit names, then the controller
        (its own checksum and invariants), then the plan, checked against the controller."""
        names = state.get("unit_names", [])
        if not isinstance(names, list) or names != list(self.registry.names):
            names = list(names) if isinstance(names, list | tuple) else []
            diff = sorted(set(map(str, names)) ^ set(self.registry.names))[:5]
            raise StateMismatchError(
                f"GNMR state was saved for {len(names)} units, this model has "
                f"{self.registry.num_units}; first differing names: {diff}. The unit list must "
                "match (same model, granularity and include/exclude patterns)."
            )
        if "controller" not in state or "plan_active" not in state:
            raise ValueError("GNMR state is corrupted: it has no 'controller' or 'plan_active'")
        saved, before = state["controller"], self.controller.state_dict()
        self.controller.load_state_dict(saved)
        try:
            active = _saved_plan(state["plan_active"], saved)
            errors = _carried_errors(state.get("last_errors"), self.registry.num_units)
        except ValueError:
            self.controller.load_state_dict(before)  # nothing is restored from a bad state
            raise
        self._last_errors = errors
        self.plan = self._plan_for(self.controller.step_count + 1, self._conformed(active))

    def _conformed(self, active: tuple[int, ...]) -> tuple[int, ...]:
        """The saved plan under the current policy (a resume may lower ``max_active`` or change
        the eligible units): the controller's lock holders first, then the other saved units
        that are still eligible, at most ``max_active``; unchanged when the policy is."""
        ctrl, locks = self.controller, self.controller.locks
        held = [u for u in active if int(locks[u]) > 0]
        rest = [u for u in active if u not in held and bool(ctrl.eligible[u])]
        room = max(0, ctrl.config.max_active - len(held))
        return tuple(sorted(held + rest[:room]))


def _saved_plan(plan: Any, controller: Mapping[str, Any]) -> tuple[int, ...]:
    """A saved ``plan_active`` checked against the saved controller it was decided by: distinct
    unit ids in range, eligible, at most ``max_active``, and every lock holder among them (the
    policy clears the lock of every unit outside the active set)."""
    u = int(controller["num_units"])
    if not isinstance(plan, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in plan
    ):
        raise ValueError(f"GNMR state is corrupted: plan_active={plan!r:.80} is not a list of ids")
    ids = tuple(sorted(plan))
    bad = [i for i in ids if not 0 <= i < u]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"GNMR state is corrupted: plan_active={list(plan)} holds ids outside [0, {u}) or "
            "twice; is this state from another model?"
        )
    max_active = controller["config"]["max_active"]
    held = set(torch.nonzero(controller["lock"] > 0).flatten().tolist())
    ineligible = [i for i in ids if not bool(controller["eligible"][i])]
    if len(ids) > max_active or ineligible or not held <= set(ids):
        raise ValueError(
            f"GNMR state is corrupted: plan_active={list(ids)} does not fit its controller "
            f"(max_active={max_active}, ineligible ids {ineligible}, lock holders {sorted(held)} "
            "must all be active)"
        )
    return ids


def _carried_errors(saved: Any, num_units: int) -> torch.Tensor | None:
    """A saved ``last_errors`` as float64 [U] (``None``: none saved, e.g. ``error_every = 1``):
    real, one per unit, each >= 0 or non-finite (a non-finite score scores +inf)."""
    if saved is None:
        return None
    if not isinstance(saved, torch.Tensor) or saved.dtype.is_complex or saved.dtype == torch.bool:
        raise ValueError(
            f"GNMR state is corrupted: last_errors is not a real tensor ({saved!r:.60})"
        )
    errors = saved.detach().to(torch.float64).flatten().clone()
    if errors.numel() != num_units:
        raise ValueError(
            f"GNMR state: last_errors holds {errors.numel()} values for {num_units} units; the "
            "state was saved for another model"
        )
    negative = (errors < 0) & torch.isfinite(errors)
    if bool(negative.any()):
        unit = int(negative.nonzero()[0])
        raise ValueError(
            f"GNMR state is corrupted: last_errors[{unit}] = {float(errors[unit])} < 0"
        )
    return errors
