"""Checksums of saved GNMR states: a state that was altered after it was written never loads.

``torch.load`` checks no CRC and a pickled state carries no checksum, so a flipped bit in a
saved window buffer, norm sum or lock loads as a *different* controller that then decides
differently, with no error. :func:`seal` therefore adds one entry to a state dict,

    state["checksum"] = {"algorithm": "sha256", "fields": {path: hexdigest, ...}}

with one SHA-256 digest per leaf (``"controller.window_buffer"``, ``"unit_names"``, ...), taken
over the leaf's *canonical bytes*: for a tensor its dtype, its shape and its elements' bytes in
row-major order (so the digest does not depend on strides, device or the pickle's layout); for
a list its items in order; for a number, string, bool or ``None`` its type and ``repr``. Keys are
walked in sorted order. :func:`unseal` recomputes every digest and raises
:class:`StateIntegrityError` naming each leaf that is missing, was added, or no longer matches,
so the message says which field is wrong.

A state is sealed once, by the one object whose ``state_dict()`` a caller hands to ``torch.save``
(:mod:`gnmr_dist.state`): the parts inside it are plain. Formats 1 and 2 of a run state nested the
controller's own seal inside the run's; such an inner ``checksum`` entry is a leaf of the outer
seal like any other, and :func:`gnmr_dist.state.run.read_run` checks it too.

Cost: one pass over the state's bytes per save and per load (a few kilobytes for U units and a
window of W: ``U * (W + 5)`` numbers), nothing per training step.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["CHECKSUM_KEY", "StateIntegrityError", "open_state", "seal", "unseal"]

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "checksum"
_ALGORITHM = "sha256"


class StateIntegrityError(ValueError):
    """A saved state that does not match its own checksum (or whose checksum is unreadable)."""


def _canonical(value: Any) -> bytes:
    """The bytes a leaf's digest is taken over (module docstring)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        head = f"tensor:{t.dtype}:{list(t.shape)}:".encode()
        return head + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(value, list | tuple):
        parts = [_canonical(v) for v in value]
        return f"{type(value).__name__}:{len(parts)}:".encode() + b"".join(
            len(p).to_bytes(8, "little") + p for p in parts
        )
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return b"dict:" + b"".join(_canonical([str(k), v]) for k, v in items)
    if value is None or isinstance(value, bool | int | float | str):
        return f"{type(value).__name__}:{value!r}".encode()
    raise TypeError(f"cannot checksum a {type(value).__name__} in a GNMR state")


def _leaves(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of every non-mapping value, the mappings walked in key order;
    a nested ``checksum`` entry is a leaf (what a lower layer sealed)."""
    for key in sorted(state, key=str):
        value, path = state[key], f"{prefix}{key}"
        if isinstance(value, Mapping) and key != CHECKSUM_KEY:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _digests(state: Mapping[str, Any]) -> dict[str, str]:
    return {
        path: hashlib.sha256(_canonical(value)).hexdigest()
        for path, value in _leaves({k: v for k, v in state.items() if k != CHECKSUM_KEY})
    }


def seal(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (a copy of its top level) with a fresh ``checksum`` entry over every leaf."""
    fields = _digests(state)
    out = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    out[CHECKSUM_KEY] = {"algorithm": _ALGORITHM, "fields": fields}
    return out


def _saved_fields(entry: Any, what: str) -> dict[str, str]:
    """The ``fields`` of a checksum entry, or :class:`StateIntegrityError` if it is malformed."""
    ok = isinstance(entry, Mapping) and entry.get("algorithm") == _ALGORITHM
    fields = entry.get("fields") if ok else None
    if not isinstance(fields, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in fields.items()
    ):
        raise StateIntegrityError(f"{what}: its checksum entry is unreadable ({entry!r:.120})")
    return dict(fields)


def unseal(state: Mapping[str, Any], what: str) -> tuple[dict[str, Any], bool]:
    """``(state without its checksum, whether it had one)``, after checking every digest.

    Raises :class:`StateIntegrityError` naming each leaf that is missing, unexpected or altered.
    A state without a ``checksum`` entry (written before gnmr-dist sealed its states) is
    returned as it is with ``False``: the caller decides how loudly to accept it.
    """
    if not isinstance(state, Mapping):
        raise StateIntegrityError(f"{what} must be a dict, got {type(state).__name__}")
    body = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    if CHECKSUM_KEY not in state:
        return body, False
    saved = _saved_fields(state[CHECKSUM_KEY], what)
    try:
        now = _digests(body)
    except TypeError as err:
        raise StateIntegrityError(f"{what}: {err}") from None
    problems = [f"{p} is missing" for p in sorted(saved.keys() - now.keys())]
    problems += [f"{p} was added" for p in sorted(now.keys() - saved.keys())]
    problems += [
        f"{p} was altered" for p in sorted(saved.keys() & now.keys()) if saved[p] != now[p]
    ]
    if problems:
        raise StateIntegrityError(
            f"{what} does not match its checksum: {'; '.join(problems)}. The file changed after "
            "it was written (storage or transfer corruption, a partial copy, a hand edit)"
        )
    return body, True


def open_state(state: Mapping[str, Any], what: str) -> dict[str, Any]:
    """:func:`unseal`, logging a warning for a state without a checksum (an earlier release's,
    which the caller's shape and invariant checks still cover)."""
    body, sealed = unseal(state, what)
    if not sealed:
        logger.warning(
            "%s has no checksum (written before gnmr-dist sealed its states): loaded after the "
            "shape and invariant checks only",
            what,
        )
    return body
