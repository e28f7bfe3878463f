"""Precision backends: the low-cost and recovery paths of each unit, switched per step.

``get_backend(name, low_cost=..., recovery=..., operators=...)`` builds one by the name used in
configs (:data:`BACKENDS`). The built-in backends are registered here; a backend of your own is a
:class:`PrecisionBackend` subclass decorated with :func:`register_backend` (``docs/backends.md``).
No backend imports its optional package (Transformer Engine) before it is built, so a missing
one only matters to the backend that needs it.
"""

from __future__ import annotations

from gnmr_dist.backends import act_quant, fp8_emulated, int8, te_fp8  # noqa: F401 (registers)
from gnmr_dist.backends.base import LOW_COST, RECOVERY, Gemm, PrecisionBackend, StepReport
from gnmr_dist.backends.operators import TORCH, GemmAdapter, ModuleSwitch, Operators
from gnmr_dist.backends.registry import (
    BACKENDS,
    backend_class,
    get_backend,
    register_backend,
    registered_operator_types,
)

__all__ = [
    "BACKENDS",
    "LOW_COST",
    "RECOVERY",
    "TORCH",
    "Gemm",
    "GemmAdapter",
    "ModuleSwitch",
    "Operators",
    "PrecisionBackend",
    "StepReport",
    "backend_class",
    "get_backend",
    "register_backend",
    "registered_operator_types",
]
