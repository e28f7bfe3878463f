"""Validation of a saved controller state before it is loaded.

A checkpoint can be truncated, come from another model (different U), another window length or a
future format. Each of those must fail loudly with what is wrong and what to do, never load into
a controller that then makes silently different decisions.

Beyond keys, shapes and dtypes, a state must satisfy what the algorithm (docs/algorithm.md)
implies of any state it can reach after ``step`` decisions with its saved policy, so that a
hand-edited or otherwise impossible state is refused even where no checksum covers it:

* ``0 <= norm_count(u) <= step`` and ``0 <= window_len(u) <= min(window, step)``;
* ``norm_sum(u)`` finite, ``>= 0``, and 0 where ``norm_count(u) = 0`` (norms are >= 0 and only
  finite ones are recorded);
* the window holds finite scores ``>= 0``, right-aligned: the ``window - window_len(u)`` slots in
  front are 0;
* ``0 <= lock(u) <= lock_steps`` of the saved policy, locks held only by eligible units and by
  at most its ``max_active`` units (step 5 of the policy clears every lock outside ``A``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["StateMismatchError", "check_invariants", "check_state"]

_TENSORS: dict[str, torch.dtype] = {
    "eligible": torch.bool,
    "norm_sum": torch.float64,
    "norm_count": torch.int64,
    "window_buffer": torch.float64,
    "window_len": torch.int64,
    "lock": torch.int64,
}
"""The state's tensors and their dtypes; each of shape ``[num_units]`` but ``window_buffer``,
``[num_units, window]``."""

_KEYS = ("version", "num_units", "step", "config", *_TENSORS)
"""Every key a state must have."""

_FIX = "(is this checkpoint from another model or run? start fresh with a new controller instead)"


class StateMismatchError(ValueError):
    """A readable, intact state saved under other settings (unit count, window, format): not
    corruption, so the fix is the settings it was saved with, not another copy of the file."""


def _expect_tensor(
    state: Mapping[str, Any], key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    value = state[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"GNMR state is corrupted: {key!r} is {type(value).__name__}, not a tensor"
        )
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise StateMismatchError(
            f"GNMR state does not fit: {key!r} is {value.dtype} {list(value.shape)}, "
            f"expected {dtype} {list(shape)} {_FIX}"
        )


def _corrupted(field: str, detail: str) -> ValueError:
    return ValueError(f"GNMR state is corrupted: {field} {detail} {_FIX}")


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0])


def _check_counts(state: Mapping[str, Any], window: int, step: int) -> None:
    count, wlen = state["norm_count"], state["window_len"]
    bad = (count < 0) | (count > step)
    if bool(bad.any()):
        u = _first(bad)
        raise _corrupted(f"norm_count[{u}]", f"= {int(count[u])} is outside [0, step={step}]")
    bad = (wlen < 0) | (wlen > min(window, step))
    if bool(bad.any()):
        u = _first(bad)
        raise _corrupted(
            f"window_len[{u}]",
            f"= {int(wlen[u])} is outside [0, min(window={window}, step={step})]",
        )


def _check_history(state: Mapping[str, Any], window: int) -> None:
    total, count = state["norm_sum"], state["norm_count"]
    bad = ~torch.isfinite(total) | (total < 0) | ((count == 0) & (total != 0))
    if bool(bad.any()):
        u = _first(bad)
        raise _corrupted(
            f"norm_sum[{u}]",
            f"= {float(total[u])!r} with norm_count {int(count[u])} (a sum of recorded norms "
            "is finite, >= 0 and 0 before the first)",
        )
    buf, wlen = state["window_buffer"], state["window_len"]
    slot = torch.arange(window).unsqueeze(0)
    padding = slot < (window - wlen).unsqueeze(1)
    bad = ~torch.isfinite(buf) | (buf < 0) | (padding & (buf != 0))
    if bool(bad.any()):
        u, i = (int(v) for v in bad.nonzero()[0])
        raise _corrupted(
            f"window_buffer[{u}, {i}]",
            f"= {float(buf[u, i])!r} with window_len {int(wlen[u])} (the window holds finite "
            "scores >= 0, right-aligned after zeros)",
        )


def _check_locks(state: Mapping[str, Any], policy: Mapping[str, Any]) -> None:
    lock, eligible = state["lock"], state["eligible"]
    lock_steps, max_active = policy.get("lock_steps"), policy.get("max_active")
    if not isinstance(lock_steps, int) or not isinstance(max_active, int):
        raise _corrupted("config", f"has lock_steps={lock_steps!r}, max_active={max_active!r}")
    bad = (lock < 0) | (lock > lock_steps) | ((lock > 0) & ~eligible)
    if bool(bad.any()):
        u = _first(bad)
        raise _corrupted(
            f"lock[{u}]",
            f"= {int(lock[u])} (locks lie in [0, lock_steps={lock_steps}] and only eligible "
            f"units hold one; unit {u} eligible: {bool(eligible[u])})",
        )
    held = int((lock > 0).sum())
    if held > max_active:
        raise _corrupted("lock", f"is held by {held} units, more than max_active={max_active}")


def check_invariants(state: Mapping[str, Any], window: int) -> None:
    """Raise ``ValueError`` naming the first entry of a (well-shaped) state that no run of the
    algorithm can reach (module docstring)."""
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _corrupted("step", f"= {step!r} is not an integer >= 0")
    _check_counts(state, window, step)
    _check_history(state, window)
    _check_locks(state, state["config"])


def check_state(state: Mapping[str, Any], num_units: int, window: int, version: int) -> None:
    """Raise ``ValueError`` unless ``state`` is a valid state for (``num_units``, ``window``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"GNMR state must be a dict, got {type(state).__name__}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"GNMR state is corrupted or not a GNMR state: missing {missing}")
    if state["version"] != version:
        raise StateMismatchError(
            f"GNMR state has format version {state['version']!r}; this gnmr-dist reads version "
            f"{version}. Use the gnmr-dist release that wrote it, or start fresh."
        )
    if state["num_units"] != num_units:
        raise StateMismatchError(
            f"GNMR state has num_units={state['num_units']}, this controller has {num_units} {_FIX}"
        )
    if not isinstance(state["config"], Mapping):
        raise ValueError(f"GNMR state is corrupted: config is {type(state['config']).__name__}")
    saved_window = state["config"].get("window")
    if saved_window != window:
        raise StateMismatchError(
            f"GNMR state was saved with window={saved_window}, the config has window={window}; "
            "the window length cannot change on resume: set window back to it"
        )
    for key, dtype in _TENSORS.items():
        shape = (num_units, window) if key == "window_buffer" else (num_units,)
        _expect_tensor(state, key, shape, dtype)
    check_invariants(state, window)
