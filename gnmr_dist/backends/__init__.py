"""Precision backends: the low-cost and recovery paths of each unit, switched per step.

``get_backend(name, low_cost=..., recovery=...)`` builds one by the name used in configs. Each
backend module is imported only when asked for, so a missing optional package (Transformer
Engine) only matters to the backend that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend, StepReport
from gnmr_dist.core.validation import closest

__all__ = ["BACKENDS", "LOW_COST", "RECOVERY", "PrecisionBackend", "StepReport", "get_backend"]

BACKENDS: dict[str, str] = {
    "act_quant": "gnmr_dist.backends.act_quant:ActQuantBackend",
    "fp8_emulated": "gnmr_dist.backends.fp8_emulated:Fp8EmulatedBackend",
    "int8": "gnmr_dist.backends.int8:Int8Backend",
    "te_fp8": "gnmr_dist.backends.te_fp8:TEFp8Backend",
}
"""Config name -> ``module:class`` of every backend."""


def get_backend(
    name: str,
    *,
    low_cost: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
) -> PrecisionBackend:
    """The backend called ``name`` with its ``low_cost`` / ``recovery`` option blocks."""
    if name not in BACKENDS:
        hint = closest(name, BACKENDS)
        did_you_mean = f"; did you mean {hint!r}?" if hint else ""
        raise ValueError(
            f"unknown backend {name!r}{did_you_mean} (available: {', '.join(sorted(BACKENDS))})"
        )
    module_name, cls_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    backend: PrecisionBackend = cls(low_cost=low_cost, recovery=recovery)
    return backend
