"""The bounded cost model (issue 44): a branch that cannot reach BF16's loss inside the schedule
is "not reached", never a speed-up; the speed-up is the ratio at the mean extra steps, not the
mean of per-branch ratios; a point that ends the schedule is counted apart; steps to BF16's
final loss; the error term's measured cost; one column per hardware group. Figures by hand on
constructed records."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.branch_stats import Design
from benchmarks.harness.cost import (
    ErrorCost,
    Formats,
    Price,
    branch_cost,
    cost_table,
    error_every,
    error_share,
    hardware_groups,
    price,
    priced_points,
    speedup_at_mean,
    step_time,
    steps_to_target,
    summarize_costs,
)
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source

FP8 = Formats("fp8_emulated", {"format": "e4m3"}, {"format": "bf16"})
GAMMA = {"controller": {"gamma": 0.02}, "error_every": 1}


def rec(arm, seed, point, h25, h50, flops=0.0, spec=None):
    r = {"arm": arm, "seed": seed, "point": point, "heldout": {"25": h25, "50": h50}}
    r |= {"recovered_unit_steps": 0, "unit_steps": 1400, "flops_recovered": flops}
    return r | ({"arm_spec": spec} if spec is not None else {})


def records(*rows):
    return {(r["arm"], r["seed"], r["point"]): r for r in rows}


def test_a_branch_past_the_schedule_is_not_reached():
    """r = 0.004 / step, g = +0.2: D = 50 extra steps. From point 250 the 400-step schedule
    leaves 100: reached; from point 325, 25: not reached, no speed-up, the note says so."""
    bf16 = rec("BF16", 1, 250, 2.1, 2.0, flops=1.0)
    low = rec("low-cost", 1, 250, 2.3, 2.2)
    p = price(FP8, "B200")
    ok = branch_cost(low, bf16, 50, p, left=400 - 250 - 50)
    assert ok.extra_steps == pytest.approx(50.0) and ok.reached is True
    assert ok.speedup == pytest.approx(50 / (100 * 0.5))
    late = branch_cost(low, bf16, 50, p, left=25)
    assert late.reached is False and late.speedup is None
    assert late.note == "not reached: 50 extra steps, 25 left in the schedule"
    assert late.extra_steps == pytest.approx(50.0)  # the model's figure, kept for the record
    assert branch_cost(low, bf16, 50, p).reached is True  # no schedule: unbounded


def test_an_arm_with_a_branch_not_reached_gets_no_speed_up():
    """Two seeds at points 100 and 300 (400-step schedule: 250 and 50 steps left). Seed 2's
    low-cost branch at 300 needs 75 steps: not reached; the arm has no extra steps and no
    speed-up on any hardware, the count says 1 of 4."""
    rows = []
    for s in (1, 2):
        for pt in (100, 300):
            rows.append(rec("BF16", s, pt, 2.1, 2.0, flops=1.0))
            rows.append(rec("low-cost", s, pt, 2.13, 2.3 if (s, pt) == (2, 300) else 2.02))
    d = Design(seeds=(1, 2), points=(100, 300), horizon=50)
    row = summarize_costs(records(*rows), d, FP8, schedule=400)["low-cost"]
    assert row["not_reached"] == (1, 4)
    assert row["extra_steps"] is None and row["extra_steps_note"] == "not reached on 1 of 4"
    for hw in ("B200", "GB300", "Hopper"):
        assert row["hardware"][hw]["speedup"] is None
        assert row["hardware"][hw]["note"] == "not reached on 1 of 4"
    table = cost_table(summarize_costs(records(*rows), d, FP8, schedule=400))
    assert "| low-cost | 0.0% | - | not reached on 1 of 4 |" in table
    assert table.splitlines()[-1].endswith("| not reached on 1 of 4 |")
    # without the bound the old model would have priced it
    unbounded = summarize_costs(records(*rows), d, FP8)["low-cost"]
    assert unbounded["hardware"]["B200"]["speedup"] is not None


def test_a_point_that_ends_the_schedule_is_counted_apart():
    """Point 350 + 50 = 400 ends the schedule: no step is left to match in, so its branches are
    left out of the extra steps and speed-ups of every arm and counted as behind or not."""
    rows = []
    for s in (1, 2, 3):
        for pt in (100, 350):
            rows.append(rec("BF16", s, pt, 2.1, 2.0, flops=1.0))
            rows.append(rec("GNMR+e 4", s, pt, 2.1, 2.0 + (0.0001 if pt == 350 else 0.0), 0.1))
    d = Design(seeds=(1, 2, 3), points=(100, 350), horizon=50)
    assert priced_points(d, 400) == (100,)
    assert priced_points(d, None) == (100, 350)
    row = summarize_costs(records(*rows), d, FP8, schedule=400)["GNMR+e 4"]
    assert row["at_end"] == (3, 3) and row["not_reached"] == (0, 3)
    assert row["extra_steps"] == (0.0, 0.0)
    t = 0.9 * 0.5 + 0.1
    assert row["hardware"]["B200"]["speedup"] == (pytest.approx(1 / t), 0.0)
    table = cost_table(summarize_costs(records(*rows), d, FP8, schedule=400))
    assert "behind BF16 at the schedule's end" in table.splitlines()[0]
    assert "| GNMR+e 4 | 10.0% | - | 0.0 +- 0.0 | 3 of 3 | by 50: 3, not by 50: 3 |" in table


def test_the_speed_up_is_the_ratio_at_the_mean_extra_steps():
    """Per seed D = 0 and 100 (t = 0.5 each): the ratio at the mean is 50 / (100 * 0.5) = 1.0,
    the mean of the seeds' ratios (2.0 + 0.667) / 2 = 1.333: the convexity the old model had."""
    assert speedup_at_mean(50, [0.0], [0.5]) == (
        pytest.approx(2.0),
        pytest.approx(float("nan"), nan_ok=True),
    )
    s, half = speedup_at_mean(50, [0.0, 100.0], [0.5, 0.5])
    assert s == pytest.approx(1.0)
    mean_of_ratios = (2.0 + 50 / (150 * 0.5)) / 2
    assert mean_of_ratios == pytest.approx(1.3333, abs=1e-4)
    # delta method: linearized 1 - (D_s - 50) / 100 = 1.5 and 0.5; 12.706 * stdev / sqrt(2)
    assert half == pytest.approx(12.706 * 0.5)
    assert speedup_at_mean(50, [-60.0, -50.0], [0.5, 0.5]) is None  # H + D <= 0


