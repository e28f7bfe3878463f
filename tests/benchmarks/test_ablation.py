"""Issue 44's ablation: the e-only and lean arms are GNMR+e with one thing changed, the lean
score counts only rises above a unit's own usual level, and the comparisons, seeds and stopping
rule are registered before the sweep."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.harness import preregistered as pr
from benchmarks.harness.arms import Arm
from benchmarks.harness.lean import LeanErrors, lean_errors
from benchmarks.sweep.branch_arms import OFF, fault_arms
from benchmarks.sweep.regimes import FAULT_REGIMES
from tests.benchmarks.test_report import constructed_arms


def test_lean_score_counts_only_rises_above_the_units_own_level():
    base = torch.zeros(3, dtype=torch.float64)
    count = torch.zeros(3, dtype=torch.int64)
    gamma, rho = 0.1, 2.0
    first = lean_errors(torch.tensor([0.5, 0.05, 0.2]), base, count, gamma, rho)
    assert first.tolist() == [0.0, 0.0, 0.0]  # no baseline yet: silent
    assert base.tolist() == pytest.approx([0.5, 0.05, 0.2])
    # unit 0 stays at its standing 0.6 (< 2 x 0.5): e' = 0.6 * 0.1 / 1.0 = 0.06 < gamma;
    # unit 1 rises 10x past gamma: e' = 0.5 * 0.1 / 0.1 = 0.5; unit 2 is not finite
    e = lean_errors(torch.tensor([0.6, 0.5, math.inf]), base, count, gamma, rho)
    assert e[0].item() == pytest.approx(0.06) and e[0] < gamma
    assert e[1].item() == pytest.approx(0.5) and e[1] > gamma
    assert math.isinf(e[2].item())
    # the rise and the non-finite value stay out of the baseline; the usual step enters it
    assert base.tolist() == pytest.approx([0.55, 0.05, 0.2])
    assert count.tolist() == [2, 1, 1]
    # a held fault stays a rise: its baseline does not absorb it
    again = lean_errors(torch.tensor([0.55, 0.5, 0.2]), base, count, gamma, rho)
    assert again[1].item() == pytest.approx(0.5)
    assert base[1].item() == pytest.approx(0.05)


def test_lean_errors_wraps_the_controllers_step():
    seen = []

    def inner(norms, *, errors=None, lr=None):
        seen.append(errors)
        return norms

    lean = LeanErrors(inner, 2, gamma=0.1, rise=2.0)
    lean([1.0, 1.0], errors=torch.tensor([0.3, 0.3]))
    lean([1.0, 1.0], errors=torch.tensor([0.3, 0.9]))
    assert seen[0].tolist() == [0.0, 0.0]
    assert seen[1].tolist() == pytest.approx([0.3 * 0.1 / 0.6, 0.9 * 0.1 / 0.6])
    with pytest.raises(ValueError, match="rise must be > 1"):
        LeanErrors(inner, 2, gamma=0.1, rise=1.0)


def test_the_ablation_arms_change_one_thing_of_gnmr_e():
    for name in pr.ABLATION_REGIMES:
        regime = FAULT_REGIMES[name]
        parent = FAULT_REGIMES[name.removesuffix("_ablation")]
        assert (regime.setup, regime.gamma, regime.trunk) == (
            parent.setup,
            parent.gamma,
            parent.trunk,
        )
        arms = {a.name: a for a, _ in fault_arms(regime, [4], regime.units)}
        e, only, lean = arms["GNMR+e 4"], arms["e-only 4"], arms["GNMR+e lean 4"]
        assert only.controller == {**e.controller, "alpha": OFF, "beta": OFF}
        assert (only.max_active, only.error_every, only.lean_rise) == (4, 1, 0.0)
        assert lean.controller == e.controller and lean.lean_rise == 4.0
        assert set(pr.ABLATION_ARMS) <= set(arms)
    with pytest.raises(ValueError, match="lean_rise"):
        Arm("x", "gnmr", backend="fp8_emulated", max_active=4, lean_rise=2.0)


def test_the_ablation_is_registered_with_its_seeds_and_stopping_rule():
    names = [(c.arm, c.rival) for c in pr.ABLATION_COMPARISONS]
    assert names == [
        ("e-only 4", "GNMR+e 4"),
        ("GNMR+e lean 4", "GNMR+e 4"),
        ("GNMR+e lean 4", "random 4"),
        ("e-only 4", "random 4"),
    ]
    assert len(pr.ABLATION_COMPARISONS) == len(pr.COMPARISONS)  # the same 98.75% level
    for name in pr.ABLATION_REGIMES:
        assert pr.family(name, 4) == pr.ABLATION_COMPARISONS
        stop = pr.STOPPING[name]
        assert stop.planned == (1234, 7, 42, 5, 11, 13, 17, 23) and stop.added == ()
        assert stop.looks == (8,)
    assert pr.ABLATION_POINTS == (100,) and "null BF16 (1e-6)" not in pr.ABLATION_ARMS
    assert pr.family("outlier_delayed", 4) == pr.COMPARISONS


def test_a_tie_is_an_interval_inside_the_margin():
    assert pr.tie(0.001, 0.003, gap=0.05)  # 0.004 < 0.005
    assert not pr.tie(0.001, 0.0045, gap=0.05)
    assert not pr.tie(0.0, math.nan, gap=0.05)
    assert not pr.tie(-0.02, 0.001, gap=0.05)


ABLATION_ARMS = {  # test_report's less NVIDIA's rule and the low-cost null, plus the ablation's
    a: v
    for a, v in constructed_arms(
        "BF16", {"e-only 4": (0.004, 4 / 28), "GNMR+e lean 4": (0.005, 1 / 28)}
    ).items()
    if a not in ("NVIDIA last-4", "null low-cost (1e-6)")
}


def test_the_ablation_renders_its_own_family_with_sign_counts(tmp_path):
    from benchmarks.report import summary
    from benchmarks.report.faults import FaultRegime
    from benchmarks.report.source import Source
    from tests.benchmarks.test_report import _fault_records, _fault_section, _section, _write_faults

    _write_faults(tmp_path, _fault_records(ABLATION_ARMS), "outlier_delayed_ablation")
    _write_faults(tmp_path, _fault_records(), "outlier_delayed")
    text = _fault_section(tmp_path)
    for c in pr.ABLATION_COMPARISONS:
        assert f"| outlier_delayed_ablation | {c.arm} - {c.rival} |" in text
    assert "| outlier_delayed | GNMR+e 4 - random 4 |" in text  # the parent keeps its own four
    r = FaultRegime(Source(tmp_path), "outlier_delayed_ablation")
    rows = {(p["arm"], p["rival"]): p for p in r.preregistered}
    lean = rows[("GNMR+e lean 4", "random 4")]
    assert (lean["below"], lean["n"], lean["verdict"]) == (4, 4, "better")
    assert "| GNMR+e lean 4 - random 4 | -0.0029 | 0.0008 | better | 4 of 4 (p = 0.125) |" in text
    only = rows[("e-only 4", "GNMR+e 4")]
    tie = pr.tie(only["mean"], float(only["half"]), 0.010)
    assert only["word"] == only["verdict"] + (" (a tie)" if tie else "")
    assert f"| {only['word']} |" in text
    apart = summary.context(Source(tmp_path))["apart"]  # the top: seeds of planned, verdicts
    assert [(name, seeds) for name, seeds, _ in apart["ablation"]] == [
        ("outlier_delayed_ablation", "4 of 8")
    ]
    assert apart["stage5"] == []
    top = _section(tmp_path, "summary")  # and words its verdicts
    assert "GNMR+e lean 4 - random 4 -0.0029 +- 0.0008 better" in top
    # its arms table: half the gap closed with 1 unit of 28
    assert "| GNMR+e lean 4 | 3.6% | +0.0050 +- 0.0000 | +0.50 +- 0.00 |" in text
