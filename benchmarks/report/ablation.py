"""Issue 44's ablation in RESULTS.md's top paragraph: the pre-registered comparisons of
``e-only 4`` and ``GNMR+e lean 4`` (:data:`benchmarks.harness.preregistered.ABLATION_COMPARISONS`)
in the regimes that ran them (``<parent>_ablation``), each with its interval, its sign count and
the tie reading, and the recovered work of the compared arms. Their own sections (the regime
tables) are the fault section's; this module only gathers what the paragraph says.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import preregistered
from benchmarks.harness.branch_stats import share_closed
from benchmarks.report.faults import FaultRegime, work

__all__ = ["ablation"]

ARMS = ("GNMR+e 4", "e-only 4", "GNMR+e lean 4", "random 4")
"""The arms whose share of the static gap and recovered work the paragraph gives."""


def ablation(regimes: list[FaultRegime]) -> list[dict[str, Any]]:
    """Per ablation regime with records: its seeds, its measured comparisons
    (:meth:`FaultRegime.preregistered` rows), and per compared arm its share of the static gap
    closed (95%) and recovered work on the design; the regimes' parents by name."""
    out = []
    for r in regimes:
        if r.name not in preregistered.ABLATION_REGIMES or r.design is None:
            continue
        d = r.design
        rows = [p for p in r.preregistered() if not p["missing"] and not p["not_run"]]
        arms = {
            a: {
                "share": share_closed(r.records, d, a),
                "work_pct": f"{100 * work(r.records, d, a):.1f}%",
            }
            for a in ARMS
            if a in r.table_arms
        }
        stop = preregistered.STOPPING[r.name]
        parent = r.name.removesuffix("_ablation")
        out.append(
            {
                "regime": r,
                "parent": parent,
                "seeds": len(d.seeds),
                "planned": len(stop.planned),
                "rows": rows,
                "arms": arms,
            }
        )
    return out
