"""Hand-computed traces of the second policy (docs/algorithm.md): clocks, budget schedules, the
compute-share walk, latches, pinned units, accounting and the constructor's and step's inputs."""

from __future__ import annotations

import math

import pytest

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.core.config import Pinned
from tests.core.test_controller import make

NAN = math.nan
FLAT = [1.0, 1.0, 1.0, 1.0]


def run(ctrl, rows, lrs=None):
    lrs = lrs if lrs is not None else [None] * len(rows)
    return [ctrl.step(r, lr=lr) for r, lr in zip(rows, lrs, strict=True)]


# ------------------------------------------------------------------------------ clocks


def test_from_and_the_step_shape_on_the_step_clock():
    lin = {"schedule": "linear", "start": 4.0, "end": 2.0, "steps": 4, "from": 3}
    ds = run(make(1, alpha=lin), [[1.0]] * 8)
    # f = min(max(t - 3, 0) / 4, 1): 0, 0, 0, 1/4, 2/4, 3/4, 1, 1
    assert [d.alpha for d in ds] == [4.0, 4.0, 4.0, 3.5, 3.0, 2.5, 2.0, 2.0]
    step = {"schedule": "step", "start": 4.0, "end": 2.0, "steps": 3, "from": 5}
    ds = run(make(1, alpha=step), [[1.0]] * 9)
    assert [d.alpha for d in ds] == [4.0] * 7 + [2.0, 2.0]  # end from step m + n = 8 on


def test_the_lr_decay_clock_reads_the_decay_from_the_peak():
    sched = {"schedule": "linear", "start": 4.0, "end": 2.0, "clock": "lr_decay", "from": 0.5}
    lrs = [0.0, 0.5, 1.0, 1.0, 0.5, 0.25, 0.0]
    # peaks 0, .5, 1, 1, 1, 1, 1 -> d = 0, 0, 0, 0, .5, .75, 1 -> f = (d - .5) / .5 clipped
    ds = run(make(1, alpha=sched), [[1.0]] * 7, lrs)
    assert [d.alpha for d in ds] == [4.0, 4.0, 4.0, 4.0, 4.0, 3.0, 2.0]
    step = {"schedule": "step", "start": 4.0, "end": 2.0, "clock": "lr_decay", "to": 0.5}
    ds = run(make(1, beta=step), [[1.0]] * 4, [1.0, 0.6, 0.5, 0.9])
    assert [d.beta for d in ds] == [4.0, 4.0, 2.0, 4.0]  # d = 0, .4, .5, .1: switched at d >= q


def test_lr_is_required_on_the_lr_clock_and_checked_and_tracked_otherwise():
    ctrl = make(1, latch={"lr_decay": 0.5})
    with pytest.raises(ValueError, match=r"gnmr\.latch runs on the lr_decay clock, so step"):
        ctrl.step([1.0])
    assert ctrl.step_count == 0
    for bad in (NAN, -0.1, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match=r"lr must be a finite number >= 0 .*got"):
            ctrl.step([1.0], lr=bad)
    plain = make(1)
    plain.step([1.0], lr=0.3)  # unused: accepted, its peak kept for a resume that needs it
    plain.step([1.0], lr=0.1)
    plain.step([1.0])
    assert float(plain.state_dict()["lr_peak"]) == 0.3


# ------------------------------------------------------------------------------ budgets


def test_a_budget_schedule_is_floored_and_reported():
    sched = {"schedule": "linear", "start": 0, "end": 3, "steps": 4}  # 0 .75 1.5 2.25 3
    ds = run(make(4, max_active=sched), [[NAN] * 4] * 5)
    # every unit scores +inf: ties go to the lower id, so A_t is the first k_t ids
    assert [d.chosen for d in ds] == [(), (), (0,), (0, 1), (0, 1, 2)]
    assert [d.telemetry.budget for d in ds] == [0, 0, 1, 2, 3]
    assert ds[0].telemetry.as_dict()["budget"] == 0.0 and ds[0].candidates == (0, 1, 2, 3)


def spike(u_costs, share, k=4, row=(9.0, 7.0, 5.0, 3.0), total=20):
    ctrl = make(4, {"costs": u_costs, "total_cost": total}, max_active=k, max_share=share)
    return run(ctrl, [FLAT] * 3 + [list(row)])[-1]


