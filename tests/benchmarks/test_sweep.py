"""benchmarks/sweep/selection*.py, stats.py: the statistics and verdicts behind the selection tables
(RESULTS.md)."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.harness.stats import _budget_of, interval, static_gap, summarize, verdicts
from benchmarks.harness.tables import table
from benchmarks.sweep import selection as sweep
from benchmarks.sweep.regimes import REGIMES

SEEDS = (1, 2, 3)


def test_interval_is_the_student_t_half_width():
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.303 * statistics.stdev([1.0, 2.0, 3.0]) / math.sqrt(3))
    assert math.isnan(interval([5.0])[1])


def _records(losses: dict[str, tuple[float, ...]]) -> dict:
    """Job records of the arms' held-out losses, one per seed of ``SEEDS``."""
    return {(n, s): _record(v[i]) for n, v in losses.items() for i, s in enumerate(SEEDS)}


def _record(loss: float, rate: float = 0.0) -> dict:
    return {
        "heldout_loss": loss,
        "recovery_rate": rate,
        "probe_summary": {},
        "probes": [],
        "probe_ms": 0.0,
        "step_ms": 1.0,
    }


def test_summary_pairs_every_policy_with_random_k_seed_by_seed():
    losses = {
        "low-cost": (3.0, 3.2, 3.1),
        "recovery": (2.0, 2.2, 2.1),
        "first+last": (2.5, 2.7, 2.6),
        "random 14": (2.9, 3.1, 3.0),
        "GNMR 14": (2.8, 3.0, 2.9),  # 0.1 better than random on every seed: beats it
        "oracle 14": (2.95, 3.0, 3.1),  # mixed: not better by more than the interval
    }
    summary = summarize(_records(losses), SEEDS)
    m, h = summary["GNMR 14"]["vs_random"]
    assert m == pytest.approx(-0.1) and h == pytest.approx(0.0, abs=1e-12)
    assert summary["first+last"]["closed"] == pytest.approx(0.5)
    assert summary["recovery"]["closed"] == pytest.approx(1.0)
    assert summary["GNMR 14"]["vs_low_cost"][0] == pytest.approx(-0.2)
    assert summary["GNMR 14"]["vs_first_last"][0] == pytest.approx(0.3)
    assert summary["GNMR 14"]["per_seed"] == [2.8, 3.0, 2.9]
    (line,) = verdicts(summary, [14])
    assert "beats random-k: GNMR -0.1000" in line
    assert "not better than random-k: oracle" in line
    assert "vs first+last: GNMR +0.3000" in line


def test_every_regime_builds_its_arms_and_names_budgets():
    for regime in REGIMES.values():
        arms = sweep.make_arms(regime, sweep.BUDGETS)
        names = [a.name for a in arms]
        assert len(names) == len(set(names)) == 3 + 4 * len(sweep.BUDGETS)
        assert {_budget_of(n) for n in names} == {None, *sweep.BUDGETS}
        gated = [a for a in arms if a.name.startswith("GNMR+e")]
        assert all(a.controller == {"gamma": regime.gamma} for a in gated)


def test_no_share_closed_when_the_static_gap_changes_sign_between_seeds():
    """Issue 13's act_quant runs at 200 steps: low-cost - recovery = -0.01, -0.02, +0.04."""
    losses = {
        "low-cost": (2.656, 2.556, 2.556),
        "recovery": (2.666, 2.576, 2.519),
        "oracle 7": (2.695, 2.517, 2.600),
    }
    records = _records(losses)
    gap = static_gap(records, SEEDS)
    assert gap[0] - gap[1] < 0  # not resolved
    summary = summarize(records, SEEDS)
    assert summary["oracle 7"]["closed"] is None
    assert "| oracle 7 | 2.6040 +- " in table(summary) and "| n/a |" in table(summary)


def test_student_t_takes_the_lower_df_between_table_entries():
    for n, t in ((2, 12.706), (10, 2.262), (23, 2.086), (100, 2.042)):
        values = [0.0, 1.0] * (n // 2) + [0.5] * (n % 2)
        _, half = interval(values)
        assert half == pytest.approx(t * statistics.stdev(values) / math.sqrt(n))


def test_fault_windows_get_about_ten_probe_steps_each():
    steps = sweep.fault_probe_steps(REGIMES["delayed"])
    assert steps == tuple(range(40, 48)) + tuple(range(90, 98))  # 8-step spikes: every step
    assert sweep.fault_probe_steps(REGIMES["outlier"]) == tuple(range(60, 110, 5))
    assert sweep.fault_probe_steps(REGIMES["fp6_fp8"]) == ()
