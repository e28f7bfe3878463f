"""Pure maths and policy of GNMR: scores, schedules, config and the controller.

docs/algorithm.md (GNMR, delta-GNMR, budget, lock, warm-up), its optional damage-aware error
term (``GNMRConfig(gamma=...)``) and the second policy's keys (budget schedules, ``max_share``,
``latch`` and ``pinned``, with :class:`Condition` and :class:`Pinned`).

This layer imports nothing but torch and the standard library; every other layer of gnmr-dist
builds on it and it never imports them.
"""

import warnings
from typing import Any

from gnmr_dist.core.config import GNMRConfig, LastLayers, Pinned
from gnmr_dist.core.controller import GNMRController
from gnmr_dist.core.decision import Decision, Telemetry
from gnmr_dist.core.schedule import Clock, Condition, Schedule, ScheduleKind

_MOVED = ("error_scores", "ratio", "risk_scores")
"""The torch reference of the scores, moved to :mod:`gnmr_dist.testing.scores` (nothing in the
library calls it; the tests check the numpy policy against it). Deprecated aliases here for one
release."""

__all__ = [
    "Clock",
    "Condition",
    "Decision",
    "GNMRConfig",
    "GNMRController",
    "LastLayers",
    "Pinned",
    "Schedule",
    "ScheduleKind",
    "Telemetry",
]


def __getattr__(name: str) -> Any:
    """The deprecated aliases of :data:`_MOVED` (a ``DeprecationWarning``, then the name)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"gnmr_dist.core.{name} moved to gnmr_dist.testing.scores.{name} (the torch reference "
        "the tests check the policy against, not part of the library); this alias goes in the "
        "next release",
        DeprecationWarning,
        stacklevel=2,
    )
    from gnmr_dist.testing import scores  # deprecated bridge, lazily (tests/test_layout.py)

    return getattr(scores, name)
