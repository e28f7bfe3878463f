"""The cells of the magnitude x onset grid (issue 44) as branch regimes: what
:mod:`benchmarks.sweep.fault_grid` runs and :mod:`benchmarks.sweep.branches` registers, kept apart
from the runner so that neither imports the other. The design: docs/benchmarks.md#sweep-fault-grid.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.harness.arms import OutlierPlan
from benchmarks.harness.branch import Instrument
from benchmarks.harness.fault_shapes import ONSETS, shaped_plan
from benchmarks.sweep.regimes import FAULT_REGIMES, Regime

__all__ = [
    "ARMS",
    "CELLS",
    "FAMILY",
    "GRID_REGIMES",
    "MAGNITUDES",
    "NORMS",
    "PARENT",
    "POINT",
    "SEEDS",
    "SHARED",
    "STATICS",
]

FAMILY = "fault_grid"
"""The records' folder under ``results/``."""

MAGNITUDES = (10, 13, 16, 20)
"""``log2`` of the outlier's magnitude: 2^10, the massive activations reported in LLMs, to 2^20,
past per-tensor e4m3's range (about 2^18 with subnormals)."""

POINT = 100
"""The one branch point per seed: the one whose 225 steps still fit the trunk's schedule."""

SEEDS = (1234, 7, 42, 5, 11)
"""The grid's seeds (the fault strikes layers 3, 2, 0, 2 and 3)."""

FAST = Instrument(points=(POINT,), horizon=50, evals=(25, 50), late_at="schedule")
LONG = Instrument(
    points=(POINT,), horizon=225, evals=(25, 50, 100, 150, 200, 225), late_at="schedule"
)
"""The slow cells' and the long control's: a 225-step branch holds the 220-step window."""

STATICS = ("low-cost", "BF16", "null BF16 (1e-6)", "null low-cost (1e-6)")
SHARED = ("BF16", "null BF16 (1e-6)")
"""The arms a function-preserving cell reads from ``free_long``."""
ARMS = ("GNMR+e 4", "e-only 4", "TE autoswitch 4")
NORMS = "GNMR 4"
"""The norms alone: in the visible cells and the fault-free control only (blind by construction
to a function-preserving outlier)."""

PARENT = FAULT_REGIMES["outlier_delayed"]


def _cell(name: str, description: str, plan: OutlierPlan | None, inst: Instrument) -> Regime:
    setup = replace(PARENT.setup, outlier_plan=plan)
    return replace(
        PARENT,
        name=f"grid_{name}",
        description=description,
        setup=setup,
        instrument=inst,
        family=FAMILY,
    )


def _cells() -> dict[str, Regime]:
    out = {
        "free": _cell("free", "outlier_delayed's setup without a fault, 50 steps", None, FAST),
        "free_long": _cell("free_long", "the same, 225 steps", None, LONG),
    }
    for m in MAGNITUDES:
        for onset in ONSETS:
            inst = LONG if onset == "slow" else FAST
            for visible in (False, True):
                tail = "_visible" if visible else ""
                what = "gradient-visible" if visible else "function-preserving"
                text = f"delayed per-tensor e4m3; a {what} outlier of 2^{m}, onset {onset}"
                out[f"m{m}_{onset}{tail}"] = _cell(
                    f"m{m}_{onset}{tail}", text, shaped_plan(m, onset, visible), inst
                )
    return out


CELLS = _cells()
"""The grid's cells by short name (``m20_rise``, ``m10_slow_visible``, ``free``)."""

GRID_REGIMES = {r.name: r for r in CELLS.values()}
"""The cells as branch regimes (:mod:`benchmarks.sweep.branches` runs them)."""
