"""The branch estimator (issue 24): a branch is the trunk's own continuation when its policy is
the trunk's, its perturbation is the size it claims, the FP4 controls run what they say, and
the statistics return known answers on constructed records."""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import replace

import pytest
import torch

from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import (
    Instrument,
    load_trunk,
    perturb,
    run_branch,
    trunk_file,
)
from benchmarks.harness.branch_stats import (
    Design,
    paired,
    read_records,
    share_closed,
    troubles,
    unit_step_share,
)
from benchmarks.harness.model import Batches
from benchmarks.harness.training import ArmRun
from benchmarks.sweep.branch_arms import make_arms, nvidia_k, step_time_arms
from benchmarks.sweep.regimes import FP4_REGIMES
from tests.benchmarks.test_harness import tiny, tiny_trunk

Q = {"backend": "fp8_emulated", "low_cost": {"format": "e2m1"}, "recovery": {"format": "bf16"}}
INST = Instrument(trunk_steps=8, points=(3, 5), horizon=3, evals=(1, 3), eval_batches=1)


@pytest.fixture(scope="module")
def trunk(tmp_path_factory, one_thread):
    return tiny_trunk(tmp_path_factory.mktemp("trunk"), Q, INST)


def test_a_branch_with_the_trunks_policy_is_its_continuation(trunk):
    """Branching from step 3 with the reference policy reproduces the trunk's steps 4-5 and its
    checkpoint at 5 bit for bit: the branches start where the trunk was, nothing else moved."""
    setup, root = trunk
    record = run_branch(setup, Arm("BF16", "recovery", **Q), INST, 3, 3, root, False)
    saved = torch.load(trunk_file(root, 3, 5), weights_only=True)
    s = replace(setup, steps=INST.trunk_steps, seed=3, eval_every=10**9)
    run = ArmRun(s, Arm("BF16", "recovery", **Q), Batches(s.heldout, s), evaluates=False)
    load_trunk(run, trunk_file(root, 3, 3))
    train = Batches(s.data, s)
    for step in (4, 5):
        run.step(step, train)
    assert run.losses == record["train_loss"][:2]
    model = run.model.state_dict()
    assert all(torch.equal(model[k], v) for k, v in saved["model"].items())
    assert set(record["heldout"]) == {"1", "3"} and record["unit_steps"] == 3 * 14
    assert record["recovered_unit_steps"] == 3 * 14  # BF16: every unit (14), every step


def test_fp4_arms_differ_from_bf16_and_the_nulls_are_small(trunk):
    setup, root = trunk
    runs = {
        name: run_branch(setup, Arm(name, policy, **Q), INST, 3, 5, root, pert)
        for name, policy, pert in [
            ("BF16", "recovery", False),
            ("null", "recovery", True),
            ("FP4", "static", False),
        ]
    }
    h = {n: r["heldout"]["3"] for n, r in runs.items()}
    assert h["FP4"] != h["BF16"] and runs["FP4"]["recovered_unit_steps"] == 0
    assert abs(h["null"] - h["BF16"]) < 1e-4 < abs(h["FP4"] - h["BF16"])


def test_perturb_moves_every_tensor_by_the_relative_size():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    before = [p.detach().clone() for p in model.parameters()]
    perturb(model, 1e-6, seed=4)
    for old, new in zip(before, model.parameters(), strict=True):
        rel = (new - old).norm() / old.square().mean().sqrt() / math.sqrt(old.numel())
        assert 0.8e-6 < rel < 1.2e-6


def test_late_and_last_units_policies(trunk):
    setup, root = trunk
    late = run_branch(setup, Arm("late", "late", late_steps=1, **Q), INST, 3, 3, root, False)
    assert late["recovered_unit_steps"] == 14  # every unit, the branch's last step only
    last = run_branch(setup, Arm("last", "last_units", max_active=2, **Q), INST, 3, 3, root, False)
    assert last["recovered_unit_steps"] == 2 * 3
    assert last["unit_recovered"] == [0] * 12 + [3, 3]  # per unit: the last two, every step
    s = replace(setup, steps=8, seed=3)
    run = ArmRun(s, Arm("last", "last_units", max_active=2, **Q), Batches(s.heldout, s))
    names = [run.registry.names[u] for u in sorted(run.fixed)]
    assert names == ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]


