"""What a test needs that ``make test`` installs: skipped where it is missing on a developer's
machine, a failure under ``CI=true`` (``.ci/run`` sets it), where a missing pinned dependency
must turn the suite red instead of turning its tests into skips."""

from __future__ import annotations

import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(module: str, reason: str | None = None) -> ModuleType:
    """``pytest.importorskip(module)``, except under CI, where the import error is raised."""
    if in_ci():
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def missing(message: str) -> NoReturn:
    """A tool ``make test`` installs is not there: skip locally, fail under CI."""
    if in_ci():
        pytest.fail(f"{message}; CI must run every check")
    pytest.skip(message)
