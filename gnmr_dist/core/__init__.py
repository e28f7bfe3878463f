"""Pure maths and policy of GNMR: scores, schedules, config and the controller.

docs/algorithm.md (GNMR, delta-GNMR, budget, lock, warm-up), its optional damage-aware error
term (``GNMRConfig(gamma=...)``) and the second policy's keys (budget schedules, ``max_share``,
``latch`` and ``pinned``, with :class:`Condition` and :class:`Pinned`).

This layer imports nothing but torch and the standard library; every other layer of gnmr-dist
builds on it and it never imports them.
"""

from gnmr_dist.core.config import GNMRConfig, LastLayers, Pinned
from gnmr_dist.core.controller import GNMRController
from gnmr_dist.core.decision import Decision, Telemetry
from gnmr_dist.core.schedule import Clock, Condition, Schedule, ScheduleKind
from gnmr_dist.core.scores import error_scores, ratio, risk_scores

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
    "error_scores",
    "ratio",
    "risk_scores",
]
