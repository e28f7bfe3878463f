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
it; the backend imports its package when it is built. An installed plug-in whose module fails to
import all the same breaks only the runs that name its backends (:func:`load_entry_points`).

This module imports no backend: the built-in ones are registered by
:mod:`gnmr_dist.backends.builtin`, which :mod:`gnmr_dist.backends` imports when one of its names
is first used (``from gnmr_dist.backends import get_backend``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gnmr_dist.backends.base import TORCH, Operators, PrecisionBackend
from gnmr_dist.core.validation import did_you_mean

__all__ = [
    "BACKENDS",
    "BrokenPlugin",
    "backend_class",
    "broken_plugins",
    "get_backend",
    "register_backend",
    "registered_operator_types",
    "unknown_backend",
]

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point of :data:`ENTRY_POINT_GROUP` whose module failed to import."""

    entry: str
    """The entry point's name (``my_rounded`` in ``my_rounded = "my_pkg.backend"``)."""
    module: str
    """What it names (``"my_pkg.backend"``)."""
    package: str
    """The installed distribution that declares it (``"my-pkg 0.1"``; ``"?"``: unknown)."""
    error: str
    """The import's exception, ``"ModuleNotFoundError: No module named 'x'"``."""
    backends: tuple[str, ...] = ()
    """Backends the module registered before it failed (unregistered again: a half-imported
    module is not run)."""

    def describe(self) -> str:
        """One clause naming the entry point, its package, its module and the error."""
        return (
            f"entry point {self.entry} = {self.module!r} (group {ENTRY_POINT_GROUP!r}, package "
            f"{self.package}) failed to import: {self.error}"
        )

    def provides(self, name: str) -> bool:
        """Whether this plug-in is known to provide backend ``name``: it registered it before
        failing, or its entry point carries the name."""
        return name in self.backends or name == self.entry


_BROKEN: list[BrokenPlugin] = []


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Import, once per process, every module an installed package names in
    :data:`ENTRY_POINT_GROUP` (importing it registers its backends): an own backend then runs
    under the shipped programs with no flag and no ``PYTHONPATH``. Returns the modules that
    imported.

    A module that fails to import breaks no run that does not use it: it is logged once, as a
    warning naming the entry point, its package, the module and the error, and kept in
    :func:`broken_plugins`; the backends it registered before failing are unregistered. A block
    that names its backend is refused with that error (:func:`unknown_backend`).
    """
    loaded = []
    _BROKEN.clear()
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        before = set(BACKENDS)
        try:
            point.load()
        except Exception as err:  # a broken plug-in is named, and breaks only its own runs
            added = tuple(sorted(set(BACKENDS) - before))
            for name in added:
                del BACKENDS[name]
            broken = BrokenPlugin(
                point.name, point.value, _package(point), f"{type(err).__name__}: {err}", added
            )
            _BROKEN.append(broken)
            logger.warning(
                "gnmr: %s; its backends are unavailable: a block that names one is refused with "
                "this error, other runs go on without it (their units are found without its "
                "operator types, docs/backends.md#writing-a-backend); fix or uninstall %s",
                broken.describe(),
                broken.package,
            )
            continue
        loaded.append(point.value)
    return tuple(loaded)


def _package(point: importlib.metadata.EntryPoint) -> str:
    """``"name version"`` of the distribution that declares ``point`` (``"?"``: unknown)."""
    dist = point.dist
    return "?" if dist is None else f"{dist.name} {dist.version}"


def broken_plugins() -> tuple[BrokenPlugin, ...]:
    """The entry points of :data:`ENTRY_POINT_GROUP` that failed to import (after loading them
    once, :func:`load_entry_points`)."""
    load_entry_points()
    return tuple(_BROKEN)


def unknown_backend(name: str, path: str = "gnmr.backend", *, null: bool = False) -> str:
    """The message refusing backend ``name`` that no module registered: an installed plug-in
    that provides it but failed to import leads it with its import error; otherwise the
    closest registered name, the available ones (``null``: and ``null``), how an own backend
    registers, and every plug-in that failed to import (it may be the one)."""
    broken = broken_plugins()
    known = [b for b in broken if b.provides(name)]
    head = f"{path}: " if path else ""
    if known:
        return (
            f"{head}backend {name!r} comes from an installed plug-in that failed to import: "
            f"{known[0].describe()}; fix that package (its missing dependency, or reinstall "
            f"it) or choose another backend (available: {', '.join(sorted(BACKENDS))})"
        )
    available = ", ".join(sorted(BACKENDS)) + (", or null to observe only" if null else "")
    message = (
        f"{head}unknown backend {name!r}{did_you_mean(name, BACKENDS)} (available: "
        f"{available}; {OWN_BACKEND_HINT})"
    )
    if broken:
        failed = "; ".join(b.describe() for b in broken)
        message += f"; it may come from a plug-in that failed to import: {failed}"
    return message


def backend_class(name: str) -> type[PrecisionBackend]:
    """The class registered as ``name`` (the installed plug-ins loaded first when needed)."""
    if name not in BACKENDS:
        load_entry_points()
    if name not in BACKENDS:
        raise ValueError(unknown_backend(name, ""))
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
    ineligible). That is why every installed plug-in is imported here, for every run; one that
    fails to import is skipped with its warning (:func:`load_entry_points`), and its operator
    types are then missing on this host: a unit of a type only it names is not found, and a
    resume of a checkpoint saved where it imported refuses the other unit list by name
    (docs/backends.md#writing-a-backend).
    """
    load_entry_points()
    return frozenset().union(*(cls.operator_types for cls in BACKENDS.values()))
