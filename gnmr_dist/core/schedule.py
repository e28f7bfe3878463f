"""Schedules and conditions: the policy's values that move during a run (docs/algorithm.md).

A *schedule* moves a value from ``start`` to ``end`` along one of four shapes, with a progress
``f`` in ``[0, 1]`` read off one of two clocks:

* the **step** clock (the default): ``f = min(max(t - m, 0) / steps, 1)`` at the 1-based
  optimizer step ``t``, where ``m`` is the optional ``"from"`` (default 1: step 1 uses
  ``start``, every step from ``steps + 1`` on uses ``end``);
* the **lr_decay** clock: ``f = min(max(d_t - p, 0) / (q - p), 1)`` with the learning-rate decay
  ``d_t = 1 - lr_t / max(lr_1..lr_t)`` (0 through warm-up and any constant phase, 1 at lr 0),
  ``"from": p`` (default 0) and ``"to": q`` (default 1); ``steps`` is not allowed.

The shapes: ``constant`` (``start``), ``linear`` (``start + (end - start) f``), ``cosine``
(``end + (start - end) (1 + cos(pi f)) / 2``) and ``step`` (``start`` while ``f < 1``, ``end``
once ``f = 1``). With ``"from"`` at its default the step clock is bit for bit the schedule of
the policy before clocks existed, and :meth:`Schedule.to_dict` writes ``"clock"``, ``"from"``
and ``"to"`` only when given, so old JSON forms are unchanged.

What a schedule may hold depends on what it schedules: a threshold (``alpha``, ``beta``,
``gamma``) is ``> 0`` (:func:`parse_threshold`), a budget (``max_active``, ``max_share``) is
``>= 0``, and ``<= 1`` for a share (:func:`parse_budget`). A *condition* (:class:`Condition`,
for ``latch`` and ``pinned.from``) is ``{"step": m}`` (true from step ``m`` on) or
``{"lr_decay": p}`` (true where ``d_t >= p``).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gnmr_dist.core.validation import (
    check_choice,
    check_keys,
    check_positive_int,
    check_positive_number,
    did_you_mean,
)

__all__ = [
    "Clock",
    "Condition",
    "Schedule",
    "ScheduleKind",
    "Threshold",
    "check_fraction",
    "parse_budget",
    "parse_condition",
    "parse_optional_threshold",
    "parse_threshold",
    "threshold_at",
    "threshold_to_json",
]


class ScheduleKind(str, enum.Enum):
    """The shape of a schedule."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    STEP = "step"


class Clock(str, enum.Enum):
    """What a schedule's progress, or a condition, is measured on."""

    STEP = "step"
    """The 1-based optimizer step ``t``."""
    LR_DECAY = "lr_decay"
    """``d_t = 1 - lr_t / max(lr_1..lr_t)``: how far the learning rate has decayed."""


