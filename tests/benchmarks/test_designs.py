"""benchmarks/harness/designs.py: which records a table reads (the largest complete design, the
arms that wait outside it), on the fault records test_report.py constructs."""

from __future__ import annotations

from benchmarks.harness.designs import choose_arms, largest_design
from tests.benchmarks.test_report import (
    FAULT_ARMS,
    FAULT_POINTS,
    FAULT_SEEDS,
    _fault_record,
    _fault_records,
    _keyed,
)


def test_the_largest_design_has_the_most_branches_then_the_most_seeds():
    arms = {"low-cost": (0.0, 0.0), "BF16": (0.0, 1.0)}
    rows = _fault_records(arms, seeds=(1, 2), points=(100, 250))
    rows += _fault_records(arms, seeds=(3,), points=(100,))
    d = largest_design(_keyed(rows), list(arms), 50)
    assert (d.seeds, d.points) == ((1, 2), (100, 250))  # 4 branches per arm against 3
    rows += _fault_records(arms, seeds=(4,), points=(100,))
    d = largest_design(_keyed(rows), list(arms), 50)
    assert (d.seeds, d.points) == ((1, 2, 3, 4), (100,))  # 4 against 4: more seeds


def test_an_arm_with_one_seed_waits_outside_the_design():
    rows = _fault_records({a: FAULT_ARMS[a] for a in ("low-cost", "BF16")})
    rows.append(_fault_record("GNMR+e 4", 1, 100, 0.004, 4 / 28))
    d, kept, waiting = choose_arms(_keyed(rows), ["low-cost", "BF16", "GNMR+e 4"], 50)
    assert (kept, waiting) == (["low-cost", "BF16"], ["GNMR+e 4"])
    assert d.seeds == FAULT_SEEDS and d.points == FAULT_POINTS
    # with the static arms on one seed too, nothing is gained by leaving it out
    one = [r for r in rows if r["seed"] == 1]
    d, kept, waiting = choose_arms(_keyed(one), ["low-cost", "BF16", "GNMR+e 4"], 50)
    assert (kept, waiting, d.points) == (["low-cost", "BF16", "GNMR+e 4"], [], (100,))


def test_a_pilots_static_gap_reads_the_seeds_with_both_static_arms():
    from benchmarks.harness.designs import static_gap

    rows = _fault_records(
        {"low-cost": (0.003, 0.0), "BF16": (0.0, 1.0)}, seeds=(1, 2), points=(100,)
    )
    rows.append(_fault_record("low-cost", 3, 100, 0.003, 0.0))  # no BF16 branch: left out
    d, peak, (mean, half) = static_gap(_keyed(rows))
    assert (d.seeds, d.points, d.horizon) == ((1, 2), (100,), 50)
    assert peak == 20  # growth 4 over a 10-step rise: 4^10 = 2^20
    assert abs(mean - 0.003) < 1e-12 and half < 1e-9


def test_the_old_cost_model_with_no_gap_costs_no_extra_steps():
    from benchmarks.harness import cost
    from benchmarks.harness.designs import old_cost

    rows = _fault_records({"low-cost": (0.0, 0.0), "BF16": (0.0, 1.0)}, seeds=(1, 2), points=(100,))
    records = _keyed(rows)
    spec = records[("low-cost", 1, 100)]["arm_spec"]
    price = cost.price(cost.Formats(spec["backend"], spec["low_cost"], spec["recovery"]), "B200")
    d = largest_design(records, ["low-cost", "BF16"], 50)
    o = old_cost(records, d, price)
    assert o["extra"] == 0 and o["worst"] == (100, 0)
    # with no extra steps the mean of ratios and the ratio at the mean are both 1 / t(0)
    assert abs(o["at_mean"] - 1 / cost.step_time(0.0, price)) < 1e-12
    assert abs(o["ratios"] - o["at_mean"]) < 1e-12
