"""The statistics of a branch sweep (:mod:`benchmarks.sweep.branches`): paired differences between
arms, the share of the static gap an arm closes, loss spikes (:mod:`benchmarks.harness.spikes`)
and their paired per-seed differences, the estimator's noise, the verdicts and the arms' table.

Every figure pairs arms on the same (seed, branch point): the same weights, optimizer state,
batches and learning rate at the start of the branch. A seed's figure is the mean over its
branch points; the estimate and its 95% Student-t interval are taken over the seeds, the
independent replicates (:mod:`benchmarks.harness.branch`). The module imports no torch
(``python -m benchmarks.report`` computes with it from the records).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.spikes import RULE, spike_steps
from benchmarks.harness.stats import interval, plus_minus, t95

Records = dict[tuple[str, int, int], dict[str, Any]]
"""Branch records (:func:`benchmarks.harness.branch.run_branch`) by (arm, seed, point)."""

logger = logging.getLogger(__name__)


def read_records(path: Path) -> Records:
    """Every finished branch in the JSON-lines file ``path`` by (arm, seed, point) (the last
    line of a branch wins; no file: none). A last line cut short (the sweep killed while writing
    it) is skipped: that branch runs again."""
    records: Records = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            # only the last line can be cut by a kill mid-write; a bad line elsewhere is a damaged
            # file, and skipping it would quietly drop a branch from the pairs
            if i == len(lines) - 1:
                logger.warning("%s: the last line is cut short; its branch runs again", path)
                continue
            raise
        # a branch re-run after a resume appends another line; the later one is the record
        records[(r["arm"], r["seed"], r["point"])] = r
    return records


SPIKE = RULE
"""The loss-spike rule (:mod:`benchmarks.harness.spikes`): a step whose loss minus the BF16
branch's on the same batch departs from its own trailing median by more than ``k`` robust
deviations, or whose loss is not finite. Its ``str`` words it."""

GAP = "static gap (low-cost - BF16)"
"""The name of the static gap among the noise figures."""

DIVERGED = 1.0
"""A branch whose loss is not finite, or whose held-out loss exceeds the BF16 branch's by more
than this (nats), counts as diverged."""


@dataclass(frozen=True)
class Design:
    """Which records a summary reads."""

    seeds: tuple[int, ...]
    points: tuple[int, ...]
    horizon: int
    low: str = "low-cost"
    high: str = "BF16"


def heldout(records: Records, arm: str, seed: int, point: int, horizon: int) -> float:
    return float(records[(arm, seed, point)]["heldout"][str(horizon)])


def per_seed(records: Records, d: Design, arm: str, minus: str | None = None) -> list[float]:
    """Per seed: the mean over its branch points of ``arm``'s held-out loss (minus ``minus``'s on
    the same branch)."""

    def diff(s: int, p: int) -> float:
        # paired on (seed, point): both branches start from the same checkpoint, optimizer state and
        # learning rate and train on the same batches, so the difference leaves the policy alone
        x = heldout(records, arm, s, p, d.horizon)
        return x - (heldout(records, minus, s, p, d.horizon) if minus else 0.0)

    # one figure per seed: the points of one trunk share its state and data, so they are averaged,
    # not counted as replicates; every interval is over the seeds
    return [statistics.fmean([diff(s, p) for p in d.points]) for s in d.seeds]


def paired(records: Records, d: Design, a: str, b: str) -> tuple[float, float]:
    """``a - b`` in held-out loss: mean over seeds and its 95% half-width."""
    return interval(per_seed(records, d, a, b))


def share_closed(records: Records, d: Design, arm: str) -> tuple[float, float]:
    """``(low - arm) / (low - high)``: the share of the static gap ``arm`` closes, with a 95%
    half-width by the delta method over seeds (the ratio of the two paired means)."""
    x = per_seed(records, d, d.low, arm)
    g = per_seed(records, d, d.low, d.high)
    n, mx, mg = len(x), statistics.fmean(x), statistics.fmean(g)
    if n < 2 or mg == 0:
        return (mx / mg if mg else math.nan), math.nan
    # a ratio of two paired means: the delta method linearizes it around (mx, mg), and both come
    # from the same seeds' low-cost branches, so their covariance enters the variance
    r = mx / mg
    cov = statistics.covariance(x, g)
    var = (statistics.variance(x) - 2 * r * cov + r * r * statistics.variance(g)) / n / mg**2
    # rounding can leave the linearized variance a hair below 0 when x and g are near proportional
    return r, t95(n - 1) * math.sqrt(max(var, 0.0))


def unit_step_share(records: Records, d: Design, arm: str) -> float:
    """Mean share of eligible unit-steps whose forward ran the recovery path."""
    rows = [records[(arm, s, p)] for s, p in product(d.seeds, d.points)]
    return statistics.fmean(r["recovered_unit_steps"] / r["unit_steps"] for r in rows)


def branch_spikes(records: Records, d: Design, arm: str, seed: int, point: int) -> int:
    """Loss spikes of one branch of ``arm`` (:data:`SPIKE`), paired with the BF16 branch (the
    same batches)."""
    mine, ref = records[(arm, seed, point)], records[(d.high, seed, point)]
    return len(spike_steps(mine["train_loss"], ref["train_loss"], SPIKE))


def spike_counts(records: Records, d: Design, arm: str) -> list[int]:
    """Per seed: ``arm``'s loss spikes summed over the seed's branch points."""
    return [sum(branch_spikes(records, d, arm, s, p) for p in d.points) for s in d.seeds]


def spike_difference(
    records: Records, d: Design, arm: str, ref: str | None = None
) -> tuple[float, float]:
    """``arm``'s loss spikes minus ``ref``'s (default: the static low-cost arm), per seed summed
    over its branch points: the mean over seeds and its 95% Student-t half-width, the interval
    of every other paired figure. Both counts are paired with the same BF16 branches and
    batches, so a seed's difference takes out what the seed's data does to both."""
    mine, theirs = spike_counts(records, d, arm), spike_counts(records, d, ref or d.low)
    return interval([float(a - b) for a, b in zip(mine, theirs, strict=True)])


def spike_figures(records: Records, d: Design, arm: str) -> dict[str, Any]:
    """A summary row's spike figures: ``spikes``, ``arm``'s loss spikes over all its branches,
    and ``spikes_vs_low_cost``, :func:`spike_difference` (``None`` for the low-cost arm)."""
    vs_low = None if arm == d.low else spike_difference(records, d, arm)
    return {"spikes": sum(spike_counts(records, d, arm)), "spikes_vs_low_cost": vs_low}


def troubles(records: Records, d: Design, arm: str) -> tuple[int, int]:
    """(loss spikes, diverged branches) of ``arm`` against the BF16 branch on the same batches:
    spikes by :data:`SPIKE`; a branch diverged when it has a non-finite loss or its held-out
    loss exceeds BF16's by more than :data:`DIVERGED`."""
    diverged = 0
    for s, p in product(d.seeds, d.points):
        gap = heldout(records, arm, s, p, d.horizon) - heldout(records, d.high, s, p, d.horizon)
        nonfinite = bool(records[(arm, s, p)]["nonfinite"])
        # a NaN gap compares False with DIVERGED, so a non-finite loss is counted on its own
        diverged += nonfinite or not math.isfinite(gap) or gap > DIVERGED
    return sum(spike_counts(records, d, arm)), diverged


