"""The printed table and target lines of a paper experiment (:mod:`benchmarks.harness.experiment`),
from its arms' results; ``python -m benchmarks.report`` renders RESULTS.md's tables with them.

Nothing here imports torch: the results come from a run or from its JSON (``ArmResult(**r)``).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.harness.arms import ArmResult
from benchmarks.harness.markdown import markdown_table

TOLERANCE = 0.01
"""The paper's quality target: GNMR's held-out loss within this share of the reference arm's."""

PAPER_EXCEEDANCE = 0.002
"""The exceedance rate the seed reports for healthy runs (below 0.2% of unit-steps)."""

TIME_RATIO = 1.03
"""The step-time target: GNMR over the static low-cost arm at most this."""


def table(results: Sequence[ArmResult], reference: str, low_cost: str) -> str:
    """Markdown table; loss deltas relative to the ``reference`` arm, times to ``low_cost``."""
    by = {r.name: r for r in results}
    # losses against the reference, times against the low-cost arm: a policy's quality is judged
    # against the path it imitates, its cost against the low-cost path it runs on
    ref, low = by[reference], by[low_cost]
    header = ["arm", "held-out loss", f"vs {reference}", "perplexity", "exceedance", "recovery"]
    rows = [
        [
            r.name,
            f"{r.heldout_loss:.4f}",
            f"{100 * (r.heldout_loss / ref.heldout_loss - 1):+.2f}%",
            f"{r.heldout_ppl:.2f}",
            f"{100 * r.exceedance_rate:.3f}%",
            f"{100 * r.recovery_rate:.2f}%",
            f"{r.step_ms / low.step_ms:.3f}",
        ]
        for r in results
    ]
    return markdown_table([*header, f"step time vs {low_cost}"], rows)


def targets(
    results: Sequence[ArmResult],
    reference: str,
    low_cost: str,
    gnmr: str,
    *,
    tolerance: float = TOLERANCE,
    paper_exceedance: float = PAPER_EXCEEDANCE,
    time_ratio: float = TIME_RATIO,
) -> str:
    """The paper's targets, checked on ``results`` (each line says met or missed).

    GNMR's held-out loss within ``tolerance`` of ``reference`` while ``low_cost`` (the static
    low-cost arm) is worse by more than ``tolerance``; GNMR's recovery rate next to its budget;
    every arm's exceedance rate next to the paper's ``paper_exceedance``; GNMR's step time over the
    low-cost arm's at most ``time_ratio``.
    """
    by = {r.name: r for r in results}
    ref, low, g = by[reference], by[low_cost], by[gnmr]

    def rel(r: ArmResult) -> float:
        return r.heldout_loss / ref.heldout_loss - 1

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    budget = g.max_active / max(1, g.units)
    rare = [r for r in results if r.exceedance_rate < paper_exceedance]
    ratio = g.step_ms / low.step_ms
    exceed = ", ".join(f"{r.name} {100 * r.exceedance_rate:.3f}%" for r in results)
    return "\n".join(
        [
            f"- {gnmr} within {100 * tolerance:.0f}% of {reference}: {100 * rel(g):+.2f}% "
            f"-> {verdict(abs(rel(g)) <= tolerance)}",
            f"- {low_cost} worse than {reference} by more than {100 * tolerance:.0f}%: "
            f"{100 * rel(low):+.2f}% -> {verdict(rel(low) > tolerance)}",
            f"- {gnmr} recovery rate {100 * g.recovery_rate:.2f}% vs budget {100 * budget:.2f}% "
            f"({g.max_active} of {g.units} units)",
            f"- exceedance rate below the paper's {100 * paper_exceedance:.1f}%: {len(rare)} of "
            f"{len(results)} arms ({exceed})",
            f"- step time {gnmr} / {low_cost}: {ratio:.3f} (target <= {time_ratio}) "
            f"-> {verdict(ratio <= time_ratio)}",
        ]
    )
