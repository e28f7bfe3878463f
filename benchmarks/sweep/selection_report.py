"""The printed tables and the plot of a selection sweep (:mod:`benchmarks.sweep.selection`).

Its tables live in :mod:`benchmarks.harness.tables`, which RESULTS.md renders with too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.stats import POLICY_PREFIXES, plus_minus
from benchmarks.harness.tables import compact_selection, selection_table, table

logger = logging.getLogger(__name__)


def plot(regime: str, summary: dict[str, Any], budgets: Sequence[int], path: Path) -> None:
    """Quality against budget, one curve per policy: held-out loss minus the static low-cost
    arm's, paired by seed (mean and 95% interval of the per-seed differences: the spread
    between seeds' trajectories is left out, as the verdicts leave it out)."""
    from benchmarks.harness.common import errorbar, finish_plot, subplots  # torch

    fig, ax = subplots(figsize=(7, 4.5))
    for offset, (policy, marker) in enumerate(zip(POLICY_PREFIXES, "osD^", strict=True)):
        ks = [k for k in budgets if f"{policy} {k}" in summary]
        if not ks or "vs_low_cost" not in summary[f"{policy} {ks[0]}"]:
            continue
        xs = [k * 1.04 ** (offset - 1.5) for k in ks]  # side by side, not on top of each other
        pairs = [summary[f"{policy} {k}"]["vs_low_cost"] for k in ks]
        errorbar(ax, xs, pairs, marker=marker, label=policy)
    ax.axhline(0.0, ls="--", color="gray", label="static low-cost")
    if "vs_low_cost" in summary.get("recovery", {}):
        m, h = summary["recovery"]["vs_low_cost"]
        h = 0.0 if math.isnan(h) else h
        ax.axhspan(m - h, m + h, color="gray", alpha=0.15)
        ax.axhline(m, ls=":", color="gray", label="static recovery (band: 95% CI)")
    if "vs_low_cost" in summary.get("first+last", {}):
        pair = summary["first+last"]["vs_low_cost"]
        errorbar(ax, [14], [pair], marker="*", ms=12, color="k", ls="none", label="first+last (14)")
    ax.set(
        title=f"{regime}: held-out loss vs recovery budget, paired by seed",
        xlabel="units on the recovery path (of 28)",
        ylabel="held-out loss - static low-cost",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(budgets), [str(k) for k in budgets])
    finish_plot(fig, path, 8)


def print_report(
    summary: dict[str, Any],
    static: tuple[float, float] | None,
    verdicts: Sequence[str],
    windows: Sequence[tuple[int, int]],
) -> None:
    """The sweep's printed report: the static gap, the arms' table, the verdicts, the selection
    tables over every probe step and inside each fault window, and the probe's cost."""
    out = []
    if static is not None:
        resolved = static[0] - static[1] > 0
        out.append(
            f"static gap (low-cost - recovery, paired): {plus_minus(static)} -> "
            f"{'resolved' if resolved else 'NOT resolved: no policy can be told apart'}"
        )
    out += [table(summary), "", "\n".join(f"- {v}" for v in verdicts), ""]
    probed = ["low-cost"] + [n for n in summary if n.startswith(("GNMR", "oracle"))]
    out += [selection_table(summary, probed), "\n" + compact_selection(summary)]
    for a, b in windows:
        window = f"{a}-{b - 1}"
        out.append(
            f"\ninside the fault window, steps {window}:\n" + compact_selection(summary, window)
        )
    costs = [row["probe_cost"] for n, row in summary.items() if n in probed and row["probe_cost"]]
    if costs:
        out.append(
            f"\none probe (two extra forward/backward passes) costs {min(costs):.2f}-"
            f"{max(costs):.2f} median steps of its arm"
        )
    for a, b in windows:
        out.append(f"\nthe same on the probe steps inside the fault window, steps {a}-{b - 1}:")
        out.append(selection_table(summary, probed, f"{a}-{b - 1}"))
    logger.info("\n".join(out))