def test_the_share_walk_skips_a_unit_that_does_not_fit_and_goes_on():
    # risks 6, 14/3, 10/3, 2: order 0, 1, 2, 3; costs 6, 5, 2, 1 of W = 20
    d = spike([6, 5, 2, 1], 0.45)  # cap floor(9): 0 (6), 1 skipped (11), 2 (8), 3 (9)
    assert d.candidates == (0, 1, 2, 3) and d.chosen == (0, 2, 3) == d.active
    assert d.telemetry.plan_share == 9 / 20
    assert spike([6, 5, 2, 1], 0.45, k=2).chosen == (0, 2)  # |A| < k_t first
    assert spike([6, 5, 2, 1], 0.3).chosen == (0,)  # cap 6: 1, 2 and 3 each too dear after 0
    assert spike([6, 5, 2, 1], 0.25).chosen == (1,)  # cap 5: the riskiest costs too much
    assert spike([6, 5, 2, 1], 0.0).chosen == ()
    assert spike([6, 5, 2, 1], 1.0).chosen == (0, 1, 2, 3)


def test_the_share_cap_is_exact_for_the_decimal_given():
    # 0.3 as a double is just below 3/10; the cap is 3 units of cost 1 in W = 10, not 2
    d = spike([1, 1, 1, 1], 0.3, total=10, row=(9.0, 8.0, 7.0, 6.0))
    assert d.chosen == (0, 1, 2) and d.telemetry.plan_share == 0.3


# ------------------------------------------------------------------------------ latch


def test_a_latched_unit_stays_before_riskier_ones():
    rows = [[1, 1, 1]] * 3 + [[1, 5, 1], [1, 1, 1], [9, 1, 1], [1, 1, 1]]
    latched = make(3, lock_steps=1, latch={"step": 1})
    ds = run(latched, rows)
    assert [d.chosen for d in ds[3:]] == [(1,), (1,), (1,), (1,)]
    assert ds[5].candidates == (0, 1) and latched.latches.tolist() == [0, 4, 0]
    assert ds[5].telemetry.num_latched == 1 and latched.locks.tolist() == [0, 0, 0]
    # without the latch the lock of one step lets unit 1 go and unit 0 takes the budget
    plain = run(make(3, lock_steps=1), rows)
    assert [d.chosen for d in plain[3:]] == [(1,), (), (0,), ()]


