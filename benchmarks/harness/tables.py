"""The markdown tables the studies print and RESULTS.md shows: a selection sweep's arms and
selection figures (:mod:`benchmarks.sweep.selection`), the overhead study's parts (b) and (c)
(:mod:`benchmarks.overhead`). No torch: ``python -m benchmarks.report`` renders with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.selection_figures import selection_of
from benchmarks.harness.stats import plus_minus


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
        if (f := selection_of(summary, arm, window).get(set_name))
    ]
    return markdown_table([*header, "share of update gap^2"], rows)


COMPACT_ROWS = [  # in the table's order: (arm, {graded set: the row's label})
    (
        "low-cost",
        {
            "risk_topk": "the paper's GNMR's risk, top-3 (static low-cost arm)",
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
        if (f := selection_of(summary, arm, window).get(set_name))
    ]
    return markdown_table([*header, "share of the gradient gap^2 it covers"], rows)


def monitor_table(rows: list[dict[str, Any]]) -> str:
    """Part (b)'s table: per gradient set and arm, the median time and its ratio to clipping."""
    cells = [[r["grads"], r["arm"], f"{r['median_ms']:.3f}", f"{r['ratio']:.3f}"] for r in rows]
    return markdown_table(["gradients", "arm", "median ms", "/ clip_grad_norm_"], cells)


def collectives_table(res: dict[str, Any]) -> str:
    """Part (c)'s table: per rank and step, the collectives with GNMR off and on."""
    header = ["rank", "step", "off: calls / bytes", "on: calls / bytes", "extra (wrapper)"]
    header += ["extra (gloo profiler)", "expected"]
    want = f"all_reduce {res['expected_extra_bytes']} B"

    def calls(pairs: list[tuple[str, int]]) -> str:
        return ", ".join(f"{op} {n} B" for op, n in pairs) or "none"

    rows = [
        [
            str(r["rank"]),
            str(r["step"]),
            f"{r['off_calls']} / {r['off_bytes']}",
            f"{r['on_calls']} / {r['on_bytes']}",
            calls(r["extra"]),
            calls(r["extra_gloo"]),
            want,
        ]
        for r in res["rows"]
    ]
    return markdown_table(header, rows)
