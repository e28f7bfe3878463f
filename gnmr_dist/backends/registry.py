"""The registry of backends: config name -> class, and what every unit registry needs of them.

A new backend is one module plus one line in :data:`BACKENDS`; :func:`get_backend`, the config
validation, the integrations' unit registries (:func:`registered_operator_types`) and the
backend contract tests (``tests/backends``) all read it from here.

A backend module is imported only when its class is asked for, and must not import an optional
package (Transformer Engine) at module level: :func:`registered_operator_types` reads every
registered class, also on hosts that cannot run it, and the backend imports its package when it
is built.

This module imports no backend (nor :mod:`gnmr_dist.backends.base`) at module level, so
``base`` can use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gnmr_dist.core.validation import did_you_mean
from gnmr_dist.distributed.units import MEGATRON_LINEARS

if TYPE_CHECKING:
    from gnmr_dist.backends.base import PrecisionBackend

__all__ = ["BACKENDS", "backend_class", "get_backend", "registered_operator_types"]

BACKENDS: dict[str, str] = {
    "act_quant": "gnmr_dist.backends.act_quant:ActQuantBackend",
    "fp8_emulated": "gnmr_dist.backends.fp8_emulated:Fp8EmulatedBackend",
    "int8": "gnmr_dist.backends.int8:Int8Backend",
    "te_fp8": "gnmr_dist.backends.te_fp8:TEFp8Backend",
}
"""Config name -> ``module:class`` of every backend."""


def backend_class(name: str) -> type[PrecisionBackend]:
    """The class registered as ``name`` (its module imported now; no optional package is)."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown backend {name!r}{did_you_mean(name, BACKENDS)} "
            f"(available: {', '.join(sorted(BACKENDS))})"
        )
    module_name, cls_name = BACKENDS[name].split(":")
    cls: type[PrecisionBackend] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def get_backend(
    name: str,
    *,
    low_cost: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
) -> PrecisionBackend:
    """The backend called ``name`` with its ``low_cost`` / ``recovery`` option blocks."""
    return backend_class(name)(low_cost=low_cost, recovery=recovery)


def registered_operator_types() -> frozenset[str]:
    """megatron-core's parallel linears and every registered backend's
    :attr:`~gnmr_dist.backends.base.PrecisionBackend.operator_types`.

    What the integrations pass to :meth:`~gnmr_dist.distributed.UnitRegistry.from_model`
    whatever the backend (``None`` included: observe only), so that the units of a model, their
    ids and names never depend on the backend a run chose (a unit no backend of the run
    switches is found all the same, and is ineligible).
    """
    declared = (backend_class(name).operator_types for name in BACKENDS)
    return MEGATRON_LINEARS.union(*declared)
