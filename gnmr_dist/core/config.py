"""The controller's policy: budget, lock, window, thresholds and warm-up.

:class:`GNMRConfig` holds only what the controller's maths needs (docs/algorithm.md, and the
optional damage-aware term of section 2.1 through ``gamma``). The DeepSpeed ``"gnmr"`` block and
the Megatron arguments carry more (backend, units, logging); they are parsed by the integrations,
which hand the policy keys (:meth:`GNMRConfig.field_names`) to :meth:`GNMRConfig.from_dict`.

``gamma`` defaults to ``None``: the error term is absent and the controller is exactly section 2's.
:meth:`GNMRConfig.to_dict` writes ``gamma`` only when it is set, so the JSON form of every config
without it (in traces, reports and saved controller states) is the same as before section 2.1
existed, and such configs and states keep round-tripping and comparing equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gnmr_dist.core.schedule import (
    Threshold,
    parse_optional_threshold,
    parse_threshold,
    threshold_at,
    threshold_to_json,
)
from gnmr_dist.core.validation import check_keys, check_nonnegative_int, check_positive_int

__all__ = ["GNMRConfig"]


@dataclass(frozen=True)
class GNMRConfig:
    """Policy of the GNMR controller (validated on construction; immutable)."""

    max_active: int = 4
    """Budget maxO: at most this many units run the recovery path at a step (>= 0;
    0 observes and scores without ever recovering)."""
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

    def __post_init__(self) -> None:
        path = "gnmr"
        object.__setattr__(
            self, "max_active", check_nonnegative_int(self.max_active, f"{path}.max_active")
        )
        object.__setattr__(
            self, "lock_steps", check_nonnegative_int(self.lock_steps, f"{path}.lock_steps")
        )
        object.__setattr__(self, "window", check_positive_int(self.window, f"{path}.window"))
        object.__setattr__(
            self, "warmup_steps", check_nonnegative_int(self.warmup_steps, f"{path}.warmup_steps")
        )
        object.__setattr__(self, "alpha", parse_threshold(self.alpha, f"{path}.alpha"))
        object.__setattr__(self, "beta", parse_threshold(self.beta, f"{path}.beta"))
        object.__setattr__(self, "gamma", parse_optional_threshold(self.gamma, f"{path}.gamma"))

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

        ``gamma`` is written only when it is set, so a config without the section 2.1 term has
        exactly the JSON form it had before that term existed.
        """
        out: dict[str, Any] = {
            "max_active": self.max_active,
            "lock_steps": self.lock_steps,
            "window": self.window,
            "alpha": threshold_to_json(self.alpha),
            "beta": threshold_to_json(self.beta),
            "warmup_steps": self.warmup_steps,
        }
        if self.gamma is not None:
            out["gamma"] = threshold_to_json(self.gamma)
        return out

    def thresholds_at(self, step: int) -> tuple[float, float]:
        """``(alpha_t, beta_t)`` at the 1-based optimizer step ``step``."""
        return threshold_at(self.alpha, step), threshold_at(self.beta, step)

    def gamma_at(self, step: int) -> float | None:
        """``gamma_t`` at the 1-based optimizer step ``step``; ``None`` without the error term."""
        return None if self.gamma is None else threshold_at(self.gamma, step)
