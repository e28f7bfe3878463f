"""The fault frequency above which a policy beats the static low-cost path at matched loss
(issue 44's break-even).

A policy ``P`` spends recovery work in every window, faulted or not; it earns only where a fault
damages the low-cost path. Per seed and ``H``-step window (a branch), with ``h`` the held-out
loss after ``H`` steps, ``r`` the trunk's local rate of progress (nats per step, from the
fault-free BF16 branch: ``(h(E) - h(H)) / (H - E)``), ``s`` the share of the linear layers' GEMM
work ``P`` ran on the recovery path and ``c`` its error term's measured cost (a share of a
low-cost step; 0 for an arm without one)::

    D = (h_low(H) - h_P(H)) / r      steps the low-cost path must add to reach P's loss
    a = D / H - s (R - 1) - c        P's advantage: the low-cost path's time to P's loss less
                                     P's time, as a share of the low-cost path's window

where ``R`` is the recovery path's step time over the low-cost path's (2 for BF16 against FP8
on B200, GB300 and Hopper alike: :data:`benchmarks.harness.cost.THROUGHPUT`). A fraction ``phi``
of windows holding a fault gives the mean advantage ``phi a_f + (1 - phi) a_0`` (``f``: the
faulted window, ``0``: the fault-free one at the same seed and point), linear in ``phi``; the
break-even is its root::

    phi* = a_0 / (a_0 - a_f)         when a_0 < 0 < a_f

``0`` when ``P`` pays for itself without faults (``a_0 >= 0``) and "never" when it does not pay
even where every window holds the fault (``a_f <= 0``). It is taken at the means over seeds, with
a 95% interval by the delta method, paired (each seed's ``(a_0, a_f)`` linearized together,
Student-t over seeds). Both ``a`` are linear extrapolations of the local rate, as the cost model
is (:mod:`benchmarks.harness.cost`); ``D`` past the steps the schedule leaves is flagged by the
caller. No torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.stats import interval, t95

__all__ = ["BreakEven", "advantage", "break_even"]


def advantage(
    gap: float, share: float, rate: float, horizon: int, ratio: float = 2.0, error: float = 0.0
) -> float | None:
    """``a = D / H - s (R - 1) - c`` of one window (module docstring); ``gap`` is
    ``h_P(H) - h_low(H)`` (negative where ``P`` is ahead). ``None`` where the rate is not
    positive (no progress to match a nonzero gap at)."""
    if gap != 0 and not rate > 0:
        return None
    # the sign flips: D, the steps the low-cost path adds to reach P's loss, is > 0 where P leads
    extra = 0.0 if gap == 0 else -gap / rate
    return extra / horizon - share * (ratio - 1) - error


@dataclass(frozen=True)
class BreakEven:
    """A policy's break-even fault frequency and what it rests on."""

    free: tuple[float, float]
    """``a_0``: mean and 95% half-width over seeds."""
    fault: tuple[float, float]
    """``a_f``: mean and 95% half-width over seeds."""
    phi: float | None
    """``phi*`` at the means (0: pays without faults; ``None``: never, ``a_f <= 0``)."""
    half: float
    """Its 95% half-width (delta method; NaN where ``phi*`` is 0 or never, or one seed)."""
    seeds: int


def break_even(free: Sequence[float], fault: Sequence[float]) -> BreakEven:
    """``phi*`` from each seed's ``a_0`` (``free``) and ``a_f`` (``fault``), paired by index."""
    if len(free) != len(fault) or not free:
        raise ValueError(f"paired seeds needed, got {len(free)} and {len(fault)}")
    a0, af = statistics.fmean(free), statistics.fmean(fault)
    out = {"free": interval(free), "fault": interval(fault), "seeds": len(free)}
    if a0 >= 0:
        return BreakEven(phi=0.0, half=math.nan, **out)  # type: ignore[arg-type]
    if af <= 0:
        return BreakEven(phi=None, half=math.nan, **out)  # type: ignore[arg-type]
    span = a0 - af
    phi = a0 / span
    d0, df = -af / span**2, a0 / span**2  # d phi / d a_0, d phi / d a_f
    # each seed's (a_0, a_f) linearized together: both come from the same seed's trunk, so their
    # covariance stays in the spread
    lin = [phi + d0 * (x - a0) + df * (y - af) for x, y in zip(free, fault, strict=True)]
    n = len(lin)
    half = math.nan if n < 2 else t95(n - 1) * statistics.stdev(lin) / math.sqrt(n)
    return BreakEven(phi=phi, half=half, **out)  # type: ignore[arg-type]
