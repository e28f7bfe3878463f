"""The run state: what a runtime or an integration saves, in one sealed dict (format 3).

A run state holds the controller's part (:mod:`.controller`) and what only the runtime and the
integrations see, each fact once::

    {"format": 3,
     "controller": {controller format 2 without "plan"},
     "unit_names": [global names, in id order],
     "plan_active": [the unit ids on the recovery path for the next step],
     "accounting": {"gemm_steps": int64 [U, 3], "skipped_nonfinite": int64 [U],
                    "skipped_first": int64 [step, unit] or [0, -1]},
     "last_errors": float64 [U]        (gnmr.gamma with error_every > 1: the carried e),
     "skipped": n                      (an integration: optimizer steps the framework skipped),
     "skipped_pending": {"attempts": a, "nonfinite": [unit ids]}
                                       (DeepSpeed: skipped attempts no trace record reported yet),
     "checksum": {...}}                (the one seal, :mod:`.seal`)

Formats 1 and 2 (no ``format`` entry) kept the plan twice, as the controller's ``plan`` and as
``plan_active``, and sealed the controller's part inside the run's seal; :func:`read_run` reads
them: it checks the inner seal, checks ``plan_active`` within the controller's own plan, and
reads ``plan_active`` as the plan (a format-1 controller part has none of its own; its plan is
bounded by the saved integer ``max_active``). A state without ``accounting`` (written before the
runtime counted GEMMs and skipped steps) reads with ``accounting=None``.

:func:`read_run` checks everything before anything is restored, so a refused state leaves the
runtime as it was: the seal, the format, the unit names (another model is a
:class:`~.controller.StateMismatchError`), the controller part (:func:`~.controller.check_state`),
the plan against the controller's locks and latches, then the accounting, the carried error score
and the integration's counts. :func:`write_run` seals a :class:`RunState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gnmr_dist.state.controller import PolicyOf, StateMismatchError, check_state
from gnmr_dist.state.seal import open_state, seal, unseal

__all__ = ["RUN_FORMAT", "RunState", "read_run", "write_run"]

RUN_FORMAT = 3
"""The run state's format (module docstring); 1 and 2 are read too."""

_BIG = 2**62
"""No count bound but the type's (the skipped steps are not counted by the controller)."""

_ACCOUNTING = ("gemm_steps", "skipped_nonfinite", "skipped_first")


@dataclass
class RunState:
    """A run state as plain parts: what :meth:`GNMRRuntime.snapshot
    <gnmr_dist.distributed.GNMRRuntime.snapshot>` hands :func:`write_run`, and what
    :func:`read_run` returns checked."""

    controller: dict[str, Any]
    """The controller's state in format 2, its ``plan`` included (a bool mask)."""
    unit_names: list[str]
    accounting: dict[str, torch.Tensor] | None
    """``gemm_steps``, ``skipped_nonfinite``, ``skipped_first``; ``None``: a state from before
    the runtime's accounting."""
    last_errors: torch.Tensor | None = None
    skipped: int | None = None
    """An integration's skipped optimizer steps (``None``: a runtime's own state)."""
    pending: tuple[int, list[int]] = field(default_factory=lambda: (0, []))
    """DeepSpeed: ``(attempts, non-finite unit ids)`` skipped since the last decision."""


def write_run(run: RunState) -> dict[str, Any]:
    """``run`` as one sealed dict of format 3 (module docstring): the plan once, as
    ``plan_active``; entries that do not apply (no carried error score, no integration, no
    pending attempts) left out, so they read as before they existed."""
    controller = dict(run.controller)
    plan = controller.pop("plan")
    state: dict[str, Any] = {
        "format": RUN_FORMAT,
        "controller": controller,
        "unit_names": list(run.unit_names),
        "plan_active": torch.nonzero(plan).flatten().tolist(),
    }
    if run.accounting is not None:
        state["accounting"] = dict(run.accounting)
    if run.last_errors is not None:
        state["last_errors"] = run.last_errors.clone()
    if run.skipped is not None:
        state["skipped"] = run.skipped
    attempts, units = run.pending
    if attempts:
        state["skipped_pending"] = {"attempts": attempts, "nonfinite": list(units)}
    return seal(state)


