"""The selection section (issue 13; docs/benchmarks.md#sweep-selection): the whole-run sweeps'
verdicts, paired differences and precision@3 (:mod:`benchmarks.harness.selection_figures`)."""

from __future__ import annotations

from functools import partial
from typing import Any

from benchmarks.harness.selection_figures import Sweep, beats, precision, selects, windows
from benchmarks.harness.stats import SELECTION_BAR
from benchmarks.harness.tables import COMPACT_ROWS, FIGURES
from benchmarks.report.source import Source
from benchmarks.report.words import pm, resolved, table

REGIMES = ("act_quant", "fp6_fp8", "outlier", "delayed")
two = partial(pm, digits=2, sign="")  # a precision as ``0.82 +- 0.06``


def verdict(name: str, s: Sweep) -> dict[str, str]:
    """A regime's row: the static gap (resolved: quality is measurable), what beats random-k and
    first+last, GNMR+e 3's risk precision (overall; in each fault window), the selection."""
    gap, risk = s["static_gap"], [precision(s, "GNMR+e 3", "risk_topk", w) for w in windows(s)]
    return {
        "regime": f"`{name}`",
        "steps, seeds": f"{s['setup']['steps']}, {len(s['seeds'])}",
        "static gap (low-cost - recovery)": pm(gap, 3) + " **resolved**" * resolved(gap),
        "beats random-k": ", ".join(beats(s, "vs_random")) or "none",
        "beats first+last (k = 14)": ", ".join(beats(s, "vs_first_last")) or "none",
        "GNMR+e 3's risk vs gradient gap (overall; in windows)": "; ".join(map(two, risk)),
        "selection": f"**{selects(s)}**",
    }


def arm_row(sw: dict[str, Sweep], arm: str) -> dict[str, str]:
    """An arm's paired differences in each regime (the template's words say which)."""
    row = {"arm": arm}
    for n, s in sw.items():
        r = s["summary"][arm]
        fl = f" / first+last {pm(r['vs_first_last'])}" if r.get("vs_first_last") else ""
        row[f"`{n}`: vs low-cost (recovery)"] = f"{pm(r['vs_low_cost'])} ({r['recovery_rate']:.1%})"
        row[f"`{n}`: vs random-k"] = f"{pm(r.get('vs_random'))}{fl}".removeprefix("- / ")
    return row


def signal_row(sw: dict[str, Sweep], arm: str, graded: str, label: str) -> dict[str, str]:
    """A k = 3 signal's or set's precision@3 in each regime, overall and in each fault window."""
    row = {"precision@3 vs gradient / update gap": label}
    for n, s in sw.items():
        for w in windows(s):
            cell = " / ".join(two(precision(s, arm, graded, w, g)) for g in FIGURES[:2])
            row[f"`{n}`" + (f", steps {w}" if w else "")] = cell
    return row


def context(src: Source) -> dict[str, Any]:
    """The selection section's names: its three tables, the plots and the files."""
    sw = {r: src.json(f"sweep_{r}") for r in REGIMES}
    budgets = sw[REGIMES[0]]["budgets"]
    ends = {n: [s["summary"][f"GNMR {k}"]["per_seed"] for k in budgets[-2:]] for n, s in sw.items()}
    cmd = "`python -m benchmarks.sweep.selection --regime {}`"
    return {
        "selection": {
            "verdicts": table([verdict(n, s) for n, s in sw.items()]),
            "arms": table([arm_row(sw, a) for a in sw[REGIMES[0]]["summary"] if a != "low-cost"]),
            "select": table([signal_row(sw, a, *g) for a, gs in COMPACT_ROWS for g in gs.items()]),
            "plots": [src.image(r, f"sweep_{r}.png") for r in REGIMES],
            "files": src.provenance_table({f"sweep_{r}.json": cmd.format(r) for r in REGIMES}),
            "bar": SELECTION_BAR,
            "same": [n for n, (a, b) in ends.items() if a == b],  # GNMR ends alike at both
            "budgets": budgets,
        }
    }
