"""The figures and verdicts of a whole-run selection sweep (:mod:`benchmarks.sweep.selection`,
``results/sweep_<regime>.json``) that RESULTS.md's selection section words. No torch.

A sweep's ``summary`` holds per arm its paired differences (``(mean, 95% half-width)``) and its
precision@3 against the measured gradient and update gaps, over every probe step (``selection``)
and inside each fault window (``selection_fault``). Selection is ``yes`` when GNMR+e 3's risk
reaches :data:`~benchmarks.harness.stats.SELECTION_BAR` in every fault window (over every probe
step in a sweep without faults), ``partly`` when in some.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.stats import SELECTION_BAR

Sweep = dict[str, Any]


def windows(s: Sweep) -> list[str]:
    """``""`` (every probe step), then the fault windows (``60-109``) of a sweep with faults."""
    # a fault's stop is exclusive: the window is named by its first and last step
    return ["", *(f"{f['start']}-{f['stop'] - 1}" for f in s["setup"].get("faults", []))]


def selection_of(summary: dict[str, Any], arm: str, window: str = "") -> dict[str, Any]:
    """``arm``'s figures per graded set over every probe step, or inside the fault ``window``
    (``{}`` for an arm or a window the sweep did not record)."""
    row = summary.get(arm, {})
    return row.get("selection_fault", {}).get(window, {}) if window else row.get("selection", {})


def precision(s: Sweep, arm: str, graded: str, window: str, gap: str = "precision_grad") -> Any:
    """``(mean, half-width)`` of ``arm``'s precision@3 of the set ``graded`` against ``gap``
    (``precision_grad`` or ``precision_update``), over every probe step or in ``window``."""
    return selection_of(s["summary"], arm, window)[graded][gap]


def beats(s: Sweep, key: str) -> list[str]:
    """The arms whose paired interval against ``key`` (``vs_random``, ...) lies below 0."""
    # mean + half-width < 0: even the interval's upper end is below 0
    return [a for a, r in s["summary"].items() if r.get(key) and sum(r[key]) < 0]


def selects(s: Sweep) -> str:
    """``yes``, ``partly`` or ``no``: whether GNMR+e 3's risk reaches the bar (module doc)."""
    risk = [precision(s, "GNMR+e 3", "risk_topk", w)[0] for w in windows(s)]
    # judged on the figure as shown (2 digits); inside the fault windows when there are any
    picks = [round(r, 2) >= SELECTION_BAR for r in (risk[1:] or risk)]
    return "yes" if all(picks) else "partly" if any(picks) else "no"
