"""Precision backends: the low-cost and recovery paths of each unit, switched per step.

``get_backend(name, low_cost=..., recovery=..., operators=...)`` builds one by the name used in
configs (:data:`BACKENDS`); a backend of your own is a :class:`PrecisionBackend` subclass
decorated with :func:`register_backend` (``docs/backends.md#writing-a-backend``).

The package imports nothing until one of its names is first used: importing a submodule (the
number formats, :mod:`gnmr_dist.backends.numerics`, or the protocol in ``base``) registers no
backend. The first name taken from here imports :mod:`gnmr_dist.backends.builtin`, which
registers the built-in backends. No backend imports its optional package (Transformer Engine)
before it is built, so a missing one only matters to the backend that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gnmr_dist.backends.base import (
        LOW_COST,
        RECOVERY,
        TORCH,
        Operators,
        PrecisionBackend,
        StepReport,
    )
    from gnmr_dist.backends.operators import Gemm, GemmAdapter, ModuleSwitch
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


def __getattr__(name: str) -> Any:
    """A public name, after the built-in backends are registered (PEP 562: called once per
    name, which is then cached in the module's namespace)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gnmr_dist.backends import base, builtin, operators, registry  # noqa: F401 (registers)

    value = next(vars(m)[name] for m in (base, operators, registry) if name in vars(m))
    globals()[name] = value
    return value