def read_run(
    state: Mapping[str, Any],
    *,
    names: tuple[str, ...] | list[str],
    window: int,
    policy_of: PolicyOf,
    gemms: int = 3,
    what: str = "GNMR state",
) -> RunState:
    """The checked :class:`RunState` of a saved run state of format 1, 2 or 3, for a model of
    the units ``names`` and a controller with ``window``; ``policy_of`` reads the saved policy,
    ``gemms`` is the per-GEMM count's width. ``ValueError`` naming the entry otherwise
    (:class:`~.seal.StateIntegrityError` for a broken seal, :class:`~.controller.
    StateMismatchError` for an intact state saved under other settings): nothing is restored
    from a state that fails (module docstring)."""
    body = open_state(state, what)
    run_format = body.get("format")
    if run_format is not None and (isinstance(run_format, bool) or run_format != RUN_FORMAT):
        raise StateMismatchError(
            f"GNMR state has run format {run_format!r}; this gnmr-dist reads run formats 1 to "
            f"{RUN_FORMAT}: resume with the gnmr-dist release that wrote it"
        )
    _check_names(body.get("unit_names", []), names)
    if "controller" not in body or "plan_active" not in body:
        raise ValueError("GNMR state is corrupted: it has no 'controller' or 'plan_active'")
    saved, _ = unseal(body["controller"], f"{what}: its controller part")  # formats 1-2 nest one
    u, legacy = len(names), run_format is None
    # formats 1-2: the controller's own plan is checked with it, and bounds plan_active
    controller = check_state(saved, u, window, policy_of, plan_in_run=not legacy)
    own = controller.pop("plan", None) if controller["version"] == 2 else None
    plan = _saved_plan(body["plan_active"], controller, own)
    controller["plan"] = torch.zeros(u, dtype=torch.bool)
    controller["plan"][list(plan)] = True
    skipped = _count(body.get("skipped", 0), "skipped")
    return RunState(
        controller,
        list(names),
        _accounting(body.get("accounting"), u, gemms, int(controller["step"])),
        _carried_errors(body.get("last_errors"), u),
        skipped,
        _pending(body.get("skipped_pending"), skipped, u),
    )


def _check_names(saved: Any, names: tuple[str, ...] | list[str]) -> None:
    """The saved unit names must be the model's (any parallel layout)."""
    if isinstance(saved, list) and saved == list(names):
        return
    saved = list(saved) if isinstance(saved, list | tuple) else []
    diff = sorted(set(map(str, saved)) ^ set(names))[:5]
    raise StateMismatchError(
        f"GNMR state was saved for {len(saved)} units, this model has {len(names)}; first "
        f"differing names: {diff}; the unit list must match: resume with the model, gnmr.units "
        "and gnmr.include/exclude it was saved with"
    )


def _saved_plan(plan: Any, controller: Mapping[str, Any], own: Any) -> tuple[int, ...]:
    """A saved ``plan_active`` checked against the checked controller part it was decided by:
    distinct unit ids in range, eligible, every lock (and latch) holder among them (the policy
    clears both on every unit outside the plan), and within ``own``, the controller's own plan
    of format 2 (equal to it unless a resume fitted it to a tighter policy, which only drops
    units); a format-1 controller, which has no plan of its own, bounds it by its integer
    ``max_active``."""
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
    holds = (controller["lock"] > 0) | (controller["latched"] > 0)
    held = set(torch.nonzero(holds).flatten().tolist())
    ineligible = [i for i in ids if not bool(controller["eligible"][i])]
    too_many = controller["version"] == 1 and isinstance(max_active, int) and len(ids) > max_active
    if too_many or ineligible or not held <= set(ids):
        raise ValueError(
            f"GNMR state is corrupted: plan_active={list(ids)} does not fit its controller "
            f"(max_active={max_active}, ineligible ids {ineligible}, lock holders {sorted(held)} "
            "must all be active)"
        )
    if own is not None:
        decided = torch.nonzero(own).flatten().tolist()
        if not set(ids) <= set(decided):
            raise ValueError(
                f"GNMR state is corrupted: plan_active={list(ids)} is not within the plan its "
                f"controller decided, {decided}"
            )
    return ids


