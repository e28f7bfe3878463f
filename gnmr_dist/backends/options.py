"""Strict parsing of a backend's ``low_cost`` / ``recovery`` option blocks into dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from gnmr_dist.core.validation import check_keys

__all__ = ["parse_options"]

T = TypeVar("T")


def parse_options(
    cls: type[T],
    given: Mapping[str, Any] | None,
    path: str,
    defaults: Mapping[str, Any] | None = None,
) -> T:
    """``cls(**defaults, **given)`` after rejecting a non-mapping block and unknown keys; a
    ``ValueError`` from ``cls`` keeps ``path``.

    ``cls`` is a dataclass whose ``__post_init__`` validates values and raises ``ValueError``
    messages that start with the field name; they are prefixed with ``path``. ``defaults``
    are the path's own defaults where they differ from the dataclass's (a recovery block).
    """
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"{path} must be a mapping (JSON object) or null, got {given!r}")
    given = dict(given or {})
    check_keys(given, [f.name for f in fields(cls)], path)  # type: ignore[arg-type]
    try:
        return cls(**{**(defaults or {}), **given})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}.{err}") from None
