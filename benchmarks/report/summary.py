"""The top of RESULTS.md: when to turn GNMR on, with which budget, and what it buys there, read
from the same figures as the sections below (``templates/summary.md.j2`` words them).

A fault regime swept on :data:`SWEPT` seeds or more either passes the noise bar
(:attr:`.branches.BranchRegime.bar`), and gets a row per budget with GNMR+e's share of the gap
closed, its work, its pre-registered verdicts and a reading (:func:`reading`); or its static gap is
not resolved (nothing to recover); or its nulls fail the bar. Issue 44's ablation and stage-5
regimes have tables of their own comparisons; the seed experiments their verdict words
(:mod:`.paper_branch`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import share_closed
from benchmarks.harness.designs import work
from benchmarks.report import rests_on, words
from benchmarks.report.faults import FaultRegime
from benchmarks.report.faults import context as fault_context
from benchmarks.report.paper_branch import regimes as seed_regimes
from benchmarks.report.source import Source

__all__ = ["context"]

SWEPT = 5
"""Seeds from which a fault regime counts as swept rather than piloted: an unresolved gap then
says the format absorbed the fault, not that two seeds could not tell."""
HIGH = ("BF16", "null ")
"""Arms that run the recovery path everywhere: they close the whole gap by construction, at full
cost (left out of "as much closed by", with the low-cost path)."""
ABLATION = ("GNMR+e 4", "e-only 4", "GNMR+e lean 4", "random 4")
"""The ablation's arms whose share of the static gap and recovered work the top gives."""


def reading(r: FaultRegime, arm: str, verdicts: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """``pays`` (a pre-registered "better" against random selection or NVIDIA's fixed rule), ``no
    help`` (its share of the gap closed not above 0, 95%), ``worse`` (a fixed rule better) or
    ``open``; and the other arms whose 95% share overlaps ``arm``'s (the same loss, each at its
    own cost)."""
    m, h = share_closed(r.records, r.design, arm)
    level = []
    for other in (a for a in r.table_arms if a not in (arm, "low-cost") and not a.startswith(HIGH)):
        m2, h2 = share_closed(r.records, r.design, other)
        if m2 + h2 >= m - h and m2 - h2 <= m + h:
            level.append(other)
    rivals = [v["verdict"] for v in verdicts if v["rival"].startswith(("random ", "NVIDIA last-"))]
    kind = "pays" if "better" in rivals else "worse" if "worse" in rivals else "open"
    return ("no help" if not m - h > 0 else kind), level


def advice(r: FaultRegime) -> list[dict[str, Any]]:
    """Per budget ``k`` with ``GNMR+e k`` in the design of a regime that passes the bar: the
    top table's row and the regime's column of :mod:`.rests_on`."""
    measured = [p for p in r.preregistered if not p["why"]]
    rows = []
    for k in (k for k in r.budgets() if f"GNMR+e {k}" in r.table_arms):
        arm = f"GNMR+e {k}"
        verdicts = [p for p in measured if p["arm"] in (arm, f"GNMR+e v2 {k}")]
        kind, level = reading(r, arm, [v for v in verdicts if v["arm"] == arm])
        seeds = max([len(r.design.seeds), *(p["seeds"] for p in measured)])
        rows.append(
            {
                "name": r.name,
                "seeds": f"{len(r.design.seeds)} (up to {seeds})",
                "gap": r.bar["gap"],
                "share": words.pct(share_closed(r.records, r.design, arm)),
                "work": words.percent(work(r.records, r.design, arm)),
                "verdicts": [
                    f"{v['arm']} vs {v['rival']}: {v['text']} ({v['seeds']})" for v in verdicts
                ],
                "speed": " / ".join(cost.speed_cell(r.costs[a], "B200") for a in (arm, "low-cost")),
                "level": ", ".join(level) or "-",
                "kind": kind,
                "column": rests_on.column(r, k),
            }
        )
    return rows


def ablation(r: FaultRegime) -> dict[str, Any]:
    """An ablation regime's row: its parent, seeds of the planned, each compared arm's share of
    the gap closed (95%) and work, and its measured comparisons."""
    d, stop = r.design, preregistered.STOPPING[r.name]
    arms = {
        a: f"{words.pm(share_closed(r.records, d, a), 2)} ({words.percent(work(r.records, d, a))})"
        for a in ABLATION
        if a in r.table_arms
    }
    seeds = f"{len(d.seeds)} of {len(stop.planned)}"
    rows = [p for p in r.preregistered if not p["why"]]
    return {"parent": r.name.removesuffix("_ablation"), "seeds": seeds, "arms": arms, "rows": rows}


def context(src: Source) -> dict[str, Any]:
    """``advice``: the rows of the swept regimes that pass the bar; ``quiet``: those whose gap is
    not resolved; ``noisy``: the rest; ``pilots``: the regimes not swept; ``rests``: the table
    of :mod:`.rests_on` and ``chosen``: when each outlier was chosen; ``ablation`` and
    ``stage5``: issue 44's regimes apart (``None``: no records yet); ``seed_words``."""
    faults = fault_context(src)
    every: list[FaultRegime] = faults["fault_regimes"]
    have = {r.name: r for r in every}
    apart = {*preregistered.ABLATION_REGIMES, *preregistered.STAGE5_FAMILIES}
    regimes = [r for r in every if r.name not in apart]
    swept = [r for r in regimes if r.design is not None and len(r.design.seeds) >= SWEPT]
    rows = [row for r in swept if r.bar["passes"] for row in advice(r)]
    quiet = [r.name for r in swept if not r.bar["resolved"]]
    noisy = [r.name for r in swept if r.bar["resolved"] and not r.bar["passes"]]
    columns = [(row["name"], row["column"]) for row in rows if row["column"]]
    chosen: dict[str, list[str]] = {}
    for name in dict.fromkeys(n for n, _ in columns):
        stop = preregistered.STOPPING.get(name)
        if stop is not None and stop.chosen:
            chosen.setdefault(stop.chosen, []).append(name)
    stage5 = [(n, have.get(n)) for n in preregistered.STAGE5_FAMILIES]
    return {
        "advice": rows,
        "quiet": quiet,
        "noisy": noisy,
        "pilots": [r.name for r in regimes if r not in swept],
        "rests": rests_on.table(columns) if columns else "",
        "chosen": chosen,
        "ablation": [
            ablation(r) for r in every if r.name in preregistered.ABLATION_REGIMES and r.design
        ],
        "stage5": [(n, r and [p for p in r.preregistered if "mean" in p]) for n, r in stage5],
        "seed_words": [(s, s.verdicts()) for s in seed_regimes(src) if s.records and s.design],
        "prereg_level": faults["prereg_level"],
    }
