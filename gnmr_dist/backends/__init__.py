"""Precision backends: the low-cost and recovery paths of each unit, switched per step.

``get_backend(name, low_cost=..., recovery=...)`` builds one by the name used in configs
(:data:`BACKENDS`, in :mod:`gnmr_dist.backends.registry`). Each backend module is imported only
when asked for, so a missing optional package (Transformer Engine) only matters to the backend
that needs it.
"""

from __future__ import annotations

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend, StepReport
from gnmr_dist.backends.registry import (
    BACKENDS,
    backend_class,
    get_backend,
    registered_operator_types,
)

__all__ = [
    "BACKENDS",
    "LOW_COST",
    "RECOVERY",
    "PrecisionBackend",
    "StepReport",
    "backend_class",
    "get_backend",
    "registered_operator_types",
]
