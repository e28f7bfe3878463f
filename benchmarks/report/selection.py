"""The selection section (issue 13; docs/benchmarks.md#sweep-selection): the whole-run sweeps as a
verdict row per regime, every arm's paired differences, and what the k = 3 signals and sets select
against the measured gaps (:mod:`benchmarks.harness.selection_figures`)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.selection_figures import Sweep, beats, precision, selects, windows
from benchmarks.harness.stats import SELECTION_BAR, plus_minus
from benchmarks.harness.tables import COMPACT_ROWS
from benchmarks.report.source import Source
from benchmarks.report.words import resolved, table

REGIMES = ("act_quant", "fp6_fp8", "outlier", "delayed")
Row = dict[str, str | None]


def verdict(name: str, s: Sweep) -> Row:
    """A regime's row: the static gap, what beats random-k and first+last, GNMR+e 3's risk
    precision (overall; in each fault window), the selection and whether quality is measurable."""
    gap, risk = s["static_gap"], [precision(s, "GNMR+e 3", "risk_topk", w) for w in windows(s)]
    return {
        "regime": f"`{name}`",
        "steps, seeds": f"{s['setup']['steps']}, {len(s['seeds'])}",
        "static gap (low-cost - recovery)": plus_minus(gap, 3) + " **resolved**" * resolved(gap),
        "beats random-k": ", ".join(beats(s, "vs_random")) or "none",
        "beats first+last (k = 14)": ", ".join(beats(s, "vs_first_last")) or "none",
        "GNMR+e 3's risk vs gradient gap (overall; in windows)": "; ".join(map(two, risk)),
        "selection": f"**{selects(s)}**",
        "training quality": "measurable" if resolved(gap) else "not measurable",
    }


def arm_row(sw: dict[str, Sweep], arm: str) -> Row:
    """An arm's paired differences in each regime: vs low-cost (its recovery rate), vs random-k
    (k = 14: / first+last)."""
    row: Row = {"arm": arm}
    for n, s in sw.items():
        r = s["summary"][arm]
        fl = f" / first+last {plus_minus(r['vs_first_last'])}" if r.get("vs_first_last") else ""
        low = f"{plus_minus(r['vs_low_cost'])} ({r['recovery_rate']:.1%})"
        row[f"`{n}`: vs low-cost (recovery)"] = low
        row[f"`{n}`: vs random-k"] = f"{plus_minus(r.get('vs_random'))}{fl}".removeprefix("- / ")
    return row


def signal_row(sw: dict[str, Sweep], arm: str, graded: str, label: str) -> Row:
    """A k = 3 signal's or set's precision@3 against the gradient / update gap, over every probe
    step of each regime and inside each fault window."""
    row: Row = {"precision@3 vs gradient / update gap": label}
    for n, s in sw.items():
        for w in windows(s):
            pairs = [
                precision(s, arm, graded, w, g) for g in ("precision_grad", "precision_update")
            ]
            row[f"`{n}`" + (f", steps {w}" if w else "")] = " / ".join(map(two, pairs))
    return row


def two(pair: Any) -> str:
    """A precision as ``0.82 +- 0.06``."""
    return plus_minus(pair, 2).lstrip("+")


def context(src: Source) -> dict[str, Any]:
    """The selection section's names: its three tables, the plots and the files."""
    sw = {r: src.json(f"sweep_{r}") for r in REGIMES}
    budgets = sw[REGIMES[0]]["budgets"]
    ends = {n: [s["summary"][f"GNMR {k}"]["per_seed"] for k in budgets[-2:]] for n, s in sw.items()}
    cmd = "`python -m benchmarks.sweep.selection --regime {}`"
    return {
        "selection": {
            "verdicts": table([verdict(n, s) for n, s in sw.items()]),
            "arms": table([arm_row(sw, arm) for arm in sw[REGIMES[0]]["summary"]]),
            "select": table([signal_row(sw, a, *g) for a, gs in COMPACT_ROWS for g in gs.items()]),
            "plots": [src.image(r, f"sweep_{r}.png") for r in REGIMES],
            "files": src.provenance_table({f"sweep_{r}.json": cmd.format(r) for r in REGIMES}),
            "bar": SELECTION_BAR,
            "same": [n for n, (a, b) in ends.items() if a == b],  # GNMR ends alike at both
            "budgets": budgets,
        }
    }