_KINDS = [k.value for k in ScheduleKind]
_CLOCKS = [c.value for c in Clock]


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` for anything else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value) if math.isfinite(float(value)) else None


def check_fraction(value: Any, path: str, *, below_one: bool = False) -> float:
    """``value`` as a float in ``[0, 1]`` (``[0, 1)`` with ``below_one``), else ``ValueError``."""
    x = _number(value)
    if x is None or x < 0 or x > 1 or (below_one and x == 1):
        bound = "< 1" if below_one else "<= 1"
        raise ValueError(f"{path} must be a number >= 0 and {bound}, got {value!r}")
    return x


@dataclass(frozen=True)
class Schedule:
    """A value that moves from ``start`` to ``end`` over ``steps`` optimizer steps or over a
    stretch of the learning-rate decay (module docstring)."""

    schedule: ScheduleKind | str
    """Shape of the curve: constant, linear, cosine or step (a name is converted to the enum)."""
    start: float
    """Value before the transition (a finite number >= 0; what it schedules may ask more)."""
    end: float
    """Value once the transition is over."""
    steps: int | None = None
    """Length of the transition in optimizer steps (>= 1): required on the step clock and not
    allowed on the lr_decay clock."""
    clock: Clock | str = Clock.STEP
    """``"step"`` (the default) or ``"lr_decay"``."""
    from_: float | None = None
    """JSON ``"from"``: where the transition starts. Step clock: a step ``m >= 1`` (default 1);
    lr_decay clock: a decay ``p`` in ``[0, 1)`` (default 0). ``None``: the default."""
    to: float | None = None
    """JSON ``"to"``, lr_decay clock only: the decay ``q`` in ``(p, 1]`` where the transition
    ends (default 1). ``None``: the default."""

    def __post_init__(self) -> None:
        given = {k: getattr(self, k) for k in ("schedule", "start", "end", "steps", "clock")}
        checked = _checked({**given, "from": self.from_, "to": self.to}, "schedule", " ")
        for key, value in checked.items():
            object.__setattr__(self, "from_" if key == "from" else key, value)

    @property
    def on_lr(self) -> bool:
        """Whether the schedule runs on the lr_decay clock (so the controller needs ``lr``)."""
        return self.clock is Clock.LR_DECAY

    def progress(self, step: int, decay: float | None = None) -> float:
        """``f`` in ``[0, 1]`` at the 1-based step ``step`` (step clock) or at the learning-rate
        decay ``decay`` (lr_decay clock, where it is required)."""
        if self.clock is Clock.STEP:
            first = 1 if self.from_ is None else int(self.from_)
            return min(max(step - first, 0) / self.steps, 1.0)  # type: ignore[operator]
        if decay is None:
            raise ValueError("a schedule on the lr_decay clock needs the decay d_t (lr=)")
        p = 0.0 if self.from_ is None else self.from_
        q = 1.0 if self.to is None else self.to
        return min(max(decay - p, 0.0) / (q - p), 1.0)

    def at(self, step: int, decay: float | None = None) -> float:
        """Evaluate the schedule at the 1-based step ``step`` (and decay ``decay``)."""
        if self.schedule is ScheduleKind.CONSTANT:
            return self.start
        f = self.progress(step, decay)
        if self.schedule is ScheduleKind.LINEAR:
            return self.start + (self.end - self.start) * f
        if self.schedule is ScheduleKind.STEP:
            return self.start if f < 1.0 else self.end
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * f)) / 2.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form accepted back by the parsers; ``steps``, ``clock``, ``from`` and ``to``
        only where they are set, so a step-clock schedule without ``from`` reads as before."""
        out: dict[str, Any] = {
            "schedule": ScheduleKind(self.schedule).value,
            "start": self.start,
            "end": self.end,
        }
        optional: dict[str, Any] = {"steps": self.steps, "from": self.from_, "to": self.to}
        if self.clock is Clock.LR_DECAY:
            optional = {"clock": Clock.LR_DECAY.value, **optional}
        return {**out, **{k: v for k, v in optional.items() if v is not None}}


Threshold = float | Schedule

_SCHEDULE_KEYS = ("schedule", "start", "end", "steps", "clock", "from", "to")
_SCHEDULE_FORM = (
    ' or a schedule {"schedule": "constant"|"linear"|"cosine"|"step", "start": a, "end": b, '
    '"steps": n} (optional "from"; or "clock": "lr_decay" with "from"/"to" instead of "steps")'
)


def _checked(value: Mapping[str, Any], path: str, sep: str = ".") -> dict[str, Any]:
    """The fields of a schedule, validated and normalised (enums, floats, ints), every error
    naming ``path + sep + key``. ``start`` and ``end`` are only checked ``>= 0`` here: what a
    schedule schedules narrows that (:func:`parse_threshold`, :func:`parse_budget`)."""
    out = dict(value)
    kind = getattr(value["schedule"], "value", value["schedule"])
    kind_path = f"{path}.schedule" if sep == "." else path
    out["schedule"] = ScheduleKind(check_choice(kind, _KINDS, kind_path))
    clock = getattr(value.get("clock"), "value", value.get("clock")) or Clock.STEP.value
    out["clock"] = Clock(check_choice(clock, _CLOCKS, f"{path}{sep}clock"))
    for key in ("start", "end"):
        out[key] = _check_nonnegative(value[key], f"{path}{sep}{key}")
    if out["clock"] is Clock.STEP:
        return {**out, **_step_clock(value, path, sep)}
    return {**out, **_lr_clock(value, path, sep)}


def _step_clock(value: Mapping[str, Any], path: str, sep: str) -> dict[str, Any]:
    if value.get("steps") is None:
        raise ValueError(f"{path} is missing required key(s) ['steps'] (the step clock)")
    if value.get("to") is not None:
        raise ValueError(
            f'{path}{sep}to is only allowed with "clock": "lr_decay" (on the step clock the '
            'transition ends at step "from" + "steps"): remove it'
        )
    first = value.get("from")
    return {
        "steps": check_positive_int(value["steps"], f"{path}{sep}steps"),
        "from": None if first is None else check_positive_int(first, f"{path}{sep}from"),
    }


def _lr_clock(value: Mapping[str, Any], path: str, sep: str) -> dict[str, Any]:
    if value.get("steps") is not None:
        raise ValueError(
            f'{path}{sep}steps is not allowed with "clock": "lr_decay" (the transition runs '
            f'over the learning-rate decay from "from" to "to"): remove it'
        )
    first, last = value.get("from"), value.get("to")
    p = 0.0 if first is None else check_fraction(first, f"{path}{sep}from")
    q = 1.0 if last is None else check_fraction(last, f"{path}{sep}to")
    if not p < q:
        raise ValueError(
            f'{path}: "from" ({p}) must be below "to" ({q}) on the lr_decay clock '
            "(0 <= from < to <= 1)"
        )
    return {"steps": None, "from": None if first is None else p, "to": None if last is None else q}


def _parse_schedule(
    value: Mapping[str, Any], path: str, check: Callable[[Any, str], float]
) -> Schedule:
    """A schedule dict checked key by key (``start`` and ``end`` by ``check``), every error
    naming its field under ``path``."""
    check_keys(value, _SCHEDULE_KEYS, path, required=("schedule", "start", "end"))
    check_choice(value["schedule"], _KINDS, f"{path}.schedule")
    check(value["start"], f"{path}.start")
    check(value["end"], f"{path}.end")
    fields = _checked(value, path)
    return Schedule(**{("from_" if k == "from" else k): v for k, v in fields.items()})


def _check_range(schedule: Schedule, path: str, check: Callable[[Any, str], float]) -> Schedule:
    """``schedule`` once ``check(value, path)`` accepts its ``start`` and ``end``."""
    check(schedule.start, f"{path}.start")
    check(schedule.end, f"{path}.end")
    return schedule


def parse_threshold(value: Any, path: str) -> Threshold:
    """Validate a threshold given as a number, a :class:`Schedule` or a schedule dict (every
    value ``> 0``). Raises ``ValueError`` naming ``path`` and the allowed values."""
    if isinstance(value, Schedule):
        return _check_range(value, path, check_positive_number)
    if isinstance(value, Mapping):
        return _parse_schedule(value, path, check_positive_number)
    return check_positive_number(value, path, alternative=_SCHEDULE_FORM)


def parse_optional_threshold(value: Any, path: str) -> Threshold | None:
    """Like :func:`parse_threshold`, but ``None`` (JSON ``null``) means "no threshold".

    Used for ``gamma`` (docs/algorithm.md#damage-term), whose absence turns its score term off.
    """
    if value is None or isinstance(value, Schedule | Mapping):
        return None if value is None else parse_threshold(value, path)
    return check_positive_number(
        value, path, alternative=_SCHEDULE_FORM + ", or null to leave the term out"
    )


def _check_nonnegative(value: Any, path: str) -> float:
    x = _number(value)
    if x is None or x < 0:
        raise ValueError(f"{path} must be a finite number >= 0, got {value!r}")
    return x


def parse_budget(value: Mapping[str, Any] | Schedule, path: str, *, share: bool) -> Schedule:
    """A budget schedule (``max_active``, or ``max_share`` with ``share``): ``start`` and
    ``end`` ``>= 0``, and ``<= 1`` for a share."""
    check = check_fraction if share else _check_nonnegative
    if isinstance(value, Schedule):
        return _check_range(value, path, check)
    return _parse_schedule(value, path, check)


def threshold_at(threshold: Threshold, step: int, decay: float | None = None) -> float:
    """The value of a threshold or budget (number or schedule) at the 1-based step ``step``
    (and the learning-rate decay ``decay``, needed on the lr_decay clock)."""
    if isinstance(threshold, Schedule):
        return threshold.at(step, decay)
    return float(threshold)


def threshold_to_json(threshold: Threshold) -> float | dict[str, Any]:
    """The JSON form of a threshold (a number or a schedule dict)."""
    return threshold.to_dict() if isinstance(threshold, Schedule) else float(threshold)


# ------------------------------------------------------------------------------ conditions


@dataclass(frozen=True)
class Condition:
    """``{"step": m}``: true from step ``m`` on; ``{"lr_decay": p}``: true where ``d_t >= p``."""

    clock: Clock | str
    """``"step"`` or ``"lr_decay"``: the one key of the JSON form."""
    at: float
    """``m`` (an integer >= 1) on the step clock, ``p`` in ``[0, 1]`` on the lr_decay clock."""

    def __post_init__(self) -> None:
        clock = Clock(check_choice(getattr(self.clock, "value", self.clock), _CLOCKS, "condition"))
        object.__setattr__(self, "clock", clock)
        path = f"condition.{clock.value}"
        if clock is Clock.STEP:
            object.__setattr__(self, "at", check_positive_int(self.at, path))
        else:
            object.__setattr__(self, "at", check_fraction(self.at, path))

    @property
    def on_lr(self) -> bool:
        """Whether the condition reads the lr_decay clock (so the controller needs ``lr``)."""
        return self.clock is Clock.LR_DECAY

    def holds(self, step: int, decay: float | None = None) -> bool:
        """Whether the condition is true at step ``step`` (decay ``decay`` on lr_decay)."""
        if self.clock is Clock.STEP:
            return step >= self.at
        if decay is None:
            raise ValueError("a condition on the lr_decay clock needs the decay d_t (lr=)")
        return decay >= self.at

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, ``{"step": m}`` or ``{"lr_decay": p}``."""
        return {Clock(self.clock).value: self.at}


_CONDITION_FORM = '{"step": m} (true from step m on) or {"lr_decay": p} (true once d_t >= p)'


def parse_condition(value: Any, path: str) -> Condition:
    """A :class:`Condition` from itself or its JSON form; ``ValueError`` naming ``path``."""
    if isinstance(value, Condition):
        return value
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ValueError(f"{path} must be a condition, {_CONDITION_FORM}; got {value!r}")
    ((key, at),) = value.items()
    if key not in _CLOCKS:
        raise ValueError(
            f"unknown key {path}.{key}{did_you_mean(str(key), _CLOCKS)} (a condition is "
            f"{_CONDITION_FORM})"
        )
    if key == Clock.STEP.value:
        return Condition(key, check_positive_int(at, f"{path}.step"))
    return Condition(key, check_fraction(at, f"{path}.lr_decay"))
