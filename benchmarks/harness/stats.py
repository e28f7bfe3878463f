"""The statistics of a selection sweep (:mod:`benchmarks.sweep.selection`): intervals over seeds,
paired differences, the share of the static gap an arm closes, selection figures and the
verdicts.

Every figure pairs arms by seed: the same seed gives every arm the same initial weights, batches
and order, so ``a - b`` per seed removes the spread between seeds' trajectories. The module
imports no torch (``python -m benchmarks.report`` computes with it from the JSON files).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

Records = dict[tuple[str, int], dict[str, Any]]
"""The sweep's job records (an ``ArmResult`` as JSON, plus ``seed``) by (arm name, seed)."""

POLICY_PREFIXES = ("random", "GNMR", "GNMR+e", "oracle")
"""The budgeted arms: ``<prefix> <k>`` (:func:`benchmarks.sweep.selection.make_arms`)."""

SELECTION_BAR = 0.6
"""Issue 13's acceptance bar: a score selects when its top-k finds at least this share of the
top-k units by measured gradient gap (precision@k, mean over seeds)."""

# two-sided 95% Student-t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
        18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (a df between the
    table's entries takes the lower one: the wider interval)."""
    return _T95[max(d for d in _T95 if d <= df)]


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95% Student-t interval (NaN for one value)."""
    m = statistics.fmean(values)
    # NaN, not 0: one seed has no spread, and 0 would read as a certain figure
    if len(values) < 2:
        return m, math.nan
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def summarize(
    records: Records, seeds: Sequence[int], windows: Sequence[tuple[int, int]] = ()
) -> dict[str, Any]:
    """Per arm: held-out loss, paired difference to low-cost, share of the static gap closed
    (only where the static gap is resolved), paired difference to random-k, selection figures
    (and the same figures inside each fault window).

    The share closed is ``(mean low-cost - mean arm) / (mean low-cost - mean recovery)``, given
    only when the paired interval of ``low-cost - recovery`` excludes 0: a ratio over a gap that
    changes sign between seeds means nothing (:func:`static_gap` says which case it is).
    """
    names = list(dict.fromkeys(name for name, _ in records))
    loss = {n: [records[(n, s)]["heldout_loss"] for s in seeds] for n in names}
    static = static_gap(records, seeds)
    # a share of a gap whose sign changes between seeds means nothing: only a resolved gap divides
    resolved = static is not None and static[0] - static[1] > 0
    out: dict[str, Any] = {}
    for n in names:
        row: dict[str, Any] = {"loss": interval(loss[n]), "per_seed": loss[n]}
        if static is not None:
            low = statistics.fmean(loss["low-cost"])
            row["vs_low_cost"] = _paired(loss[n], loss["low-cost"])
            row["closed"] = (low - row["loss"][0]) / static[0] if resolved else None
        k = _budget_of(n)
        # random-k is the others' control at the same spend, not its own
        if k is not None and not n.startswith("random") and f"random {k}" in loss:
            row["vs_random"] = _paired(loss[n], loss[f"random {k}"])
        if k == 14 and "first+last" in loss:
            row["vs_first_last"] = _paired(loss[n], loss["first+last"])
        row["recovery_rate"] = statistics.fmean(records[(n, s)]["recovery_rate"] for s in seeds)
        # an arm that never probed records 0 ms: no probe cost to average
        costs = [r["probe_ms"] / r["step_ms"] for s in seeds if (r := records[(n, s)])["probe_ms"]]
        row["probe_cost"] = statistics.fmean(costs) if costs else None
        row["selection"] = _selection(records, n, seeds)
        row["selection_fault"] = {
            f"{a}-{b - 1}": _selection(records, n, seeds, (a, b)) for a, b in windows
        }
        out[n] = row
    return out


def static_gap(records: Records, seeds: Sequence[int]) -> tuple[float, float] | None:
    """Paired ``low-cost - recovery`` held-out loss (mean, 95% half-width); ``None`` without
    both static arms. Resolved when ``mean - half > 0``."""
    if not all(("low-cost", s) in records and ("recovery", s) in records for s in seeds):
        return None
    loss = lambda n: [records[(n, s)]["heldout_loss"] for s in seeds]  # noqa: E731
    return _paired(loss("low-cost"), loss("recovery"))


def _paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% half-width of the per-seed differences ``a - b`` (same seeds, same order)."""
    return interval([x - y for x, y in zip(a, b, strict=True)])


def _budget_of(name: str) -> int | None:
    """The budget of a budgeted arm's name (``GNMR+e 7``: 7); ``None`` for the controls."""
    head, _, tail = name.rpartition(" ")
    return int(tail) if head in POLICY_PREFIXES and tail.isdigit() else None


def _selection(
    records: Records,
    name: str,
    seeds: Sequence[int],
    window: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Per graded set: seed means (interval over seeds) of precision and share vs both gaps,
    over every probe step or over those in ``window`` (``start <= step < stop``)."""
    from benchmarks.harness.probes import summarize_probes  # torch: not for the statistics alone

    per_seed: dict[str, dict[str, list[float]]] = {}
    for s in seeds:
        record = records[(name, s)]
        summary = record.get("probe_summary") or {}
        if window is not None:
            inside = [p for p in record["probes"] if window[0] <= p["step"] < window[1]]
            summary = summarize_probes(inside)
        for set_name, figs in summary.items():
            for key, value in figs.items():
                # undefined on a seed (no probe step in the window): left out, not counted as 0
                if not math.isnan(value):
                    per_seed.setdefault(set_name, {}).setdefault(key, []).append(value)
    return {sn: {k: interval(v) for k, v in figs.items()} for sn, figs in per_seed.items()}


def verdicts(summary: dict[str, Any], budgets: Sequence[int]) -> list[str]:
    """Per budget: which policies beat random-k (and first+last at 14) by more than the interval:
    a paired difference ``m +- h`` beats it when ``m + h < 0``."""
    lines = []
    for k in budgets:
        wins, ties = [], []
        for policy in ("GNMR", "GNMR+e", "oracle"):
            pair = summary.get(f"{policy} {k}", {}).get("vs_random")
            if pair is not None:
                m, h = pair
                # beats only when the whole interval lies below 0: a mean below 0 alone may be noise
                (wins if m + h < 0 else ties).append(f"{policy} {plus_minus(pair)}")
        text = f"k={k}: beats random-k: {', '.join(wins) or 'none'}"
        text += f"; not better than random-k: {', '.join(ties) or 'none'}"
        if k == 14:
            policies = ("GNMR", "GNMR+e", "oracle", "random")
            pairs = {p: summary.get(f"{p} 14", {}).get("vs_first_last") for p in policies}
            fl = [f"{p} {plus_minus(pair)}" for p, pair in pairs.items() if pair is not None]
            text += f"; vs first+last: {', '.join(fl)}"
        lines.append(text)
    return lines


def plus_minus(pair: Sequence[float] | None, digits: int = 4) -> str:
    """``mean +- half-width`` of an interval (``-`` for none)."""
    return "-" if pair is None else f"{pair[0]:+.{digits}f} +- {pair[1]:.{digits}f}"
