"""Validation of a saved controller state before it is loaded.

A checkpoint can be truncated, come from another model (different U), another window length or a
future format. Each of those must fail loudly with what is wrong and what to do, never load into
a controller that then makes silently different decisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_state"]

_FIX = "(is this checkpoint from another model or run? start fresh with a new controller instead)"


def _expect_tensor(
    state: Mapping[str, Any], key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    value = state[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"GNMR state is corrupted: {key!r} is {type(value).__name__}, not a tensor"
        )
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise ValueError(
            f"GNMR state does not fit: {key!r} is {value.dtype} {list(value.shape)}, "
            f"expected {dtype} {list(shape)} {_FIX}"
        )


def _check_values(state: Mapping[str, Any], window: int) -> None:
    if int(state["step"]) < 0:
        raise ValueError(f"GNMR state is corrupted: step={state['step']} is negative")
    if bool((state["norm_count"] < 0).any() or (state["lock"] < 0).any()):
        raise ValueError("GNMR state is corrupted: negative counts or locks")
    wlen = state["window_len"]
    if bool(((wlen < 0) | (wlen > window)).any()):
        raise ValueError(f"GNMR state is corrupted: window lengths outside [0, {window}]")
    if not bool(
        torch.isfinite(state["norm_sum"]).all() and torch.isfinite(state["window_buffer"]).all()
    ):
        raise ValueError("GNMR state is corrupted: non-finite history values")


def check_state(state: Mapping[str, Any], num_units: int, window: int, version: int) -> None:
    """Raise ``ValueError`` unless ``state`` is a valid state for (``num_units``, ``window``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"GNMR state must be a dict, got {type(state).__name__}")
    keys = (
        "version",
        "num_units",
        "step",
        "config",
        "eligible",
        "norm_sum",
        "norm_count",
        "window_buffer",
        "window_len",
        "lock",
    )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"GNMR state is corrupted or not a GNMR state: missing {missing}")
    if state["version"] != version:
        raise ValueError(
            f"GNMR state has format version {state['version']!r}; this gnmr-dist reads version "
            f"{version}. Use the gnmr-dist release that wrote it, or start fresh."
        )
    if state["num_units"] != num_units:
        raise ValueError(
            f"GNMR state has num_units={state['num_units']}, this controller has {num_units} {_FIX}"
        )
    saved_window = state["config"].get("window") if isinstance(state["config"], Mapping) else None
    if saved_window != window:
        raise ValueError(
            f"GNMR state was saved with window={saved_window}, the config has window={window}; "
            "the window length cannot change on resume: set window back to it"
        )
    u = num_units
    for key, shape, dtype in (
        ("eligible", (u,), torch.bool),
        ("norm_sum", (u,), torch.float64),
        ("norm_count", (u,), torch.int64),
        ("window_buffer", (u, window), torch.float64),
        ("window_len", (u,), torch.int64),
        ("lock", (u,), torch.int64),
    ):
        _expect_tensor(state, key, shape, dtype)
    _check_values(state, window)