def test_latches_leave_when_the_budget_shrinks_latest_first_and_for_good():
    k = {"schedule": "step", "start": 2, "end": 1, "steps": 7}  # 2 until step 7, 1 from 8
    ctrl = make(3, lock_steps=1, latch={"step": 1}, max_active=k)
    rows = [[1, 1, 1]] * 3 + [[1, 5, 1], [5, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    ds = run(ctrl, rows)
    assert [d.chosen for d in ds[3:]] == [(1,), (0, 1), (0, 1), (0, 1), (1,)]
    assert ctrl.latches.tolist() == [0, 4, 0]  # unit 0, latched at 5, went first
    ds = run(ctrl, [[1, 1, 1]] * 3)
    assert all(d.candidates == (1,) for d in ds)
    gone = make(3, lock_steps=1, latch={"step": 1}, max_active={**k, "end": 0})
    ds = run(gone, [*rows, [1, 1, 1]])
    assert ds[7].chosen == () and gone.latches.tolist() == [0, 0, 0]
    assert ds[8].candidates == ()


def test_the_latch_condition_on_the_lr_clock():
    ctrl = make(3, lock_steps=1, latch={"lr_decay": 0.5})
    rows = [[1, 1, 1]] * 3 + [[1, 5, 1], [1, 1, 1], [1, 1, 5], [1, 1, 1], [1, 1, 1]]
    lrs = [1.0] * 5 + [0.4] * 3  # d = 0 through step 5, 0.6 from step 6
    ds = run(ctrl, rows, lrs)
    assert [d.chosen for d in ds[3:]] == [(1,), (), (2,), (2,), (2,)]
    assert ctrl.latches.tolist() == [0, 0, 6]


# ------------------------------------------------------------------------------ pinned


def test_pinned_units_join_the_plan_outside_the_budget_from_their_condition():
    pinned = {"units": ["*"], "from": {"step": 3}}
    kw = {"eligible": [True, True, True, False], "pinned": [False, False, True, True]}
    ctrl = make(4, kw, pinned=pinned)
    ds = run(ctrl, [[NAN] * 4] * 4)
    assert [d.pinned for d in ds] == [(), (), (2,), (2,)]  # unit 3 is pinned but ineligible
    assert [d.candidates for d in ds] == [(0, 1, 2)] * 2 + [(0, 1)] * 2
    assert [d.chosen for d in ds] == [(0,)] * 4
    assert [d.active for d in ds] == [(0,), (0,), (0, 2), (0, 2)]
    assert ds[2].telemetry.num_pinned == 1 and ds[2].telemetry.num_active == 2
    assert ctrl.recovered.tolist() == [3, 0, 1, 0]  # R_1..R_3 counted at decisions 2..4


def test_pinned_all_needs_no_mask_and_a_pattern_needs_one():
    ctrl = make(3, {"eligible": [True, False, True]}, max_active=0, pinned={"units": "all"})
    assert [d.active for d in run(ctrl, [[1, 1, 1]] * 2)] == [(0, 2), (0, 2)]
    with pytest.raises(ValueError, match=r"pass the resolved mask.*pinned\.mask\(unit_names\)"):
        make(3, pinned={"units": {"last_layers": 1}})
    with pytest.raises(ValueError, match=r"pinned= was given but gnmr\.pinned is not set"):
        make(3, {"pinned": [True, False, False]})
    with pytest.raises(ValueError, match="pinned must be a 1-D mask of length num_units=3"):
        make(3, {"pinned": [True]}, pinned={"units": "all"})


def test_pinned_masks_from_unit_names():
    names = ["model.layers.0.q", "model.layers.1.q", "model.layers.10.q", "lm_head", "emb.2"]
    assert Pinned("all").mask(names) == [True] * 5
    assert Pinned(("*.layers.1.*",)).mask(names) == [False, True, False, False, False]
    assert Pinned(("model.layers.1",)).mask(["model.layers.1", "model.layers.1.q"]) == [
        True,
        False,
    ]
    # last_layers: the first integer in a name is its layer; the n highest (10 and 9) here
    last = GNMRConfig.from_dict({"pinned": {"units": {"last_layers": 2}}}).pinned
    assert last is not None and last.mask(names) == [False, False, True, False, False]
    assert last.mask(["lm_head"]) == [False]


# ------------------------------------------------------------------------------ accounting


def test_recovered_nonfinite_and_the_first_nonfinite_event():
    ctrl = make(3)
    rows = [[1, 1, 1], [1, 1, 1], [1, NAN, math.inf], [NAN, 1, 1], [1, 1, 1]]
    ds = run(ctrl, rows[:4])
    assert ds[2].chosen == (1,) and ds[3].chosen == (0,)  # a tie at +inf; then the riskiest
    assert ctrl.recovered.tolist() == [0, 1, 0]  # R_3 counted at decision 4, R_4 not yet
    assert ctrl.nonfinite.tolist() == [1, 1, 1] and ctrl.first_nonfinite == (3, 1)
    ctrl.step(rows[4])
    assert ctrl.recovered.tolist() == [1, 1, 0] and ctrl.first_nonfinite == (3, 1)
    assert make(2).first_nonfinite is None


# ------------------------------------------------------------------------------ inputs


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, r"gnmr\.max_share needs the units' costs: GNMRController\(\.\.\., costs=w"),
        ({"costs": [1, 2]}, "costs= and total_cost= come together"),
        ({"total_cost": 9}, "costs= and total_cost= come together"),
        ({"costs": [1.0, 2.0], "total_cost": 9}, "costs must hold integers"),
        ({"costs": [1, 2, 3], "total_cost": 9}, "costs must be a 1-D vector of num_units=2"),
        ({"costs": [1, 0], "total_cost": 9}, "costs must be integers >= 1, got 0 for unit 1"),
        ({"costs": [4, 5], "total_cost": 8}, r"total_cost \(8\) must be >= sum\(costs\) \(9\)"),
        ({"costs": [4, 5], "total_cost": 9.0}, r"total_cost must be an integer \(W\)"),
    ],
)
def test_costs_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        GNMRController(2, GNMRConfig(max_share=0.5), **kw)


def test_costs_without_max_share_only_report_the_plan_share():
    ctrl = make(2, {"costs": [3, 1], "total_cost": 12}, max_active=2)
    d = run(ctrl, [[1, 1]] * 3 + [[5, 1]])[-1]
    assert d.chosen == (0,) and d.telemetry.plan_share == 0.25
    assert "plan_share" in d.telemetry.as_dict() and "budget" not in d.telemetry.as_dict()
