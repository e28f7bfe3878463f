"""The controller's policy: budgets, lock, latch, pinned units, window, thresholds and warm-up.

:class:`GNMRConfig` holds only what the controller's maths needs (docs/algorithm.md#policy). The
DeepSpeed ``"gnmr"`` block and the Megatron arguments carry more (backend, units, logging); they
are parsed by the integrations, which hand the policy keys (:meth:`GNMRConfig.field_names`) to
:meth:`GNMRConfig.from_dict`.

Every key added after the first policy defaults to "absent": ``gamma`` (the damage term),
``max_share`` (the compute-share budget), ``latch`` and ``pinned`` default to ``None``, and
``max_active`` is a plain integer unless given a schedule. :meth:`GNMRConfig.to_dict` writes
those keys only when they are set, so the JSON form of every config without them (in traces,
reports and saved controller states) is the same as before they existed, and with all of them
absent every decision is bit-identical to the first policy's.

:meth:`GNMRConfig.at` evaluates everything that moves (thresholds, budgets, conditions) at one
step into a :class:`PolicyAt`, the one object the selection (:mod:`gnmr_dist.core.policy`) reads.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from gnmr_dist.core.schedule import (
    Condition,
    Schedule,
    Threshold,
    check_fraction,
    parse_budget,
    parse_condition,
    parse_optional_threshold,
    parse_threshold,
    threshold_at,
    threshold_to_json,
)
from gnmr_dist.core.validation import (
    check_keys,
    check_nonnegative_int,
    check_positive_int,
)

__all__ = ["GNMRConfig", "LastLayers", "Pinned", "PolicyAt"]

_BUDGET_FORM = (
    ' (or a budget schedule {"schedule": ..., "start": a >= 0, "end": b >= 0, "steps": n}, '
    "k_t = floor of its value)"
)


class PolicyAt(NamedTuple):
    """Every moving part of the policy evaluated at one decision ``t`` (docs/algorithm.md)."""

    alpha: float
    """``alpha_t``."""
    beta: float
    """``beta_t``."""
    gamma: float | None
    """``gamma_t``; ``None`` without the damage term."""
    k: int
    """``k_t = floor(max_active_t)``: at most this many units chosen."""
    share: float | None
    """``s_t = max_share_t``; ``None`` without the compute-share budget."""
    latch: bool
    """Whether the ``latch`` condition holds at ``t`` (False without ``latch``)."""
    pin: bool
    """Whether the ``pinned`` condition holds at ``t`` (False without ``pinned``)."""


@dataclass(frozen=True)
class LastLayers:
    """``{"last_layers": n}``: the units of the model's last ``n`` transformer layers."""

    n: int
    """How many layers, counted back from the highest layer index among the unit names."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_positive_int(self.n, "pinned.units.last_layers"))


def layer_index(name: str) -> int | None:
    """The layer index a unit name carries: its first integer component
    (``model.layers.3.mlp.up_proj`` -> 3), ``None`` when it has none."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


@dataclass(frozen=True)
class Pinned:
    """``{"units": U, "from": condition}``: units on the recovery path whatever their scores
    (docs/algorithm.md#latch-and-pinned-units)."""

    units: str | tuple[str, ...] | LastLayers = "all"
    """``"all"``, glob patterns on unit names (as ``include``), or :class:`LastLayers`."""
    from_: Condition | None = None
    """JSON ``"from"``: from when they are pinned; ``None``: the default ``{"step": 1}``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", _pinned_units(self.units, "pinned.units"))
        if self.from_ is not None:
            object.__setattr__(self, "from_", parse_condition(self.from_, "pinned.from"))

    @property
    def condition(self) -> Condition:
        """The ``"from"`` condition, with its default."""
        return self.from_ if self.from_ is not None else Condition("step", 1)

    def mask(self, names: Sequence[str]) -> list[bool]:
        """Which of the units ``names`` (in id order) ``units`` selects. A pattern matches a
        name or the name followed by ``"."``, as ``include`` does; ``last_layers`` selects the
        units whose :func:`layer_index` is among the ``n`` highest (units without one: none)."""
        if self.units == "all":
            return [True] * len(names)
        if isinstance(self.units, LastLayers):
            layers = [layer_index(n) for n in names]
            top = max((x for x in layers if x is not None), default=None)
            return [x is not None and top is not None and x > top - self.units.n for x in layers]
        pats = self.units
        return [any(fnmatch.fnmatchcase(m, p) for p in pats for m in (n, n + ".")) for n in names]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``"from"`` only when given."""
        units: Any = self.units
        if isinstance(units, LastLayers):
            units = {"last_layers": units.n}
        elif isinstance(units, tuple):
            units = list(units)
        out: dict[str, Any] = {"units": units}
        if self.from_ is not None:
            out["from"] = self.from_.to_dict()
        return out


