"""Pure maths and policy of GNMR: scores, schedules, config and the controller.

This layer imports nothing but torch and the standard library; every other layer of gnmr-dist
builds on it and it never imports them.
"""

from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.controller import Decision, GNMRController, Telemetry
from gnmr_dist.core.schedule import Schedule, ScheduleKind
from gnmr_dist.core.scores import ratio, risk_scores

__all__ = [
    "Decision",
    "GNMRConfig",
    "GNMRController",
    "Schedule",
    "ScheduleKind",
    "Telemetry",
    "ratio",
    "risk_scores",
]