def test_fp4_regimes_share_their_trunks():
    """The trunk is the regime's recovery path on the same setup: one for every FP4 regime."""
    trunks = {(repr(r.setup), repr(r.recovery), r.backend) for r in FP4_REGIMES.values()}
    assert len(trunks) == 1
    assert len({r.instrument for r in FP4_REGIMES.values()}) == 1


def test_the_sweep_arms_and_nvidias_budget():
    regime = FP4_REGIMES["nvfp4"]
    arms = {a.name: (a, p) for a, p in make_arms(regime, (2, 4), 28)}
    assert nvidia_k(28) == 4 and "NVIDIA last-4" in arms and "NVIDIA late-7" in arms
    assert arms["NVIDIA late-7"][0].late_steps == round(50 * 4 / 28)
    assert arms["low-cost (SR seed 1)"][0].low_cost["seed"] == 1
    assert arms["null BF16 (1e-6)"][1] and arms["null low-cost (1e-6)"][1]
    assert arms["GNMR+e 4"][0].controller == {"gamma": regime.gamma}
    assert {f"{p} {k}" for p in ("random", "GNMR", "GNMR+e", "oracle") for k in (2, 4)} <= set(arms)


# ---------------------------------------------------------------------------- statistics


def records_of(values: dict[str, list[list[float]]], horizon: int = 5) -> dict:
    """Constructed records: values[arm][seed][point] is the held-out loss at the horizon."""
    out = {}
    for arm, rows in values.items():
        for s, row in enumerate(rows):
            for p, v in enumerate(row):
                out[(arm, s, p)] = {
                    "heldout": {str(horizon): v},
                    "train_loss": [1.0, 1.0],
                    "nonfinite": 0,
                    "recovered_unit_steps": {"low-cost": 0, "BF16": 10}.get(arm, 2),
                    "unit_steps": 10,
                }
    return out


def test_paired_differences_average_points_then_take_the_interval_over_seeds():
    r = records_of(
        {
            "BF16": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
            "low-cost": [[1.1, 2.1], [3.2, 4.2], [5.3, 6.3]],
            "half": [[1.05, 2.05], [3.1, 4.1], [5.15, 6.15]],
        }
    )
    d = Design(seeds=(0, 1, 2), points=(0, 1), horizon=5)
    m, h = paired(r, d, "low-cost", "BF16")
    assert m == pytest.approx(0.2) and h == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    share, half = share_closed(r, d, "half")
    assert share == pytest.approx(0.5) and half == pytest.approx(0.0, abs=1e-6)
    assert unit_step_share(r, d, "half") == pytest.approx(0.2)
    assert troubles(r, d, "low-cost") == (0, 0)


def test_share_interval_grows_with_the_spread_of_the_arm():
    base = {"BF16": [[1.0], [1.0], [1.0], [1.0]], "low-cost": [[1.2], [1.2], [1.2], [1.2]]}
    r = records_of({**base, "arm": [[1.05], [1.15], [1.1], [1.1]]})
    d = Design(seeds=(0, 1, 2, 3), points=(0,), horizon=5)
    share, half = share_closed(r, d, "arm")
    sd = statistics.stdev([0.15, 0.05, 0.1, 0.1]) / 0.2
    assert share == pytest.approx(0.5) and half == pytest.approx(3.182 * sd / 2)


def test_spikes_and_divergence_are_counted_against_bf16():
    r = records_of({"BF16": [[1.0]], "low-cost": [[3.0]]})
    r[("low-cost", 0, 0)]["train_loss"] = [1.2, math.nan]
    d = Design(seeds=(0,), points=(0,), horizon=5)
    # the non-finite step is a spike, +0.2 on the first step is not (no trend before it:
    # tests/benchmarks/test_spikes.py); held-out +2 > 1: diverged
    assert troubles(r, d, "low-cost") == (1, 1)