_UNITS_FORM = '"all", a list of unit-name patterns, or {"last_layers": n}'


def _pinned_units(value: Any, path: str) -> str | tuple[str, ...] | LastLayers:
    if value == "all" or isinstance(value, LastLayers):
        return value  # type: ignore[no-any-return]
    if isinstance(value, Mapping):
        check_keys(value, ("last_layers",), path, required=("last_layers",))
        return LastLayers(check_positive_int(value["last_layers"], f"{path}.last_layers"))
    ok = isinstance(value, list | tuple) and all(isinstance(p, str) and p for p in value)
    if not ok or not value:
        raise ValueError(f"{path} must be {_UNITS_FORM}, got {value!r}")
    return tuple(value)


def parse_pinned(value: Any, path: str) -> Pinned | None:
    """``pinned`` from ``None``, a :class:`Pinned` or its JSON form; errors name ``path``."""
    if value is None or isinstance(value, Pinned):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f'{path} must be null or {{"units": {_UNITS_FORM}, "from": condition}}, got {value!r}'
        )
    check_keys(value, ("units", "from"), path, required=("units",))
    units = _pinned_units(value["units"], f"{path}.units")
    first = value.get("from")
    return Pinned(units, None if first is None else parse_condition(first, f"{path}.from"))


def _parse_max_active(value: Any, path: str) -> int | Schedule:
    if isinstance(value, Schedule | Mapping):
        return parse_budget(value, path, share=False)
    try:
        return check_nonnegative_int(value, path)
    except ValueError as err:
        raise ValueError(f"{err}{_BUDGET_FORM}") from None


def _parse_max_share(value: Any, path: str) -> float | Schedule | None:
    if value is None:
        return None
    if isinstance(value, Schedule | Mapping):
        return parse_budget(value, path, share=True)
    try:
        return check_fraction(value, path)
    except ValueError as err:
        raise ValueError(
            f"{err} (the chosen units' largest share of the units' linear FLOPs; or a budget "
            "schedule with start and end in [0, 1]; or null for no share budget)"
        ) from None


def _parse_latch(value: Any, path: str) -> Condition | None:
    if value is None:
        return None
    try:
        return parse_condition(value, path)
    except ValueError as err:
        raise ValueError(f"{err} (or null: no latch)") from None


