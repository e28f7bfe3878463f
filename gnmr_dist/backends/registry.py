"""The registry of backends: config name -> class, and what every unit registry needs of them.

A backend is registered under its config name (``gnmr.backend``) by decorating its class::

    from gnmr_dist.backends import PrecisionBackend, register_backend

    @register_backend("my_fp8")
    class MyFp8Backend(PrecisionBackend):
        ...

in any package, gnmr-dist's own backends included: importing the module that defines the class
registers it (a user's package is imported by the user's training script before the engine is
built). :func:`get_backend`, the config validation, the integrations' unit registries
(:func:`registered_operator_types`) and the backend contract tests (``tests/backends``) all read
:data:`BACKENDS`.

A backend module must not import an optional package (Transformer Engine) at module level:
:func:`registered_operator_types` reads every registered class, also on hosts that cannot run
it; the backend imports its package when it is built.

This module imports no backend: the built-in ones are registered by
:mod:`gnmr_dist.backends.builtin`, which :mod:`gnmr_dist.backends` imports when one of its names
is first used (``from gnmr_dist.backends import get_backend``).
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from gnmr_dist.backends.base import TORCH, Operators, PrecisionBackend
from gnmr_dist.core.validation import did_you_mean

__all__ = [
    "BACKENDS",
    "backend_class",
    "get_backend",
    "register_backend",
    "registered_operator_types",
]

BACKENDS: dict[str, type[PrecisionBackend]] = {}
"""Config name -> class of every registered backend (:func:`register_backend`)."""

B = TypeVar("B", bound="type[PrecisionBackend]")


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make the backend class available as ``gnmr.backend = name``.

    Sets the class's ``name``. A second class under a taken name is refused (a ``ValueError``
    naming both), so two packages cannot silently shadow each other; registering the same
    class again (a module reloaded) is a no-op.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_backend: the name must be an identifier, got {name!r}")

    def register(cls: B) -> B:
        held = BACKENDS.get(name)
        same = held is not None and (held.__module__, held.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if held is not None and not same:
            raise ValueError(
                f"register_backend: {name!r} is already {held.__module__}.{held.__qualname__}; "
                f"choose another name for {cls.__module__}.{cls.__qualname__}"
            )
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return register


ENTRY_POINT_GROUP = "gnmr_dist.backends"
"""The entry-point group an installed package names its backend modules in, e.g. in its
``pyproject.toml``: ``[project.entry-points."gnmr_dist.backends"] mine = "my_pkg.backend"``."""


OWN_BACKEND_HINT = (
    "a backend of your own registers with @gnmr_dist.backends.register_backend in a module that "
    "the programs import with --import MODULE (Megatron: --gnmr-import), or that your package "
    f"names in the entry-point group {ENTRY_POINT_GROUP!r}"
)
"""How an unknown backend name is fixed: the end of every "unknown backend" message."""


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Import, once per process, every module an installed package names in
    :data:`ENTRY_POINT_GROUP` (importing it registers its backends): an own backend then runs
    under the shipped programs with no flag and no ``PYTHONPATH``."""
    loaded = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except Exception as err:  # a broken plug-in is named, not skipped
            raise ImportError(
                f"entry point {point.name} = {point.value!r} (group {ENTRY_POINT_GROUP!r}) "
                f"failed to import: {type(err).__name__}: {err}"
            ) from err
        loaded.append(point.value)
    return tuple(loaded)


def backend_class(name: str) -> type[PrecisionBackend]:
    """The class registered as ``name`` (the installed plug-ins loaded first when needed)."""
    if name not in BACKENDS:
        load_entry_points()
    if name not in BACKENDS:
        raise ValueError(
            f"unknown backend {name!r}{did_you_mean(name, BACKENDS)} "
            f"(available: {', '.join(sorted(BACKENDS))}; {OWN_BACKEND_HINT})"
        )
    return BACKENDS[name]


def get_backend(
    name: str,
    *,
    low_cost: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
    operators: Operators = TORCH,
    gemms: Iterable[str] | None = None,
) -> PrecisionBackend:
    """The backend called ``name`` with its ``low_cost`` / ``recovery`` option blocks, the
    integration's ``operators`` (default: plain torch) and the GEMMs a recovered unit recovers
    (``gemms``, ``gnmr.gemms``; ``None``: all three; set through
    :meth:`~gnmr_dist.backends.base.PrecisionBackend.set_gemms`, which refuses a subset the
    backend cannot run)."""
    backend = backend_class(name)(low_cost=low_cost, recovery=recovery, operators=operators)
    if gemms is not None:
        backend.set_gemms(gemms)
    return backend


def registered_operator_types() -> frozenset[str]:
    """Every registered backend's
    :attr:`~gnmr_dist.backends.base.PrecisionBackend.operator_types`.

    What the integrations add to their framework's operator types when they build a
    :class:`~gnmr_dist.distributed.UnitRegistry`, whatever the backend (``None`` included:
    observe only), so that the units of a model, their ids and names never depend on the backend
    a run chose (a unit no backend of the run switches is found all the same, and is
    ineligible).
    """
    load_entry_points()
    return frozenset().union(*(cls.operator_types for cls in BACKENDS.values()))