def test_step_time_interleaves_gnmr_e_and_nvidias_rule(tmp_path, caplog):
    from benchmarks.sweep.fp4_step_time import step_time

    caplog.set_level(logging.INFO)
    regime = replace(
        FP4_REGIMES["nvfp4"],
        setup=tiny(steps=8, lr=1e-3, gnmr={"warmup_steps": 0}),
        instrument=INST,
        units=14,
    )
    got = step_time(regime, *step_time_arms(regime), steps=3, root=tmp_path)
    assert set(got) == {
        "NVIDIA last-2",
        "GNMR+e 2",
        "GNMR+e 2 replayed",
        "vs_nvidia",
        "vs_replayed",
    }
    assert got["vs_nvidia"] == pytest.approx(got["GNMR+e 2"] / got["NVIDIA last-2"])
    assert "same weights at the end: True" in caplog.text


def test_step_time_runs_are_appended_where_the_report_reads_them(tmp_path):
    from benchmarks.report.source import Source
    from benchmarks.sweep.fp4_step_time import save

    got = {"NVIDIA last-4": 600.0, "GNMR+e 4": 612.0, "GNMR+e 4 replayed": 600.0}
    got |= {"vs_nvidia": 1.02, "vs_replayed": 1.02}
    path = tmp_path / "sweep_fp4_step_time_nvfp4.json"
    for _ in range(2):
        assert save(FP4_REGIMES["nvfp4"], got, steps=40, path=path) == path
    stored = json.loads(path.read_text())
    assert len(stored["runs"]) == 2 and stored["runs"][0]["point"] == 175
    assert stored["runs"][1]["ms"]["GNMR+e 4"] == 612.0
    assert {"commit", "versions", "host"} <= set(stored["runs"][1]["provenance"])
    row = Source(tmp_path).provenance_table({path.name: "-"}).splitlines()[-1]
    assert row.startswith(f"| `{path.name}` | - | 2 | ") and "(2): git rev-parse" in row


def test_report_reads_constructed_records(tmp_path, caplog):
    """A regime where the oracle closes the gap and GNMR+e half of it, random nothing."""
    from benchmarks.sweep.fp4_report import report

    caplog.set_level(logging.INFO)
    regime = FP4_REGIMES["fp4_tensor"]
    arms = [a.name for a, _ in make_arms(regime, (4,), 28)]
    base = [[2.0, 2.1], [2.2, 2.3], [2.4, 2.5]]
    shift = {"low-cost": 0.2, "oracle 4": 0.0, "GNMR+e 4": 0.1, "random 4": 0.2}
    noise = [0.002, -0.001, 0.0005]
    values = {
        a: [
            [v + shift.get(a, 0.2) + noise[s] * (a != "BF16") for v in row]
            for s, row in enumerate(base)
        ]
        for a in arms
    }
    values["BF16"] = base
    values["null BF16 (1e-6)"] = base
    r = records_of(values, horizon=50)
    d = Design(seeds=(0, 1, 2), points=(0, 1), horizon=50)
    out = report(regime, d, r, arms, (4,), out_dir=tmp_path)
    text = caplog.text
    assert "- GNMR+e 4 - random 4: -0.1000 +- 0.0000 -> better" in text
    assert out["verdicts"]["oracle 4 - random 4"] == "better"
    assert out["summary"]["GNMR+e 4"]["closed"][0] == pytest.approx(0.1 / 0.2005)
    assert out["summary"]["GNMR+e 4"]["spikes_vs_low_cost"] == (0.0, 0.0)  # flat: no spike
    assert out["summary"]["low-cost"]["spikes_vs_low_cost"] is None
    assert out["spike_rule"] == {"window": 10, "k": 6.0, "floor": 0.005}
    saved = json.loads((tmp_path / "sweep_fp4_fp4_tensor.json").read_text())
    assert saved["noise"]["static gap (low-cost - BF16)"][0] == pytest.approx(0.2005)
    assert (tmp_path / "sweep_fp4_fp4_tensor.png").exists()
    # the null's interval (0 +- 0: the same values) holds 0 and is within a third of the gap
    assert "- static gap resolved (interval excludes 0): True" in text
    assert "- check null BF16 (1e-6) - BF16: holds 0 True; half-width / static gap 0.00" in text