def verdict(pair: Sequence[float]) -> str:
    """A paired difference ``a - b`` (mean, 95% half-width): ``better`` when the interval lies
    below 0, ``worse`` above, else ``not resolved``."""
    m, h = pair
    # one seed: NaN comparisons would otherwise read 'not resolved', as if an interval held 0
    if math.isnan(h):
        return "one seed: no interval"
    if m + h < 0:
        return "better"
    if m - h > 0:
        return "worse"
    return "not resolved"


SPIKES_VS = "spikes - low-cost (per seed)"
"""The arms table's column of :func:`spike_difference` (the summary's ``spikes_vs_low_cost``)."""


def table(summary: dict[str, dict[str, Any]]) -> str:
    """One row per arm of a report's summary (:func:`benchmarks.sweep.fp4_report.summarize`):
    its loss spikes in all (:data:`SPIKE`) and per seed against the low-cost arm's
    (:func:`spike_difference`; ``-`` for the low-cost arm itself)."""
    header = ["arm", "recovered unit-steps", "held-out - BF16", "held-out - low-cost"]
    header += ["share of the static gap closed", "loss spikes", SPIKES_VS, "diverged"]
    rows = [
        [
            arm,
            f"{100 * r['unit_steps']:.1f}%",
            plus_minus(r["vs_bf16"]),
            plus_minus(r["vs_low_cost"]),
            plus_minus(r["closed"], 2),
            str(r["spikes"]),
            plus_minus(r.get("spikes_vs_low_cost"), 1),
            str(r["diverged"]),
        ]
        for arm, r in summary.items()
    ]
    return markdown_table(header, rows)
