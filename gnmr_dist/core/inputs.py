"""The controller's inputs, checked: per-unit vectors and the eligibility mask.

:func:`unit_vector` turns whatever the caller passes (a tensor on any device, a numpy array, a
sequence of floats) into the float64 host vector the policy reads, and refuses, naming the unit,
anything that is not U real values >= 0 (NaN and +-inf pass: the policy scores them +inf). The
runtime's own float64 CPU tensor is read as a view, with no copy and no conversion, since this
runs at every optimizer step. :func:`error_vector` adds the rule that the damage term's error
scores come exactly when ``gamma`` is set (docs/algorithm.md#damage-term).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["NormsLike", "eligible_mask", "error_vector", "unit_vector"]

NormsLike = torch.Tensor | Sequence[float] | Any

_VECTORS = {
    "norms": ("per-unit norms", "they are L2 norms"),
    "errors": ("per-unit error scores", "they are error magnitudes, docs/algorithm.md#damage-term"),
}
"""What each input vector is called in the error messages, and why it must be >= 0."""


def unit_vector(values: NormsLike, num_units: int, name: str) -> np.ndarray:
    """``values`` as a float64 host vector of ``num_units`` entries >= 0 (non-finite allowed).

    ``name`` is ``"norms"`` or ``"errors"``, which the error messages say.
    """
    x = _fast_vector(values, num_units)
    if x is None:
        x = _checked_vector(values, num_units, name)
    if not x.min() >= 0:  # one pass (False for NaN too); the rare cases are looked at closely
        negative = (x < 0) & np.isfinite(x)
        if negative.any():
            unit = int(np.flatnonzero(negative)[0])
            why = _VECTORS[name][1]
            raise ValueError(f"{name} must be >= 0 ({why}); got {float(x[unit])!r} for unit {unit}")
    return x


def error_vector(
    errors: NormsLike | None, gamma: float | None, num_units: int
) -> np.ndarray | None:
    """The error scores as a host vector while ``gamma`` is set, ``None`` while it is not.

    Missing errors with ``gamma`` set, or errors without it, raise ``ValueError`` naming
    ``gnmr.gamma``: a wiring mistake cannot silently turn the term on or off.
    """
    if gamma is None:
        if errors is not None:
            raise ValueError(
                "step() got errors but gnmr.gamma is not set: set gnmr.gamma (a number > 0 "
                "or a schedule) to score them (docs/algorithm.md#damage-term), or stop "
                "passing errors"
            )
        return None
    if errors is None:
        raise ValueError(
            "gnmr.gamma is set, so step() needs errors=: one error score per unit at every "
            "step (carry the last measured values forward between probe steps), or set "
            "gnmr.gamma to null to leave the error term out"
        )
    return unit_vector(errors, num_units, "errors")


def eligible_mask(eligible: NormsLike | None, num_units: int) -> torch.Tensor:
    """A bool CPU tensor of ``num_units`` (all True for ``None``), from booleans or 0/1."""
    if eligible is None:
        return torch.ones(num_units, dtype=torch.bool)
    mask = torch.as_tensor(eligible).detach().cpu()
    if mask.dim() != 1 or mask.numel() != num_units:
        raise ValueError(
            f"eligible must be a 1-D mask of length num_units={num_units}, "
            f"got shape {list(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("eligible must hold booleans (or 0/1)")
        mask = mask.to(torch.bool)
    return mask.clone()


def _fast_vector(values: NormsLike, num_units: int) -> np.ndarray | None:
    """The float64 host vector itself when ``values`` already is one of ``num_units`` entries
    (what the runtime passes: no copy, no conversion); ``None`` for anything else."""
    if isinstance(values, torch.Tensor):
        ok = values.dtype == torch.float64 and values.device.type == "cpu"
        if ok and values.dim() == 1 and values.numel() == num_units:
            return values.detach().numpy()
        return None
    if (
        isinstance(values, np.ndarray)
        and values.dtype == np.float64
        and values.shape == (num_units,)
    ):
        return values
    return None


def _checked_vector(values: NormsLike, num_units: int, name: str) -> np.ndarray:
    """The general path of :func:`unit_vector`: any tensor, array or sequence."""
    what = _VECTORS[name][0]
    x = _as_tensor(values, name)
    if x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if x.dim() != 1 or x.numel() != num_units:
        raise ValueError(
            f"{name} must be a 1-D vector of num_units={num_units} {what}, "
            f"got shape {list(x.shape)}"
        )
    return x.to(device="cpu", dtype=torch.float64).numpy()


def _as_tensor(values: NormsLike, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach()
    if isinstance(values, Sequence) and any(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must hold real numbers, got booleans: {list(values)[:8]}")
    try:
        if hasattr(values, "dtype"):  # an array keeps its dtype, so a complex one is refused
            return torch.as_tensor(values)
        # Python floats must not pass through torch's float32 default dtype on the way in.
        return torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a 1-D vector of real numbers: {err}") from None
