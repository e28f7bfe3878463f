"""The selection section's data (issue 13): the whole-run sweeps of
:mod:`benchmarks.sweep.selection`, read from ``results/sweep_<regime>.json``, as
``templates/selection.md.j2`` reads them."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.stats import SELECTION_BAR, verdicts
from benchmarks.harness.tables import compact_selection, table
from benchmarks.report.source import Source

REGIMES = ("act_quant", "fp6_fp8", "outlier", "delayed")
SIGNALS = (  # the k = 3 scores and sets graded against the update gap: (arm, graded set)
    ("low-cost", "risk_topk"),
    ("low-cost", "error_global_topk"),
    ("low-cost", "error_adam_topk"),
    ("GNMR+e 3", "risk_topk"),
    ("GNMR+e 3", "active"),
)


class Sweep:
    """One regime's sweep report (``results/sweep_<regime>.json``)."""

    def __init__(self, src: Source, regime: str) -> None:
        self.regime = regime
        self.r: dict[str, Any] = src.json(f"sweep_{regime}")
        self.summary: dict[str, dict[str, Any]] = self.r["summary"]
        self.setup: dict[str, Any] = self.r["setup"]
        self.seeds: list[int] = self.r["seeds"]
        self.budgets: list[int] = self.r["budgets"]
        self.gap: list[float] = self.r["static_gap"]
        self.faults: list[dict[str, Any]] = self.setup.get("faults", [])
        self.windows = [f"{f['start']}-{f['stop'] - 1}" for f in self.faults]

    @property
    def units(self) -> int:
        """Projection units: ``random 1`` runs exactly one of them on the recovery path."""
        return round(1 / self.summary["random 1"]["recovery_rate"])

    def fig(self, arm: str, graded: str, figure: str = "precision_grad", window: str = "") -> float:
        """One selection figure's mean over seeds (every probe step, or inside ``window``)."""
        return self._sel(arm, window)[graded][figure][0]

    def half(self, arm: str, graded: str, window: str = "") -> float:
        """The 95% half-width of ``graded``'s precision against the gradient gap."""
        return self._sel(arm, window)[graded]["precision_grad"][1]

    def _sel(self, arm: str, window: str) -> dict[str, Any]:
        row = self.summary[arm]
        return row["selection_fault"][window] if window else row["selection"]

    def update_signals(self, window: str = "") -> list[float]:
        """The precision against the update gap of every one of :data:`SIGNALS`."""
        return [self.fig(a, g, "precision_update", window) for a, g in SIGNALS]

    def verdicts(self) -> list[str]:
        """The sweep's verdict lines (:func:`benchmarks.harness.stats.verdicts`)."""
        return verdicts(self.summary, self.budgets)

    def beats_nothing(self) -> bool:
        """No budgeted policy beats random-k (or first+last at 14) at any budget."""
        return all("beats random-k: none" in v for v in self.verdicts())

    def same_gnmr(self) -> list[tuple[int, int]]:
        """Adjacent budgets (a, b) at which the seed's GNMR ends the same on every seed."""
        pairs = zip(self.budgets, self.budgets[1:], strict=False)
        end = {k: self.summary[f"GNMR {k}"]["per_seed"] for k in self.budgets}
        return [(a, b) for a, b in pairs if end[a] == end[b]]

    def median_half(self) -> float:
        """The median half-width of the arms' intervals against low-cost."""
        rows = [r for n, r in self.summary.items() if n != "low-cost"]
        return statistics.median(r["vs_low_cost"][1] for r in rows)

    def static_diffs(self) -> list[float]:
        """Low-cost minus recovery held-out loss, seed by seed."""
        low, rec = (self.summary[a]["per_seed"] for a in ("low-cost", "recovery"))
        return [a - b for a, b in zip(low, rec, strict=True)]


def bar(x: float) -> str:
    """Where a precision stands against the bar, at the two decimals the document prints."""
    shown, at = round(x, 2), round(SELECTION_BAR, 2)
    return "at the bar" if shown == at else "above the bar" if shown > at else "below the bar"


def context(src: Source) -> dict[str, Any]:
    """The selection section's names: the four sweeps and the selection tables."""
    sw = {r: Sweep(src, r) for r in REGIMES}
    seed = src.json("act_quant")
    rows = [row for s in sw.values() for row in s.summary.values()]
    return {
        "probe_costs": [row["probe_cost"] for row in rows if row["probe_cost"]],
        "all_beat_nothing": all(s.beats_nothing() for s in sw.values()),
        "all_updates": [x for s in sw.values() for x in s.update_signals()],
        "seed_losses": {r["name"]: r["heldout_loss"] for r in seed["results"]},
        "seed_steps": seed["setup"]["steps"],
        "sel": sw,
        "SELECTION_BAR": SELECTION_BAR,
        "selection_table": table,
        "compact_selection": compact_selection,
        "bar": bar,
    }
