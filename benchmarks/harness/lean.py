"""The lean arm's damage term (issue 44): ``e`` against the unit's own usual level, so that
standing damage does not hold the budget.

Under GNMR+e a unit whose low-cost error is always large (in the fault regimes, layer 0's
``v_proj``, ``o_proj`` and ``down_proj``) exceeds ``gamma`` at every step and keeps its place in
the budget for the whole run, whatever the fault does. The lean score counts a unit's damage
only where it rises above what is usual for that unit:

    b_t(u)  = the mean of e_s(u) over the measured steps s < t that were not rises
    rise    = e_t(u) > rho b_t(u)
    e'_t(u) = e_t(u) gamma / max(gamma, rho b_t(u))         (0 while u has no baseline yet)

so that ``e'_t(u) / gamma > 1`` exactly when ``e_t(u) > gamma`` and ``e_t(u) > rho b_t(u)``: the
damage is large and at least ``rho`` times the unit's usual level. A rise does not enter the
baseline, so a fault held for many steps stays a rise for as long as it is held (GNMR's mean
over the whole past would absorb it); a non-finite ``e`` passes unchanged (risk +inf) and stays
out of the baseline. The controller gets ``e'`` in place of ``e`` with the same ``gamma``, lock,
budget and norm terms: only the damage term's meaning changes.

It wraps the controller's ``step`` in the harness (:class:`LeanErrors`), so it is not a policy
option of the library; its baseline lives in the wrapper and starts empty at a branch point (the
trunks run no damage term), like the carried ``e`` of the runtime. docs/benchmarks.md#sweep-faults
(the ablation) says how it was fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LEAN_RISE", "LeanErrors", "lean_errors"]

LEAN_RISE = 4.0
"""``rho``: how many times its usual level a unit's ``e`` must reach to count. Fixed before the
ablation's branches ran, after one look at ``e`` in a single ``outlier_delayed`` branch (seed 7,
point 100, not among the records): the units' ``e`` moved within 1.2-3x of their level outside
the fault (one unit 23x over the branch's first steps), the faulted unit's rose 10-20x; a first
choice of 2 let the fluctuations fill the budget (183 unit-steps of GNMR+e's 196 in a smoke
branch of seed 1234, point 100; 4 there: 146, against the norm terms' 35 of GNMR 4)."""


def lean_errors(
    e: torch.Tensor, base: torch.Tensor, count: torch.Tensor, gamma: float, rise: float
) -> torch.Tensor:
    """``e'`` from ``e`` and the baseline (``base``: the mean, ``count``: how many steps it
    holds); updates ``base`` and ``count`` in place with the steps that are not rises."""
    e = e.to(torch.float64)
    finite = torch.isfinite(e)
    known = count > 0
    out = e * gamma / torch.clamp(rise * base, min=gamma)
    # no baseline yet: nothing says the damage is unusual for the unit, so it counts none
    out = torch.where(known | ~finite, out, torch.zeros_like(out))
    # a non-finite e passes as it is: risk +inf, the unit is recovered whatever its baseline
    out = torch.where(finite, out, e)
    # a rise stays out of the baseline, so a held fault stays a rise (a mean over all steps, as GNMR
    # keeps, would absorb it)
    usual = finite & (~known | (e <= rise * base))
    count += usual.to(count.dtype)
    base += torch.where(usual, (e - base) / count.clamp(min=1).to(base.dtype), 0.0)
    return out


class LeanErrors:
    """The controller's ``step`` with its ``errors`` replaced by the lean score
    (:func:`lean_errors`); ``gamma`` must be a number."""

    def __init__(self, step: Callable[..., Any], units: int, gamma: float, rise: float) -> None:
        if rise <= 1.0:
            raise ValueError(f"the lean arm's rise must be > 1, got {rise}")
        self.inner, self.gamma, self.rise = step, float(gamma), float(rise)
        self.base = torch.zeros(units, dtype=torch.float64)
        self.count = torch.zeros(units, dtype=torch.int64)

    def __call__(self, norms: Any, *, errors: Any = None, lr: float | None = None) -> Any:
        if errors is not None:
            e = torch.as_tensor(errors, dtype=torch.float64).cpu()
            errors = lean_errors(e, self.base, self.count, self.gamma, self.rise)
        return self.inner(norms, errors=errors, lr=lr)
