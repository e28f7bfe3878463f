"""Loss spikes of a branch: a step whose loss departs from the arm's own recent trend, paired
against the BF16 branch on the same batch.

**The paired gap.** An arm's branch and its BF16 branch train on the very same batches, so per
step ``t`` the gap ``d_t = loss_arm_t - loss_BF16_t`` takes out the batch's own difficulty (0.1-0.3
nats from batch to batch at this scale, more than any precision policy moves). What is left is
the arm's excess loss, which grows slowly along a branch as the low-cost path's damage accrues.

**The rule** (:class:`SpikeRule`, parameters and their choice there). Over the trailing window
``W_t`` (the last ``window`` finite gaps before ``t``), with ``m_t = median(W_t)`` and the robust
deviation ``s_t = max(1.4826 * median(|W_t - m_t|), floor)``, step ``t`` is a spike when
``d_t - m_t > k * s_t``, or when the arm's loss is not finite (at any step: a NaN needs no trend).
No finite step is a spike before the window is full. Each spike step counts once, so a departure
that lasts (a level shift of the gap) counts once per step until the median has absorbed it, about
``window // 2`` steps. A step whose BF16 loss is not finite has no gap: no spike, in no window.

**Why median and MAD.** A spike inside the window moves neither (breakdown point 50%), so one
spike does not hide the next. A steadily growing gap is never a spike, whatever its slope ``r``:
the median lags a ramp by ``r (window + 1) / 2`` (5.5 r) while the ramp's own MAD is
``r * window / 4``, a threshold of ``k * 1.4826 * 2.5 r = 22 r``. The rule this replaces (a gap
above 0.1 nats) counted every step of such a ramp past 0.1: the static gap's size, not spikes.

Plain Python (no torch): the report counts from the records.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RULE", "SpikeRule", "gaps", "spike_steps"]

MAD_TO_SD = 1.4826
"""``1 / Phi^-1(3/4)``: the MAD of a normal sample times this estimates its standard deviation."""


@dataclass(frozen=True)
class SpikeRule:
    """A step is a spike when its paired gap exceeds the trailing window's median by more than
    ``k`` robust deviations (module docstring).

    ``k = 6`` is OLMo-core's ``SkipStepOptimizer`` threshold (a step whose loss is more than 6
    standard deviations above the mean of its rolling window is skipped). With a window of 10
    the MAD is itself noisy: on Gaussian gaps the rule fires on about 0.24% of steps by chance
    (simulated), some 0.1 spikes per 50-step branch, which the paired per-seed interval
    (:func:`benchmarks.harness.branch_stats.spike_difference`) carries as noise; the low-cost
    null arm's count shows the chance level on real gaps. ``window = 10`` leaves 40 steps of a
    50-step branch testable and follows a gap that bends within 10 steps. ``floor = 0.005``
    nats: a spike stands at least ``k * floor = 0.03`` nats above the trend, so the BF16 null
    (robust deviation about 1e-4) never spikes on rounding wiggles. The FP4 regimes' gaps move
    by 0.003-0.005 (NVFP4, MXFP4) and 0.016 (per-tensor E2M1) nats per step (1.4826 MAD,
    median over windows): the floor binds in most NVFP4 and MXFP4 windows (a spike there is
    6-9 of their deviations) and rarely in the stress.
    """

    window: int = 10
    """Trailing finite gaps the trend is taken from; no finite step before them is tested."""
    k: float = 6.0
    """Robust deviations above the median (OLMo-core's ``SkipStepOptimizer``: 6)."""
    floor: float = 0.005
    """Least robust deviation (nats): a spike stands at least ``k * floor`` above the trend."""

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window ({self.window}) must be >= 2")
        if self.k <= 0 or self.floor <= 0:
            raise ValueError(f"k ({self.k}) and floor ({self.floor}) must be > 0")

    def __str__(self) -> str:
        return (
            f"a step whose gap to BF16's loss on the same batch exceeds the median gap of the "
            f"previous {self.window} steps by more than {self.k:g} robust deviations (1.4826 MAD, "
            f"at least {self.floor:g} nats), or whose loss is not finite"
        )

    def threshold(self, window: Sequence[float]) -> float:
        """``m + k * max(1.4826 MAD, floor)`` of the trailing gaps ``window``."""
        m = statistics.median(window)
        mad = statistics.median(abs(x - m) for x in window)
        # the floor: a near-flat window (the BF16 null's, ~1e-4) must not call a wiggle a spike
        return m + self.k * max(MAD_TO_SD * mad, self.floor)


RULE = SpikeRule()
"""The rule the branch sweeps' reports count with."""


def gaps(arm: Sequence[float], ref: Sequence[float]) -> list[float]:
    """``d_t = arm_t - ref_t`` per step (the same batches; NaN where either is not finite)."""
    return [
        a - b if math.isfinite(a) and math.isfinite(b) else math.nan
        for a, b in zip(arm, ref, strict=True)
    ]


def spike_steps(arm: Sequence[float], ref: Sequence[float], rule: SpikeRule = RULE) -> list[int]:
    """The steps (0-based, in branch order) of ``arm``'s train losses that are spikes against
    ``ref``'s on the same batches: the arm's non-finite steps and the departures from its trend."""
    trail: deque[float] = deque(maxlen=rule.window)
    out = []
    for t, (a, d) in enumerate(zip(arm, gaps(arm, ref), strict=True)):
        # a non-finite loss is a spike at any step, window full or not: a NaN needs no trend
        if not math.isfinite(a):
            out.append(t)
        # a step whose BF16 loss is not finite has no gap: it neither counts nor enters the trend
        elif math.isfinite(d):
            # judged against the steps before it, then added: the median and MAD resist it, so one
            # spike does not hide the next
            if len(trail) == rule.window and d > rule.threshold(trail):
                out.append(t)
            trail.append(d)
    return out