def _count_vector(value: Any, shape: tuple[int, ...], key: str, bound: int) -> torch.Tensor:
    """A saved count tensor as int64 of ``shape``, each in ``[0, bound]``; ``ValueError``
    naming ``accounting.<key>`` otherwise."""
    ok = isinstance(value, torch.Tensor) and not value.dtype.is_floating_point
    if not ok or value.dtype in (torch.bool,) or value.dtype.is_complex:
        raise ValueError(f"GNMR state is corrupted: accounting.{key} is not an integer tensor")
    if tuple(value.shape) != shape:
        raise ValueError(
            f"GNMR state: accounting.{key} has shape {list(value.shape)}, expected {list(shape)}; "
            "the state was saved for another model"
        )
    out: torch.Tensor = value.detach().to(torch.int64).cpu().clone()
    if out.numel() and (int(out.min()) < 0 or int(out.max()) > bound):
        raise ValueError(
            f"GNMR state is corrupted: accounting.{key} holds a count outside [0, {bound}]"
        )
    return out


def _accounting(saved: Any, u: int, gemms: int, step: int) -> dict[str, torch.Tensor] | None:
    """The runtime's accounting checked: shapes, per-GEMM counts in ``[0, step]``, and a first
    skipped event that agrees with the skipped steps' counts; ``None`` when absent."""
    if saved is None:
        return None
    if not isinstance(saved, Mapping):
        raise ValueError("GNMR state is corrupted: accounting is not a mapping")
    missing = [k for k in _ACCOUNTING if k not in saved]
    if missing:
        raise ValueError(f"GNMR state is corrupted: accounting lacks {missing}")
    gemm_steps = _count_vector(saved["gemm_steps"], (u, gemms), "gemm_steps", step)
    skipped = _count_vector(saved["skipped_nonfinite"], (u,), "skipped_nonfinite", _BIG)
    first = saved["skipped_first"]
    if isinstance(first, torch.Tensor) and first.dtype == torch.int64 and first.numel() == 2:
        at, unit = (int(v) for v in first.tolist())
    else:
        at, unit = -1, -2  # refused below
    unset = at == 0 and unit == -1  # also when an earlier decided step came first
    # a skipped attempt carries the number of the step it retried: at most step + 1
    fits = unset or (1 <= at <= step + 1 and 0 <= unit < u and skipped[unit] > 0)
    if not fits:
        raise ValueError(
            f"GNMR state is corrupted: accounting.skipped_first={[at, unit]} does not agree "
            "with the skipped steps' non-finite counts"
        )
    return {
        "gemm_steps": gemm_steps,
        "skipped_nonfinite": skipped,
        "skipped_first": torch.tensor([at, unit], dtype=torch.int64),
    }


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


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"GNMR state is corrupted: {key}={value!r} is not a count")
    return value


def _pending(value: Any, skipped: int, u: int) -> tuple[int, list[int]]:
    """A saved ``skipped_pending`` entry as ``(attempts, non-finite unit ids)``; ``(0, [])``
    when absent. ``ValueError`` when it does not fit: at most ``skipped`` attempts, each with
    at most every unit once."""
    if value is None:
        return 0, []
    entry = value if isinstance(value, Mapping) else {}
    attempts, units = entry.get("attempts"), entry.get("nonfinite")
    if (
        isinstance(attempts, int)
        and not isinstance(attempts, bool)
        and 1 <= attempts <= skipped
        and isinstance(units, list)
        and len(units) <= attempts * u
        and all(type(i) is int and 0 <= i < u for i in units)
    ):
        return attempts, list(units)
    raise ValueError(
        f"GNMR state is corrupted: skipped_pending={value!r:.120} does not fit "
        f"skipped={skipped!r} and {u} units"
    )
