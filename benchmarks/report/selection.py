"""The selection section's data (issue 13): the whole-run sweeps of
:mod:`benchmarks.sweep.selection` (``results/sweep_<regime>.json``) as three tables: a verdict
row per regime, every arm's paired differences, and what the k = 3 signals and sets select
against the measured gaps. The design: docs/benchmarks.md#sweep-selection."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import SELECTION_BAR, plus_minus
from benchmarks.harness.tables import COMPACT_ROWS
from benchmarks.report.source import Source
from benchmarks.report.words import resolved

REGIMES = ("act_quant", "fp6_fp8", "outlier", "delayed")
E = "GNMR+e 3"


def _fig(s: dict[str, Any], arm: str, graded: str, window: str = "", f: str = "precision_grad"):
    row = s["summary"][arm]
    return (row["selection_fault"][window] if window else row["selection"])[graded][f]


def windows(s: dict[str, Any]) -> list[str]:
    """The fault windows (``60-109``) of a sweep with faults."""
    return [f"{f['start']}-{f['stop'] - 1}" for f in s["setup"].get("faults", [])]


def beats(s: dict[str, Any], key: str) -> str:
    """The budgeted arms whose paired interval against ``key`` lies below 0 (``none``)."""
    wins = [a for a, r in s["summary"].items() if r.get(key) and sum(r[key]) < 0]
    return ", ".join(wins) or "none"


def verdict_row(name: str, s: dict[str, Any]) -> list[str]:
    """Static gap, what beats random-k and first+last, GNMR+e's and the paper's GNMR's risk
    precision (overall, in each fault window) and the verdicts on selection and on quality."""
    gap, ws = s["static_gap"], windows(s)
    risk = [_fig(s, E, "risk_topk", w) for w in ["", *ws]]
    paper = [_fig(s, "low-cost", "risk_topk", w)[0] for w in ["", *ws]]
    picks = [round(r[0], 2) >= SELECTION_BAR for r in (risk[1:] or risk)]
    sel = "yes" if all(picks) else "partly" if any(picks) else "no"
    return [
        f"`{name}`",
        f"{s['setup']['steps']}, {len(s['seeds'])}",
        plus_minus(gap, 3) + (" **resolved**" if resolved(gap) else ""),
        beats(s, "vs_random"),
        beats(s, "vs_first_last"),
        "; ".join(plus_minus(r, 2).lstrip("+") for r in risk),
        "; ".join(f"{x:.2f}" for x in paper),
        f"**{sel}**",
        "measurable" if resolved(gap) else "not measurable",
    ]


def arms_table(sw: dict[str, dict[str, Any]]) -> str:
    """Per arm and regime: vs low-cost (recovery rate) and vs random-k (k = 14: / first+last)."""
    header = ["arm"] + [
        f"`{n}`: {c}" for n in sw for c in ("vs low-cost (recovery)", "vs random-k")
    ]
    rows = []
    for arm in sw[REGIMES[0]]["summary"]:
        cells = [arm]
        for s in sw.values():
            r = s["summary"][arm]
            cells.append(f"{plus_minus(r['vs_low_cost'])} ({100 * r['recovery_rate']:.1f}%)")
            fl = f" / first+last {plus_minus(r['vs_first_last'])}" if r.get("vs_first_last") else ""
            cells.append(f"{plus_minus(r.get('vs_random'))}{fl}".removeprefix("- / "))
        rows.append(cells)
    return markdown_table(header, rows)


def selection_table(sw: dict[str, dict[str, Any]]) -> str:
    """Per k = 3 signal or set: precision@3 against the gradient gap; against the update gap,
    over every probe step of each regime and inside each fault window."""
    cols = [(n, w) for n, s in sw.items() for w in ["", *windows(s)]]
    header = ["precision@3 vs gradient / update gap"]
    header += [f"`{n}`" + (f", steps {w}" if w else "") for n, w in cols]
    rows = []
    for arm, labels in COMPACT_ROWS:
        for graded, label in labels.items():
            cells = [label]
            for n, w in cols:
                pair = [
                    _fig(sw[n], arm, graded, w, f) for f in ("precision_grad", "precision_update")
                ]
                cells.append(" / ".join(plus_minus(p, 2).lstrip("+") for p in pair))
            rows.append(cells)
    return markdown_table(header, rows)


def same_gnmr(s: dict[str, Any]) -> bool:
    """Whether the paper's GNMR ends the same on every seed at the two largest budgets."""
    a, b = s["budgets"][-2:]
    return bool(s["summary"][f"GNMR {a}"]["per_seed"] == s["summary"][f"GNMR {b}"]["per_seed"])


def context(src: Source) -> dict[str, Any]:
    """The selection section's names: its three tables, the plots and the files."""
    sw = {r: src.json(f"sweep_{r}") for r in REGIMES}
    header = ["regime", "steps, seeds", "static gap (low-cost - recovery)", "beats random-k"]
    header += ["beats first+last (k = 14)", f"{E}'s risk vs gradient gap (overall; in windows)"]
    header += ["the paper's GNMR's risk", "selection", "training quality"]
    cmd = "`python -m benchmarks.sweep.selection --regime {}`"
    files = {f"sweep_{r}.json": cmd.format(r) for r in REGIMES}
    return {
        "selection": {
            "verdicts": markdown_table(header, [verdict_row(n, s) for n, s in sw.items()]),
            "arms": arms_table(sw),
            "select": selection_table(sw),
            "plots": [src.image(r, f"sweep_{r}.png") for r in REGIMES],
            "files": src.provenance_table(files),
            "bar": SELECTION_BAR,
            "same": [n for n, s in sw.items() if same_gnmr(s)],
            "budgets": sw[REGIMES[0]]["budgets"],
        }
    }
