"""The one verb pair every integration switches with: ``enable(...)`` / ``disable()``.

``enable`` turns an integration on at once and returns something that is also a context
manager: ``with enable(...):`` turns it off again at the end of the block, when that call is
what turned it on (an integration already on stays on). ``disable`` is idempotent. nanochat's
``disable_fp8(model)`` is the model: a reversible switch, not a rebuild.

The verbs of earlier releases (``apply`` / ``remove``, ``attach`` / ``detach``,
``gnmr_dist.deepspeed.enabled()``) are :func:`deprecated` aliases for one release: the same
call, with a ``DeprecationWarning`` naming its successor.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["Enabled", "deprecated"]

F = TypeVar("F", bound=Callable[..., Any])


class Enabled:
    """What an ``enable(...)`` that has no handle of its own returns: the integration is on;
    ``with`` turns it off at exit if ``owned`` (this call turned it on)."""

    def __init__(self, disable: Callable[[], None], owned: bool) -> None:
        self._disable, self.owned = disable, owned

    def __enter__(self) -> Enabled:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.owned:
            self._disable()


def deprecated(old: str, new: str, function: F) -> F:
    """``function`` under its earlier name ``old``: each call warns (``DeprecationWarning``,
    naming ``new``), then calls it. Kept for one release."""

    @functools.wraps(function)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"{old} is deprecated: call {new} (the same arguments: one verb pair, enable / "
            "disable, each enable also a context manager); the alias goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return function(*args, **kwargs)

    return alias  # type: ignore[return-value]
