"""The controller's inputs, checked: per-unit vectors and the eligibility mask.

:func:`unit_vector` turns whatever the caller passes (a tensor on any device, a numpy array, a
sequence of floats) into the float64 host vector the policy reads, and refuses, naming the unit,
anything that is not U real values >= 0 (NaN and +-inf pass: the policy scores them +inf). The
runtime's own float64 CPU tensor is read as a view, with no copy and no conversion, since this
runs at every optimizer step. :func:`error_vector` adds the rule that the damage term's error
scores come exactly when ``gamma`` is set (docs/algorithm.md#damage-term).

The constructor's optional inputs are checked here too: the units' costs and total cost of the
compute-share budget (:func:`unit_costs`) and the pinned mask (:func:`pinned_mask`), and
``step``'s learning rate (:func:`learning_rate`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "NormsLike",
    "costs_from_sizes",
    "eligible_mask",
    "error_vector",
    "learning_rate",
    "pinned_mask",
    "unit_costs",
    "unit_vector",
]

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


def learning_rate(lr: Any, lr_keys: tuple[str, ...]) -> float | None:
    """``lr`` as a finite float >= 0, ``None`` when not given.

    Required while a key runs on the lr_decay clock (``lr_keys``, named in the error); accepted
    and only tracked (its peak) otherwise, so an integration may pass it at every step.
    """
    if lr is None:
        if lr_keys:
            raise ValueError(
                f"gnmr.{lr_keys[0]} runs on the lr_decay clock, so step() needs lr=: the "
                "learning rate the optimizer applied at this step (its first parameter group), "
                "docs/algorithm.md#thresholds-and-schedules"
            )
        return None
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        lr = lr.item()
    ok = isinstance(lr, numbers.Real) and not isinstance(lr, bool)
    if not ok or not math.isfinite(float(lr)) or float(lr) < 0:
        raise ValueError(
            f"lr must be a finite number >= 0 (the learning rate the optimizer applied at this "
            f"step), got {lr!r}"
        )
    return float(lr)


def costs_from_sizes(sizes: Sequence[int], gemms: int = 3) -> tuple[list[int], int]:
    """``(w, W)`` of docs/algorithm.md#compute-share from each unit's size (its linear
    operators' summed ``in x out``): ``w(u) = gemms x size(u)``, the multiply-accumulates per
    token of the ``gemms`` GEMMs a recovery covers, and ``W = 3 x sum size``, the units' whole
    linear work."""
    if isinstance(gemms, bool) or not isinstance(gemms, int) or not 1 <= gemms <= 3:
        raise ValueError(f"a unit's recovery covers 1 to 3 GEMMs, got {gemms!r}")
    sizes = [int(s) for s in sizes]
    return [gemms * s for s in sizes], 3 * sum(sizes)


def unit_costs(costs: Any, total_cost: Any, num_units: int) -> tuple[np.ndarray, int] | None:
    """``(w, W)`` checked: ``w`` int64 [U] of integers >= 1, ``W`` an integer >= ``sum(w)``
    (docs/algorithm.md#compute-share); ``None`` when neither is given."""
    if costs is None and total_cost is None:
        return None
    if costs is None or total_cost is None:
        raise ValueError(
            "costs= and total_cost= come together: costs w(u) (the multiply-accumulates per "
            "token of each unit's recovered GEMMs) and total_cost W (3 x the units' "
            "sum of in x out), docs/algorithm.md#compute-share"
        )
    w = torch.as_tensor(costs).detach().cpu()
    if w.dtype.is_floating_point or w.dtype.is_complex or w.dtype == torch.bool:
        raise ValueError(f"costs must hold integers (w(u) in multiply-accumulates), got {w.dtype}")
    if w.dim() != 1 or w.numel() != num_units:
        raise ValueError(
            f"costs must be a 1-D vector of num_units={num_units} integers, "
            f"got shape {list(w.shape)}"
        )
    if num_units and int(w.min()) < 1:
        unit = int((w < 1).nonzero()[0])
        raise ValueError(f"costs must be integers >= 1, got {int(w[unit])} for unit {unit}")
    out = w.to(torch.int64).numpy().copy()
    total = int(out.sum())
    if isinstance(total_cost, bool) or not isinstance(total_cost, numbers.Integral):
        raise ValueError(f"total_cost must be an integer (W), got {total_cost!r}")
    if int(total_cost) < total:
        raise ValueError(
            f"total_cost ({total_cost}) must be >= sum(costs) ({total}): W counts all three "
            "GEMMs of every unit, w(u) only the recovered ones"
        )
    return out, int(total_cost)


def pinned_mask(pinned: Any, spec_units: Any, num_units: int) -> np.ndarray | None:
    """The bool [U] mask of the pinned units: ``pinned`` as given, all True for
    ``"units": "all"`` when none is given, ``None`` without ``gnmr.pinned`` (``spec_units``
    is the config's ``pinned.units``, or ``None`` when ``pinned`` is unset)."""
    if spec_units is None:
        if pinned is not None:
            raise ValueError(
                "pinned= was given but gnmr.pinned is not set: set gnmr.pinned "
                '({"units": ..., "from": ...}) or stop passing pinned'
            )
        return None
    if pinned is None:
        if spec_units != "all":
            raise ValueError(
                f"gnmr.pinned.units is {spec_units!r}: pass the resolved mask, "
                "GNMRController(..., pinned=config.pinned.mask(unit_names))"
            )
        return np.ones(num_units, dtype=bool)
    try:
        mask = eligible_mask(pinned, num_units)
    except ValueError as err:
        raise ValueError(str(err).replace("eligible", "pinned")) from None
    return mask.numpy()
