"""Threshold schedules for ``alpha_t``, ``beta_t`` and the optional ``gamma_t``.

A threshold is either a positive number or a schedule evaluated at the 1-based optimizer step
``t`` with the progress fraction ``f = min((t - 1) / steps, 1)``:

* ``constant``: ``start`` at every step (``end`` is ignored);
* ``linear``:   ``start + (end - start) * f``;
* ``cosine``:   ``end + (start - end) * (1 + cos(pi * f)) / 2``.

So step 1 uses ``start`` and every step from ``steps + 1`` on uses ``end``. A common use is a
loose threshold early in training, when gradient norms fall fast and every unit looks "risky"
against its short history, tightened as the history becomes representative.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gnmr_dist.core.validation import check_keys, check_positive_int, check_positive_number

__all__ = [
    "Schedule",
    "ScheduleKind",
    "Threshold",
    "parse_optional_threshold",
    "parse_threshold",
    "threshold_at",
    "threshold_to_json",
]


class ScheduleKind(str, enum.Enum):
    """The shape of a threshold schedule."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


@dataclass(frozen=True)
class Schedule:
    """A threshold that moves from ``start`` to ``end`` over ``steps`` optimizer steps."""

    schedule: ScheduleKind | str
    """Shape of the curve: constant, linear or cosine (a name is converted to the enum)."""
    start: float
    """Value at step 1 (must be > 0)."""
    end: float
    """Value from step ``steps + 1`` on (must be > 0)."""
    steps: int
    """Length of the transition in optimizer steps (must be >= 1)."""

    def __post_init__(self) -> None:
        kinds = [k.value for k in ScheduleKind]
        if self.schedule not in kinds:
            raise ValueError(f"schedule must be one of {kinds}, got {self.schedule!r}")
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        object.__setattr__(self, "start", check_positive_number(self.start, "schedule start"))
        object.__setattr__(self, "end", check_positive_number(self.end, "schedule end"))
        object.__setattr__(self, "steps", check_positive_int(self.steps, "schedule steps"))

    def at(self, step: int) -> float:
        """Evaluate the schedule at the 1-based optimizer step ``step``."""
        f = min((step - 1) / self.steps, 1.0)
        if self.schedule is ScheduleKind.CONSTANT:
            return self.start
        if self.schedule is ScheduleKind.LINEAR:
            return self.start + (self.end - self.start) * f
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * f)) / 2.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form accepted by :func:`parse_threshold`."""
        return {
            "schedule": ScheduleKind(self.schedule).value,
            "start": self.start,
            "end": self.end,
            "steps": self.steps,
        }


Threshold = float | Schedule

_SCHEDULE_KEYS = ("schedule", "start", "end", "steps")
_SCHEDULE_FORM = (
    ' or a schedule {"schedule": "constant"|"linear"|"cosine", "start": a, "end": b, "steps": n}'
)


def _parse_schedule(value: Mapping[str, Any], path: str) -> Schedule:
    check_keys(value, _SCHEDULE_KEYS, path, required=_SCHEDULE_KEYS)
    kinds = [k.value for k in ScheduleKind]
    kind = value["schedule"]
    if kind not in kinds:
        raise ValueError(f"{path}.schedule must be one of {kinds}, got {kind!r}")
    return Schedule(
        schedule=kind,
        start=check_positive_number(value["start"], f"{path}.start"),
        end=check_positive_number(value["end"], f"{path}.end"),
        steps=check_positive_int(value["steps"], f"{path}.steps"),
    )


def parse_threshold(value: Any, path: str) -> Threshold:
    """Validate a threshold given as a number, a :class:`Schedule` or a schedule dict.

    Raises ``ValueError`` naming ``path`` and the allowed values when it is malformed.
    """
    if isinstance(value, Schedule):
        return value
    if isinstance(value, Mapping):
        return _parse_schedule(value, path)
    return check_positive_number(value, path, alternative=_SCHEDULE_FORM)


def parse_optional_threshold(value: Any, path: str) -> Threshold | None:
    """Like :func:`parse_threshold`, but ``None`` (JSON ``null``) means "no threshold".

    Used for ``gamma`` (docs/algorithm.md#damage-term), whose absence turns its score term off.
    """
    if value is None or isinstance(value, (Schedule, Mapping)):
        return None if value is None else parse_threshold(value, path)
    return check_positive_number(
        value, path, alternative=_SCHEDULE_FORM + ", or null to leave the term out"
    )


def threshold_at(threshold: Threshold, step: int) -> float:
    """The value of a threshold (number or schedule) at the 1-based step ``step``."""
    if isinstance(threshold, Schedule):
        return threshold.at(step)
    return float(threshold)


def threshold_to_json(threshold: Threshold) -> float | dict[str, Any]:
    """The JSON form of a threshold (a number or a schedule dict)."""
    return threshold.to_dict() if isinstance(threshold, Schedule) else float(threshold)