def test_steps_to_target_by_evaluation_step():
    """The first evaluation at or below BF16's loss after 50 steps (2.0)."""
    bf16 = rec("BF16", 1, 100, 2.1, 2.0)
    assert steps_to_target(rec("a", 1, 100, 1.99, 2.05), bf16, 50) == 25  # there, then lost
    assert steps_to_target(rec("a", 1, 100, 2.05, 2.0), bf16, 50) == 50  # ties count
    assert steps_to_target(rec("a", 1, 100, 2.05, 2.0001), bf16, 50) is None
    assert steps_to_target(bf16, bf16, 50) == 50


def test_the_error_term_is_priced_per_measuring_step():
    """C = 5% of a low-cost step, measured every step: FP8 on B200, nothing recovered:
    t = 0.5 + 0.05 * 0.5 = 0.525; every 8th step: 0.5 + 0.05 / 8 * 0.5."""
    p = price(FP8, "B200")
    e = ErrorCost(0.05, "a test")
    assert error_every(rec("a", 1, 1, 2, 2, spec=GAMMA)) == 1
    assert error_every(rec("a", 1, 1, 2, 2, spec={"controller": {}, "error_every": 1})) is None
    assert error_every(rec("a", 1, 1, 2, 2)) is None
    assert error_share(rec("a", 1, 1, 2, 2, spec=GAMMA | {"error_every": 8}), e) == 0.05 / 8
    assert error_share(rec("a", 1, 1, 2, 2, spec=GAMMA), None) is None  # measured, cost unknown
    assert step_time(0.0, p, 0.05) == pytest.approx(0.525)
    assert step_time(0.2, Price(0.25, 1.0), 0.04) == pytest.approx(0.8 * 0.25 + 0.2 + 0.01)
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    arm = rec("GNMR+e 4", 1, 100, 2.1, 2.0, spec=GAMMA)
    rs = records(bf16, arm)
    d = Design(seeds=(1,), points=(100,), horizon=50)
    row = summarize_costs(rs, d, FP8, schedule=400, error=e)["GNMR+e 4"]
    assert row["error"] == (0.05, 1)
    assert row["hardware"]["B200"]["speedup"][0] == pytest.approx(1 / 0.525)  # 1.905, not 2
    assert "| GNMR+e 4 | 0.0% | +5.0% (every step) |" in cost_table(
        summarize_costs(rs, d, FP8, schedule=400, error=e)
    )
    unknown = summarize_costs(rs, d, FP8, schedule=400)["GNMR+e 4"]["hardware"]["B200"]
    assert unknown["speedup"] is None and "error term's cost is not known" in unknown["note"]


