"""Strict validation helpers shared by every config in gnmr-dist.

Every error names the offending field by its full path (``gnmr.alpha.steps``) and the allowed
range, and an unknown key names the closest valid one, so a typo in a 2,000-GPU launch fails in
the first second with a message that says how to fix it.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Collection, Iterable, Mapping
from typing import Any

__all__ = [
    "check_choice",
    "check_keys",
    "check_nonnegative_int",
    "check_positive_int",
    "check_positive_number",
    "did_you_mean",
]


def did_you_mean(
    value: Any, valid: Iterable[str], *, n: int = 1, quote: bool = True, cutoff: float = 0.4
) -> str:
    """``"; did you mean 'x'?"`` for the (up to ``n``) valid names closest to ``value``, or
    ``""`` when none is close or ``value`` is not a string: the one suffix every "unknown name"
    message in gnmr-dist ends its first clause with (``quote=False``: names as file names,
    unquoted; ``cutoff``: difflib's similarity floor).

    Compared without case (``"ACT_QUANT"`` is closest to ``'act_quant'``, a case-only miss
    ranks first), and named as ``valid`` spells them."""
    if not isinstance(value, str):
        return ""
    spelled: dict[str, list[str]] = {}
    for name in valid:
        spelled.setdefault(name.lower(), []).append(name)
    close = difflib.get_close_matches(value.lower(), list(spelled), n=n, cutoff=cutoff)
    matches = [name for low in close for name in spelled[low]][:n]
    if not matches:
        return ""
    return f"; did you mean {', '.join(repr(m) if quote else m for m in matches)}?"


def check_keys(
    given: Mapping[str, Any],
    valid: Collection[str],
    path: str,
    required: Collection[str] = (),
    *,
    owner: str = "",
) -> None:
    """Raise ``ValueError`` for the first unknown or missing key of ``given``.

    ``owner`` names what defines the block's keys (``"the int8 backend"``); the message lists
    the valid keys, or says that the block takes none."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{path} must be a mapping (JSON object), got {type(given).__name__}")
    block = f"{owner}'s {path}" if owner else path
    for key in given:
        if key in valid:
            continue
        if not valid:
            raise ValueError(
                f"unknown key {path}.{key}: {block} takes no keys; remove {path}.{key} (leave "
                f"{path} empty or out)"
            )
        listed = ", ".join(sorted(valid))
        raise ValueError(
            f"unknown key {path}.{key}{did_you_mean(str(key), valid)} (valid keys"
            f"{f' of {block}' if owner else ''}: {listed})"
        )
    missing = [k for k in required if k not in given]
    if missing:
        raise ValueError(f"{path} is missing required key(s) {missing}")


def check_choice(value: Any, allowed: Iterable[str], path: str) -> str:
    """``value`` if it is one of the strings ``allowed`` (listed in their order; a set
    sorted), else ``ValueError`` naming ``path``,
    the choices and (for a near miss) the closest one; a non-string (a list, a dict, a number)
    is refused by the same message, never by a ``TypeError`` from hashing it."""
    choices = sorted(allowed) if isinstance(allowed, set | frozenset) else list(allowed)
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(
        f"{path} must be one of {choices}, got {value!r}{did_you_mean(value, choices)}"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_nonnegative_int(value: Any, path: str) -> int:
    """``value`` as an ``int`` >= 0, else ``ValueError`` naming ``path``."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{path} must be an integer >= 0, got {value!r}")
    return int(value)


def check_positive_int(value: Any, path: str) -> int:
    """``value`` as an ``int`` >= 1, else ``ValueError`` naming ``path``."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{path} must be an integer >= 1, got {value!r}")
    return int(value)


def check_positive_number(value: Any, path: str, alternative: str = "") -> float:
    """``value`` as a finite ``float`` > 0, else ``ValueError`` naming ``path``.

    ``alternative`` names another accepted form in the message (e.g. a schedule).
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{path} must be a finite number > 0{alternative}, got {value!r}")
    return float(value)
