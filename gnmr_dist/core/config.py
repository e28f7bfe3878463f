"""The controller's policy: budget, lock, window, thresholds and warm-up.

:class:`GNMRConfig` holds only what the controller's maths needs (DESIGN.md section 2). The
DeepSpeed ``"gnmr"`` block and the Megatron arguments carry more (backend, units, logging); they
are parsed by the integrations, which hand the policy keys to :meth:`GNMRConfig.from_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gnmr_dist.core.schedule import Threshold, parse_threshold, threshold_at, threshold_to_json
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
        """The JSON form, accepted back by :meth:`from_dict`."""
        return {
            "max_active": self.max_active,
            "lock_steps": self.lock_steps,
            "window": self.window,
            "alpha": threshold_to_json(self.alpha),
            "beta": threshold_to_json(self.beta),
            "warmup_steps": self.warmup_steps,
        }

    def thresholds_at(self, step: int) -> tuple[float, float]:
        """``(alpha_t, beta_t)`` at the 1-based optimizer step ``step``."""
        return threshold_at(self.alpha, step), threshold_at(self.beta, step)