def test_records_survive_a_line_cut_short(tmp_path):
    path = tmp_path / "x.jsonl"
    rows = [{"arm": "a", "seed": 1, "point": p, "heldout": {"5": p}} for p in (3, 5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"arm": "a", "se')
    assert sorted(read_records(path)) == [("a", 1, 3), ("a", 1, 5)]
    path.write_text('{"arm": \n' + json.dumps(rows[0]) + "\n")
    with pytest.raises(json.JSONDecodeError):
        read_records(path)


def test_points_are_a_subset_of_the_trunks_checkpoints():
    from benchmarks.sweep.branches import _points

    regime = FP4_REGIMES["nvfp4"]
    assert _points("", regime) == tuple(regime.instrument.points)
    assert _points("250,100", regime) == (250, 100)
    with pytest.raises(SystemExit, match=r"--points '100,150'.*saved at \[100, 175, 250, 325\]"):
        _points("100,150", regime)


def test_noise_reports_the_static_gap_at_every_recorded_horizon():
    from benchmarks.sweep.fp4_report import noise

    r = records_of({"low-cost": [[2.3, 2.4], [2.5, 2.7]], "BF16": [[2.0, 2.1], [2.2, 2.3]]}, 50)
    for (arm, _, _), rec in r.items():
        rec["heldout"]["25"] = rec["heldout"]["50"] - (0.1 if arm == "low-cost" else 0.0)
    est = noise(r, Design(seeds=(0, 1), points=(0, 1), horizon=50))
    assert est["static gap (low-cost - BF16)"][0] == pytest.approx(0.325)
    assert est["static gap after 25 steps"][0] == pytest.approx(0.225)


def test_picks_name_the_units_an_arm_recovered_most():
    from benchmarks.sweep.fp4_report import picks

    r = records_of({"GNMR+e 4": [[2.0, 2.0]]}, 50)
    d = Design(seeds=(0,), points=(0, 1), horizon=50)
    assert picks(r, d, "GNMR+e 4") == []  # records from before the per-unit counts
    counts = [0] * 28
    counts[2], counts[27] = 30, 10
    for rec in r.values():
        rec["unit_recovered"] = counts
    assert picks(r, d, "GNMR+e 4") == [("L0.v", 0.75), ("L3.down", 0.25)]


def test_nvidias_rules_are_compared_at_their_own_budget_only():
    from benchmarks.sweep.fp4_report import comparisons

    regime = FP4_REGIMES["fp4_tensor"]
    arms = [a.name for a, _ in make_arms(regime, (2, 4, 7), 28)]
    r = records_of({a: [[2.0, 2.1], [2.2, 2.3]] for a in arms}, 50)
    nvidia = [a for a in arms if a.startswith("NVIDIA")]
    names = [n for n, _ in comparisons(r, Design((0, 1), (0, 1), 50), (2, 4, 7), nvidia)]
    assert "GNMR+e 4 - NVIDIA late-7" in names and "GNMR+e 4 - NVIDIA last-4" in names
    assert not [n for n in names if n.startswith(("GNMR+e 2 - NVIDIA", "GNMR+e 7 - NVIDIA"))]


def test_report_files_name_a_design_other_than_the_default():
    from benchmarks.sweep.branches import SEEDS, design_suffix

    regime = FP4_REGIMES["mxfp4"]
    assert design_suffix(regime, (4,), regime.instrument.points) == ""
    assert design_suffix(regime, (4,), (100, 250)) == "_p100-250"
    assert design_suffix(regime, (2, 4, 7), (100, 250)) == "_k2-4-7_p100-250"
    assert design_suffix(regime, (4,), regime.instrument.points, SEEDS[::-1]) == ""
    assert design_suffix(regime, (4,), (100, 250), (1234, 7)) == "_p100-250_s1234-7"


def test_arms_are_picked_by_exact_name_or_a_prefix():
    from benchmarks.sweep.branches import select_arms

    arms = make_arms(FP4_REGIMES["nvfp4"], (2, 4), 28)
    names = lambda text: [a.name for a, _ in select_arms(arms, text)]  # noqa: E731
    assert names("low-cost") == ["low-cost"]  # not the null controls, not SR seed 1
    assert names(" GNMR+e 4 ,BF16") == ["BF16", "GNMR+e 4"]
    assert names("GNMR+e*,null*") == [
        "null BF16 (1e-6)",
        "null low-cost (1e-6)",
        "GNMR+e 2",
        "GNMR+e 4",
    ]
    assert len(names("")) == len(arms)
    with pytest.raises(SystemExit, match=r"no arm named 'lowcost'; the arms: 'low-cost', 'BF16'"):
        names("low-cost,lowcost")


def test_report_only_reads_exactly_the_designs_records(monkeypatch, tmp_path):
    """--report-only with other seeds: exactly their branches, a file named by them; a seed
    without records is refused, naming its branches."""
    from benchmarks.sweep import branches, fp4_report

    regime = FP4_REGIMES["nvfp4"]
    names = [a.name for a, _ in make_arms(regime, (4,), regime.units)]
    points = regime.instrument.points
    path = tmp_path / "nvfp4.jsonl"
    rows = [{"arm": a, "seed": s, "point": p} for a in names for s in (1234, 7, 42) for p in points]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(branches, "records_file", lambda name: path)
    got = {}
    monkeypatch.setattr(fp4_report, "report", lambda *a, **kw: got.update(args=a, **kw))
    branches.main(["--regime", "nvfp4", "--report-only", "--seeds", "1234,7"])
    _, design, records, arms, _ = got["args"]
    assert got["suffix"] == "_s1234-7" and design.seeds == (1234, 7) and arms == names
    assert sorted(records) == sorted((a, s, p) for a in names for s in (1234, 7) for p in points)
    n = len(names) * len(points)
    with pytest.raises(SystemExit, match=rf"{n} branches missing: \('low-cost', 99, 100\), "):
        branches.main(["--regime", "nvfp4", "--report-only", "--seeds", "1234,7,99"])


def test_fault_and_seed_regimes_leave_their_report_to_results_md(monkeypatch, tmp_path, caplog):
    """Their records are the report (RESULTS.md renders them): no sweep_fp4_* file is written."""
    from benchmarks.sweep import branches, fp4_report
    from benchmarks.sweep.regimes import BRANCH_REGIMES

    regime = BRANCH_REGIMES["outlier_delayed"]
    names = [a.name for a, _ in make_arms(regime, (4,), regime.units)]
    path = tmp_path / "outlier_delayed.jsonl"
    rows = [
        {"arm": a, "seed": s, "point": p}
        for a in names
        for s in (1234, 7)
        for p in regime.instrument.points
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(branches, "records_file", lambda name: path)
    monkeypatch.setattr(fp4_report, "report", lambda *a, **kw: pytest.fail("reported"))
    with caplog.at_level(logging.INFO, logger=branches.logger.name):
        branches.main(["--regime", "outlier_delayed", "--report-only", "--seeds", "1234,7"])
    assert "its report is benchmarks/RESULTS.md's faults section" in caplog.text
    assert f"({len(rows)} records)" in caplog.text


def test_branch_regimes_write_to_their_familys_folder():
    from benchmarks.harness.common import RESULTS
    from benchmarks.sweep.branches import parse_args, records_file
    from benchmarks.sweep.regimes import BRANCH_REGIMES

    for name, regime in BRANCH_REGIMES.items():
        assert records_file(name) == RESULTS / regime.family / f"{name}.jsonl"
        assert parse_args(["--regime", name]).regime == name
    assert records_file("nvfp4") == RESULTS / "fp4" / "nvfp4.jsonl"