def test_the_error_cost_is_read_from_its_result_file(tmp_path):
    """C = the median CPU-time ratio of gnmr+e k (error_every 1) to the low-cost path, less 1;
    a backend the run did not time gets the largest figure, named so."""

    def rows(r):
        return [{"arm": "low-cost", "cpu_ratio": 1.0}, {"arm": "gnmr+e k=3", "cpu_ratio": r}]

    (tmp_path / "overhead_error.json").write_text(
        json.dumps(
            {
                "budget": 3,
                "step_time": {
                    "act_quant / GNMRRuntime": rows(1.038),
                    "fp8_emulated / GNMRRuntime": rows(1.050),
                },
            }
        )
    )
    src = Source(tmp_path)
    e = error_cost(src, "fp8_emulated")
    assert e is not None and e.share == pytest.approx(0.050)
    assert e.source.startswith("results/overhead_error.json: fp8_emulated's gnmr+e k=3")
    borrowed = error_cost(src, "torchao_fp8")
    assert borrowed is not None and borrowed.share == pytest.approx(0.050)
    assert borrowed.source.startswith("not timed on torchao_fp8: the largest figure measured")
    assert error_cost(Source(tmp_path / "none"), "fp8_emulated") is None


def test_the_committed_error_cost():
    """The repository's own measured figure: fp8_emulated's 1.050 (RESULTS.md's error term)."""
    e = error_cost(Source(), "fp8_emulated")
    assert e is not None and e.share == pytest.approx(0.0498, abs=1e-4)


def test_one_column_per_hardware_group():
    """FP8 prices alike on all three: one column; NVFP4 differs on each: three."""
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    low = rec("low-cost", 1, 100, 2.1, 2.0)
    d = Design(seeds=(1,), points=(100,), horizon=50)
    fp8 = summarize_costs(records(bf16, low), d, FP8)
    assert hardware_groups(fp8) == [("B200", "GB300", "Hopper")]
    assert cost_table(fp8, details=False).splitlines()[0] == (
        "| arm | speed-up at matched loss, B200, GB300, Hopper |"
    )
    nvfp4 = Formats("fp8_emulated", {"format": "e2m1"}, {"format": "bf16"})
    assert hardware_groups(summarize_costs(records(bf16, low), d, nvfp4)) == [
        ("B200",),
        ("GB300",),
        ("Hopper",),
    ]


def test_the_report_schedules_match_the_regimes():
    """The report's schedule ends (no torch there) are the regimes' trunk lengths."""
    from benchmarks.report.branches import SCHEDULE_END
    from benchmarks.report.paper_branch import SCHEDULES
    from benchmarks.sweep.regimes import FAULT_REGIMES, PAPER_REGIMES

    for name, regime in FAULT_REGIMES.items():
        assert regime.instrument.trunk_steps == SCHEDULE_END, name
    for name, regime in PAPER_REGIMES.items():
        assert regime.instrument.trunk_steps == SCHEDULES.get(name, SCHEDULE_END), name
