"""The printed tables and the plot of a selection sweep (:mod:`benchmarks.sweep.selection`).

The tables import no torch: ``python -m benchmarks.report`` renders RESULTS.md with them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import POLICY_PREFIXES, plus_minus

logger = logging.getLogger(__name__)


def table(summary: dict[str, Any]) -> str:
    """Per arm: held-out loss, the paired differences to low-cost and to random-k, the share of
    the static gap closed and the recovery rate."""
    header = ["arm", "held-out loss (95% CI)", "vs low-cost (paired)"]
    header += ["share of static gap closed", "vs random-k (paired)", "recovery"]
    rows = [
        [
            name,
            "{:.4f} +- {:.4f}".format(*row["loss"]),
            plus_minus(row.get("vs_low_cost")),
            "n/a" if row.get("closed") is None else f"{row['closed']:+.2f}",
            plus_minus(row.get("vs_random")),
            f"{100 * row['recovery_rate']:.1f}%",
        ]
        for name, row in summary.items()
    ]
    return markdown_table(header, rows)


SELECTION_SETS = (
    "risk_topk",
    "error_bound_topk",
    "error_global_topk",
    "error_relative_topk",
    "error_adam_topk",
    "active",
    "decided",
    "random",
    "first_last",
    "oracle_grad",
    "oracle_update",
)
FIGURES = ("precision_grad", "precision_update", "share_grad", "share_update")
COMPACT_FIGURES = FIGURES[:3]


def selection_table(summary: dict[str, Any], arms: Sequence[str], window: str = "") -> str:
    """Selection figures of ``arms`` over every probe step, or inside the fault ``window``."""
    header = ["arm", "set", "precision vs grad gap", "vs update gap", "share of grad gap^2"]
    rows = [
        [arm, set_name, *(plus_minus(f.get(k), 2).lstrip("+") for k in FIGURES)]
        for arm in arms
        for set_name in SELECTION_SETS
        if (f := _selection_of(summary, arm, window).get(set_name))
    ]
    return markdown_table([*header, "share of update gap^2"], rows)


COMPACT_ROWS = [  # in the table's order: (arm, {graded set: the row's label})
    (
        "low-cost",
        {
            "risk_topk": "seed GNMR's risk, top-3 (static low-cost arm)",
            "error_global_topk": "error score e = B / G, top-3 (static low-cost arm)",
            "error_adam_topk": "B scaled as Adam scales it, top-3 (static low-cost arm)",
            "random": "3 random units (static low-cost arm)",
        },
    ),
    ("GNMR 3", {"active": "GNMR 3: the set that ran recovery"}),
    (
        "GNMR+e 3",
        {"risk_topk": "GNMR+e 3: its risk, top-3", "active": "GNMR+e 3: the set that ran recovery"},
    ),
    (
        "low-cost",
        {
            "oracle_grad": "oracle by gradient gap, top-3",
            "oracle_update": "oracle by update gap, top-3",
        },
    ),
]


def compact_selection(summary: dict[str, Any], window: str = "") -> str:
    """The README's selection table: the k = 3 signals and sets against both measured gaps."""
    header = ["signal or set", "precision@3 vs gradient gap", "vs update gap"]
    rows = [
        [label, *(plus_minus(f.get(k), 2).lstrip("+") for k in COMPACT_FIGURES)]
        for arm, labels in COMPACT_ROWS
        for set_name, label in labels.items()
        if (f := _selection_of(summary, arm, window).get(set_name))
    ]
    return markdown_table([*header, "share of the gradient gap^2 it covers"], rows)


def _selection_of(summary: dict[str, Any], arm: str, window: str) -> dict[str, Any]:
    """``arm``'s selection figures over every probe step, or inside the fault ``window``."""
    row = summary.get(arm, {})
    return row.get("selection_fault", {}).get(window, {}) if window else row.get("selection", {})


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
