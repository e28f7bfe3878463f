"""Strict parsing of a backend's ``low_cost`` / ``recovery`` option blocks into dataclasses."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from gnmr_dist.core.validation import check_keys

__all__ = ["parse_options"]

T = TypeVar("T")


def parse_options(
    cls: type[T],
    given: Mapping[str, Any] | None,
    path: str,
    defaults: Mapping[str, Any] | None = None,
    *,
    owner: str = "",
) -> T:
    """``cls(**defaults, **given)`` after rejecting a non-mapping block and unknown keys; a
    ``ValueError`` from ``cls`` keeps ``path``.

    ``cls``'s ``__post_init__`` may check values, raising ``ValueError`` messages that start
    with the field name; they are prefixed with ``path``. Every given value is then checked
    against its field's annotation (:func:`_fits`: the built-in scalar types, ``X | None``,
    ``Literal``, and the container kind of ``tuple``, ``list`` and ``dict``), so an own backend
    without a ``__post_init__`` gets the built-ins' strictness: ``"mantissa_bits": "2"`` is
    refused by key, value and type when the backend is built, not in the first forward. ``defaults``
    are the path's own defaults where they differ from the dataclass's (a recovery block).
    ``owner`` names the backend in the message of an unknown key (``"the int8 backend"``), which
    lists its keys or says that the block takes none.
    """
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"{path} must be a mapping (JSON object) or null, got {given!r}")
    given = dict(given or {})
    keys = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    check_keys(given, keys, path, owner=owner)
    try:
        parsed = cls(**{**(defaults or {}), **given})
    except ValueError as err:  # the dataclass's own message, naming the field
        raise ValueError(f"{path}.{err}") from None
    except TypeError as err:  # e.g. __post_init__ compared a str with an int: name the type
        _check_types(cls, given, path)
        raise ValueError(f"{path}.{err}") from None
    _check_types(cls, given, path)
    return parsed


def _check_types(cls: type[Any], given: Mapping[str, Any], path: str) -> None:
    """``ValueError`` naming the key, the value and the annotated type of the first given value
    that does not fit its field's annotation."""
    hints = get_type_hints(cls)
    for key, value in given.items():
        if not _fits(value, hints.get(key, Any)):
            raise ValueError(
                f"{path}.{key}: {value!r} is {type(value).__name__}, expected "
                f"{_describe(hints[key])}"
            )


_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,), type(None): (type(None),)}
"""The Python types a JSON value of each annotated scalar type may have (an int is a float)."""


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (annotations it cannot read: yes)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_fits(value, h) for h in get_args(hint))
    if origin is Literal:
        return value in get_args(hint)
    if hint in _SCALARS:
        ok = isinstance(value, _SCALARS[hint])
        return ok and not (hint in (int, float) and isinstance(value, bool))
    kind = origin or hint
    if kind in (tuple, list):
        return isinstance(value, tuple | list)
    if kind in (dict, Mapping):
        return isinstance(value, Mapping)
    return True


def _describe(hint: Any) -> str:
    """``hint`` as the message names it: ``int``, ``int or None``, ``one of 'a', 'b'``."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(h) for h in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(origin or hint, "__name__", str(hint))
