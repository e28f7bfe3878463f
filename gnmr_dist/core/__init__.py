"""Pure maths and policy of GNMR: scores, schedules, config and the controller.

docs/algorithm.md (GNMR, delta-GNMR, budget, lock, warm-up) and its optional section 2.1
(the damage-aware error term, on with ``GNMRConfig(gamma=...)``).

This layer imports nothing but torch and the standard library; every other layer of gnmr-dist
builds on it and it never imports them.
"""

from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.controller import GNMRController
from gnmr_dist.core.decision import Decision, Telemetry
from gnmr_dist.core.schedule import Schedule, ScheduleKind
from gnmr_dist.core.scores import error_scores, ratio, risk_scores

__all__ = [
    "Decision",
    "GNMRConfig",
    "GNMRController",
    "Schedule",
    "ScheduleKind",
    "Telemetry",
    "error_scores",
    "ratio",
    "risk_scores",
]