@dataclass(frozen=True)
class GNMRConfig:
    """Policy of the GNMR controller (validated on construction; immutable)."""

    max_active: int | Schedule = 4
    """Budget maxO: at most ``k_t`` units are chosen for the recovery path at a step: an
    integer >= 0 (0 observes and scores without ever choosing), or a budget schedule with
    ``k_t = floor(value_t)``."""
    lock_steps: int = 8
    """A selected exceeding unit stays a candidate for this many decisions (>= 0)."""
    window: int = 8
    """Length delta of the short window of past GNMR values used by delta-GNMR (>= 1)."""
    alpha: Threshold = 1.5
    """Threshold on GNMR (long horizon): a number > 0 or a schedule."""
    beta: Threshold = 2.0
    """Threshold on delta-GNMR (short window): a number > 0 or a schedule."""
    warmup_steps: int = 8
    """No unit is a candidate while ``step <= warmup_steps``; the history still fills (>= 0)."""
    gamma: Threshold | None = None
    """Threshold on the backend's error score ``e_t`` (docs/algorithm.md#damage-term): a number > 0,
    a schedule, or ``None`` (the default) to leave the damage-aware term out. When set, every
    :meth:`GNMRController.step` call must pass ``errors``."""
    max_share: float | Schedule | None = None
    """Second budget: the chosen units' largest share of the units' linear-layer FLOPs, in
    ``[0, 1]`` or a budget schedule (docs/algorithm.md#compute-share); ``None``: none. Needs
    the units' costs (``GNMRController(costs=..., total_cost=...)``)."""
    latch: Condition | None = None
    """From when a selected, exceeding unit is held for the rest of the run (a condition,
    docs/algorithm.md#latch-and-pinned-units); ``None``: never."""
    pinned: Pinned | None = None
    """Units on the recovery path whatever their scores, outside both budgets; ``None``: none."""

    def __post_init__(self) -> None:
        p = "gnmr"
        checks = {
            "max_active": _parse_max_active,
            "lock_steps": check_nonnegative_int,
            "window": check_positive_int,
            "warmup_steps": check_nonnegative_int,
            "alpha": parse_threshold,
            "beta": parse_threshold,
            "gamma": parse_optional_threshold,
            "max_share": _parse_max_share,
            "latch": _parse_latch,
            "pinned": parse_pinned,
        }
        for name, check in checks.items():
            object.__setattr__(self, name, check(getattr(self, name), f"{p}.{name}"))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names accepted by :meth:`from_dict`."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], path: str = "gnmr") -> GNMRConfig:
        """Build a config from a JSON-like mapping, rejecting unknown keys and bad values.

        An unknown key raises ``ValueError`` naming it and the closest valid key; a bad value
        raises ``ValueError`` naming the field path (``gnmr.window``) and the allowed range.
        """
        check_keys(config, cls.field_names(), path)
        try:
            return cls(**dict(config))
        except ValueError as err:
            if path == "gnmr":
                raise
            raise ValueError(str(err).replace("gnmr.", f"{path}.", 1)) from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, accepted back by :meth:`from_dict`.

        ``gamma``, ``max_share``, ``latch`` and ``pinned`` are written only when set, so a
        config without them has exactly the JSON form it had before they existed.
        """
        out: dict[str, Any] = {
            "max_active": threshold_to_json(self.max_active)
            if isinstance(self.max_active, Schedule)
            else self.max_active,
            "lock_steps": self.lock_steps,
            "window": self.window,
            "alpha": threshold_to_json(self.alpha),
            "beta": threshold_to_json(self.beta),
            "warmup_steps": self.warmup_steps,
        }
        if self.gamma is not None:
            out["gamma"] = threshold_to_json(self.gamma)
        if self.max_share is not None:
            out["max_share"] = threshold_to_json(self.max_share)
        if self.latch is not None:
            out["latch"] = self.latch.to_dict()
        if self.pinned is not None:
            out["pinned"] = self.pinned.to_dict()
        return out

    def lr_keys(self) -> tuple[str, ...]:
        """The keys on the lr_decay clock: while any is, ``step()`` needs ``lr=``."""
        moving = {
            "max_active": self.max_active,
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "max_share": self.max_share,
            "latch": self.latch,
            "pinned.from": self.pinned.from_ if self.pinned is not None else None,
        }
        return tuple(k for k, v in moving.items() if getattr(v, "on_lr", False))

    def thresholds_at(self, step: int, decay: float | None = None) -> tuple[float, float]:
        """``(alpha_t, beta_t)`` at the 1-based optimizer step ``step`` (and learning-rate
        decay ``decay``, needed on the lr_decay clock)."""
        return threshold_at(self.alpha, step, decay), threshold_at(self.beta, step, decay)

    def gamma_at(self, step: int, decay: float | None = None) -> float | None:
        """``gamma_t`` at the 1-based optimizer step ``step``; ``None`` without the error term."""
        return None if self.gamma is None else threshold_at(self.gamma, step, decay)

    def budget_at(self, step: int, decay: float | None = None) -> int:
        """``k_t = floor(max_active_t)``."""
        if isinstance(self.max_active, int):
            return self.max_active
        return math.floor(self.max_active.at(step, decay))

    def budget_bound(self, step: int) -> int:
        """The most units ``k_t`` can be at ``step`` without knowing the learning rate: ``k_t``
        itself on the step clock, the larger of ``start`` and ``end`` on the lr_decay clock."""
        sched = self.max_active
        if isinstance(sched, int) or not sched.on_lr:
            return self.budget_at(step)
        return math.floor(max(sched.start, sched.end))

    def at(self, step: int, decay: float | None = None) -> PolicyAt:
        """Everything that moves, at the 1-based step ``step`` (module docstring)."""
        alpha, beta = self.thresholds_at(step, decay)
        share = None if self.max_share is None else threshold_at(self.max_share, step, decay)
        return PolicyAt(
            alpha,
            beta,
            self.gamma_at(step, decay),
            self.budget_at(step, decay),
            share,
            self.latch is not None and self.latch.holds(step, decay),
            self.pinned is not None and self.pinned.condition.holds(step, decay),
        )
