"""Faults as real models have them (issue 44): an outlier's magnitude and onset, and an outlier
whose gradient the optimizer, the clip and the monitor see.

:class:`benchmarks.harness.arms.Outlier` rises ``x growth`` per step for ``rise`` steps and holds.
:class:`ShapedOutlier` adds the three onsets of the magnitude x onset grid, each reaching the
magnitude ``peak = 2^m`` (:data:`ONSETS`):

- ``instant``: ``f_t = 2^m`` from the window's first step;
- ``rise``: ``x4`` per step, capped at ``2^m`` (the present ``RISE``: 2^20 after 10 steps);
- ``slow``: ``f_t = 2^floor(m (k + 1) / emerge)`` for ``k < emerge`` steps into the window, then
  ``2^m``: the outlier emerges over ``emerge`` (at least 200) steps, as outliers grow in long
  FP8 runs, one doubling every ``emerge / m`` steps.

Every factor is a power of two, so the function-preserving outlier stays exact on a path whose
GEMM inputs keep 8 exponent bits.

**Gradient-visible** (``visible``). The function-preserving outlier computes
``y = (x D)(W D^-1)^T`` with the trained parameter ``W``: autograd takes ``V = W D^-1``'s
gradient ``G_V = dy^T (x D)`` through the division, so ``W`` receives ``G_W = G_V D^-1``, the
gradient of the model without the outlier, and its norm never sees it. A model whose small
column is itself the trained parameter (``V``) receives ``G_V``: column ``c`` is ``f_t`` times
``G_W``'s. With ``visible`` the division passes the gradient through unchanged
(:class:`PassGradient`), so ``W.grad = G_V``: GNMR's monitor, the global norm the clip uses and
the error sums ``B(u)`` (taken on the GEMM's own weight operand, not rescaled) all see the
gradient such a model has. What the optimizer sees: that clipped ``G_V``, stepped on ``W``.
AdamW normalizes per element, so column ``c`` moves about as far per step in ``W``'s units as a
``V``-trained column would in ``V``'s (a ``V``-trained model's function would move ``f_t`` times
faster in that column); the clip, whose global norm the column now dominates, shrinks every
other parameter's step. So the fault changes training in every arm, BF16 included: a visible
cell has its own BF16 branches, where a function-preserving cell shares the fault-free ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.harness.arms import Outlier, OutlierPlan

__all__ = ["ONSETS", "WINDOW", "PassGradient", "ShapedOutlier", "ShapedPlan", "shaped_plan"]

ONSETS = ("instant", "rise", "slow")
"""The grid's onsets (module docstring)."""

WINDOW = 35
"""The instant and rising outliers' window (steps): the present ``RISE``'s (10 + 25)."""

RISE_GROWTH = 4.0
"""The rising onset's growth per step (the present ``RISE``)."""


def _power_of_two(x: float) -> bool:
    return x > 0 and math.log2(x).is_integer()


@dataclass(frozen=True)
class ShapedOutlier(Outlier):
    """An :class:`Outlier` capped at ``peak``, or emerging over ``emerge`` steps, and maybe
    gradient-visible (module docstring)."""

    peak: float = 0.0
    """The magnitude the factor never exceeds (a power of two; 0: no cap)."""
    emerge: int = 0
    """Steps over which the factor emerges from 1 to ``peak`` (0: ``growth`` and ``rise``)."""
    visible: bool = False
    """``W.grad`` is ``V = W D^-1``'s gradient (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peak and not _power_of_two(self.peak):
            raise ValueError(f"outlier {self.module}: peak must be a power of two, got {self.peak}")
        if self.emerge < 0 or (self.emerge and not self.peak):
            raise ValueError(f"outlier {self.module}: emerge ({self.emerge}) needs a peak")

    @property
    def length(self) -> int:
        """The window's steps."""
        return (self.emerge or self.rise) + self.hold

    def factor(self, step: int) -> float | None:
        """The multiplier at ``step``; ``None`` outside the window."""
        k = step - self.start
        if k < 0 or k >= self.length:
            return None
        if self.emerge:
            m = round(math.log2(self.peak))
            # an integer exponent: every factor a power of two, so BF16 and fp32 paths stay exact
            return float(2.0 ** (m * min(k + 1, self.emerge) // self.emerge))
        f = float(self.growth ** min(k + 1, self.rise))
        # capped: with x4 per step an odd m would overshoot the peak on the last rising step
        return min(f, self.peak) if self.peak else f


@dataclass(frozen=True)
class ShapedPlan(OutlierPlan):
    """An :class:`OutlierPlan` whose outliers are :class:`ShapedOutlier` (the same layer and
    channel per seed)."""

    peak: float = 0.0
    emerge: int = 0
    visible: bool = False
    onset: str = field(default="rise")
    """The onset's name (:data:`ONSETS`), for the records and the report."""

    def at(self, seed: int, point: int, layers: int, width: int) -> ShapedOutlier:
        base = super().at(seed, point, layers, width)
        # every field of the plan's Outlier (whatever they are), then the shape's own three
        return ShapedOutlier(
            **asdict(base), peak=self.peak, emerge=self.emerge, visible=self.visible
        )


def shaped_plan(log2_peak: int, onset: str, visible: bool = False, emerge: int = 200) -> ShapedPlan:
    """The grid's outlier of magnitude ``2^log2_peak`` with ``onset`` (:data:`ONSETS`): the
    instant and rising ones over a :data:`WINDOW`-step window, the slow one emerging over
    ``emerge`` steps and held 20."""
    if onset not in ONSETS:
        raise ValueError(f"onset must be one of {ONSETS}, got {onset!r}")
    if log2_peak < 1 or (onset == "slow" and emerge < log2_peak):
        raise ValueError(f"log2_peak ({log2_peak}) must be >= 1 and <= emerge ({emerge})")
    peak = 2.0**log2_peak
    if onset == "instant":
        return ShapedPlan(
            rise=1, hold=WINDOW - 1, growth=peak, peak=peak, onset=onset, visible=visible
        )
    if onset == "rise":
        # enough x4 steps to reach the peak (the cap trims the last); the window stays WINDOW long
        rise = math.ceil(log2_peak / math.log2(RISE_GROWTH))
        return ShapedPlan(
            rise=rise,
            hold=WINDOW - rise,
            growth=RISE_GROWTH,
            peak=peak,
            onset=onset,
            visible=visible,
        )
    return ShapedPlan(
        rise=1, hold=20, growth=2.0, peak=peak, emerge=emerge, onset=onset, visible=visible
    )


class PassGradient(torch.autograd.Function):
    """``w / d`` forward, the gradient passed to ``w`` unchanged: ``W.grad`` is then the
    gradient of the parameter ``V = W D^-1`` (the gradient-visible outlier)."""

    @staticmethod
    def forward(ctx: object, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return w / d

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # w / d would hand w grad / d; grad itself is the gradient of V = W D^-1, the visible one
        return grad, None
