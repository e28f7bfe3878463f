"""The independent brute force of policy v2 (tests/core/brute_v2.py) on docs/algorithm.md's own
examples, computed by hand: ratios, scores, windows, schedules, the lr_decay clock, the recipes,
locks, the compute-share walk, latches, pinned units and the accounting. The controller is held
to this brute force in ``test_reference_v2.py``, on random traces."""

from __future__ import annotations

import math

import numpy as np

from tests.core.brute_v2 import BruteV2, condition_holds, lr_decay, ratio, schedule_value
from tests.core.test_reference_v2 import _risk_by_errors, run_brute

INF = math.inf
NAN = math.nan


# -- the brute force on the doc's own examples ------------------------------------------------


def test_ratio_conventions() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 0.0) == 1.0
    assert ratio(2.0, 0.0) == INF
    assert ratio(0.0, 2.0) == 0.0
    assert ratio(INF, 0.0) == INF


def test_scores_by_hand() -> None:
    # unit 0: 2, 2, 6 -> GNMR 1, 1, 6 / (4 / 2) = 3; dGNMR 1, 1 / 1, 3 / mean(1, 1) = 3
    # unit 1: a zero history scores 1 while it stays at zero, +inf once it moves
    # unit 2: a NaN scores +inf and leaves the history untouched
    norms = [[2.0, 0.0, 1.0], [2.0, 0.0, NAN], [6.0, 1.0, 4.0]]
    ds = run_brute(3, {"warmup_steps": 0}, norms)
    assert [d.gnmr[0] for d in ds] == [1.0, 1.0, 3.0]
    assert [d.delta_gnmr[0] for d in ds] == [1.0, 1.0, 3.0]
    assert [d.gnmr[1] for d in ds] == [1.0, 1.0, INF]
    assert [d.delta_gnmr[1] for d in ds] == [1.0, 1.0, INF]
    assert [d.gnmr[2] for d in ds] == [1.0, INF, 4.0]
    assert [d.delta_gnmr[2] for d in ds] == [1.0, INF, 4.0]
    # risk = max(GNMR / 1.5, dGNMR / 2)
    assert ds[2].risk[0] == 2.0 and ds[2].exceed[0]
    assert ds[0].risk[0] == 1 / 1.5 and not ds[0].exceed[0]


def test_scores_are_dimensionless() -> None:
    rng = np.random.default_rng(0)
    base = (rng.lognormal(0, 1, (30, 1)) * np.ones((1, 2))).tolist()
    scaled = [[row[0], row[1] * 2.0**7] for row in base]
    for a, b in zip(run_brute(2, {}, base), run_brute(2, {}, scaled), strict=True):
        assert a.gnmr[0] == a.gnmr[1] == b.gnmr[1]
        assert a.delta_gnmr[0] == b.delta_gnmr[1]


def test_window_drops_oldest() -> None:
    # window 2: W holds the last two finite GNMR values
    norms = [[1.0], [1.0], [4.0], [1.0]]
    ds = run_brute(1, {"window": 2, "warmup_steps": 0}, norms)
    # step 3: GNMR 4, W = [1, 1]; step 4: mean = 6 / 3 = 2, GNMR 0.5, W = [1, 4]
    assert ds[2].gnmr[0] == 4.0
    assert ds[3].gnmr[0] == 0.5
    assert ds[3].delta_gnmr[0] == 0.5 / 2.5


def test_schedules_by_hand() -> None:
    demo = {"schedule": "cosine", "start": 4.0, "end": 2.0, "steps": 200}
    assert schedule_value(demo, 1, 0.0) == 4.0
    assert schedule_value(demo, 101, 0.0) == 3.0
    assert schedule_value(demo, 201, 0.0) == 2.0
    assert schedule_value(demo, 10_000, 0.0) == 2.0
    lin = {"schedule": "linear", "start": 1.0, "end": 3.0, "steps": 10, "from": 5}
    assert [schedule_value(lin, t, 0.0) for t in (1, 5, 10, 15, 16)] == [1, 1, 2, 3, 3]
    step = {"schedule": "step", "start": 4.0, "end": 2.0, "steps": 2, "from": 3}
    assert [schedule_value(step, t, 0.0) for t in (1, 3, 4, 5, 6)] == [4, 4, 4, 2, 2]
    assert schedule_value({"schedule": "constant", "start": 7, "end": 1, "steps": 1}, 9, 0) == 7
    assert schedule_value(2.5, 3, 0.5) == 2.5


def test_lr_clock_by_hand() -> None:
    lrs = [0.0, 0.5, 1.0, 1.0, 0.75, 0.5, 0.0, 0.5]
    peak, ds = 0.0, []
    for lr in lrs:
        peak = max(peak, lr)
        ds.append(lr_decay(lr, peak))
    assert ds == [0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0, 0.5]
    late = {"schedule": "step", "start": 0, "end": 8, "clock": "lr_decay", "to": 0.5}
    assert [schedule_value(late, 1, d) for d in ds] == [0, 0, 0, 0, 0, 8, 8, 8]
    mid = {"schedule": "linear", "start": 0, "end": 8, "clock": "lr_decay", "from": 0.25}
    mid["to"] = 0.75
    assert [schedule_value(mid, 1, d) for d in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0, 0, 4, 8, 8]
    assert condition_holds({"lr_decay": 0.5}, 1, 0.5)
    assert not condition_holds({"lr_decay": 0.5}, 1, 0.49)
    assert condition_holds({"step": 3}, 3, 0.0) and not condition_holds({"step": 3}, 2, 0.0)
    assert not condition_holds(None, 100, 1.0)


def test_recipe_last_layers() -> None:
    # NVIDIA's last-layers rule: "max_active": 0, pinned = the last layers' units, from step 1
    cfg = {"max_active": 0, "pinned": {"units": {"last_layers": 2}}}
    norms = [[1.0, 50.0, 1.0, 1.0] if t == 12 else [1.0] * 4 for t in range(20)]
    ds = run_brute(4, cfg, norms, pinned=[False, False, True, True])
    assert all(d.active == [2, 3] and d.chosen == [] and d.pinned == [2, 3] for d in ds)
    assert ds[12].exceed[1]


def test_recipe_late_switch() -> None:
    # NVIDIA's late switch: everything (eligible) pinned once the lr has decayed by 90%
    cfg = {"max_active": 0, "pinned": {"units": "all", "from": {"lr_decay": 0.9}}}
    lrs = [0.1 * (t + 1) for t in range(10)] + [1.0] * 5 + [1.0 - 0.1 * t for t in range(11)]
    norms = [[1.0, 2.0, 3.0]] * len(lrs)
    ds = run_brute(3, cfg, norms, lrs=lrs, eligible=[True, False, True], pinned=[True] * 3)
    first = next(i for i, d in enumerate(ds) if d.active)
    assert ds[first].decay >= 0.9 and ds[first - 1].decay < 0.9
    assert all(d.active == [0, 2] for d in ds[first:])
    assert all(d.active == [] for d in ds[:first])
    # the same at a fixed step
    cfg = {"pinned": {"units": "all", "from": {"step": 7}}, "max_active": 0}
    ds = run_brute(3, cfg, norms, pinned=[True] * 3)
    assert [bool(d.active) for d in ds] == [t + 1 >= 7 for t in range(len(norms))]


def test_recipe_late_latch() -> None:
    # GNMR with a late latch: a max_active schedule on the lr_decay clock, and "latch"
    cfg = {
        "max_active": {"schedule": "step", "start": 0, "end": 2, "clock": "lr_decay", "to": 0.5},
        "latch": {"lr_decay": 0.5},
        "warmup_steps": 2,
        "lock_steps": 1,
    }
    lrs = [1.0] * 6 + [0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    norms = [[1.0, 1.0, 1.0, 1.0] for _ in lrs]
    norms[3] = [9.0, 1.0, 1.0, 1.0]  # before the switch: nothing may be chosen
    norms[6] = [1.0, 9.0, 1.0, 9.5]  # at the switch: 3 then 1 by risk, both latched
    norms[8] = [1.0, 1.0, 99.0, 1.0]  # later spike: latched units keep their places
    ds = run_brute(4, cfg, norms, lrs=lrs)
    assert all(d.active == [] for d in ds[:6])
    assert ds[3].exceed[0]
    assert ds[6].order[:2] == [3, 1] and ds[6].active == [1, 3]
    assert ds[6].latched == [0, 7, 0, 7]
    assert all(d.active == [1, 3] for d in ds[6:])
    assert ds[8].exceed[2] and 2 in ds[8].candidates and ds[8].order[:2] == [1, 3]


def test_lock_duration() -> None:
    # a unit selected while exceeding stays max(lock_steps, 1) decisions from its exceedance
    for lock_steps in (0, 1, 3):
        norms = [[1.0, 1.0, 1.0] for _ in range(12)]
        norms[4] = [10.0, 1.0, 1.0]
        cfg = {"warmup_steps": 2, "lock_steps": lock_steps, "max_active": 1}
        ds = run_brute(3, cfg, norms)
        on = [d.step for d in ds if d.active]
        assert on == list(range(5, 5 + max(lock_steps, 1)))


def test_share_walk_skips_what_does_not_fit() -> None:
    norms, cfg = _risk_by_errors([[3.0, 5.0, 4.0]])
    # order 1 (5), 2 (4), 0 (3); W = 10, s = 0.5: 1 costs 6 > 5 skipped, 2 (3) and 0 (3+1) fit
    ds = run_brute(3, cfg | {"max_share": 0.5}, norms, [[3.0, 5.0, 4.0]], costs=[1, 6, 3])
    assert ds[0].order == [1, 2, 0] and ds[0].chosen == [0, 2]
    ds = run_brute(
        3, cfg | {"max_share": 0.5, "max_active": 1}, norms, [[3.0, 5.0, 4.0]], costs=[1, 6, 3]
    )
    assert ds[0].chosen == [2]
    ds = run_brute(3, cfg | {"max_share": 0.6}, norms, [[3.0, 5.0, 4.0]], costs=[1, 6, 3])
    assert ds[0].chosen == [1]  # 6 <= 6 exactly; then 6 + 3 and 6 + 1 do not fit
    ds = run_brute(3, cfg | {"max_share": 0.0}, norms, [[3.0, 5.0, 4.0]], costs=[1, 6, 3])
    assert ds[0].chosen == [] and ds[0].candidates == [0, 1, 2]
    # ties by id
    ds = run_brute(3, cfg | {"max_active": 2}, norms, [[4.0, 4.0, 4.0]])
    assert ds[0].chosen == [0, 1]


def test_latch_order_and_shrinking_budget() -> None:
    errors = [
        [0.0, 0.0, 0.0, 2.0],  # t=1: 3 latched at 1
        [0.0, 2.0, 0.0, 0.0],  # t=2: 1 latched at 2
        [9.0, 0.0, 0.0, 0.0],  # t=3: k=2 holds 3 and 1; 0 exceeds but does not fit
        [9.0, 0.0, 0.0, 0.0],  # t=4: k=1: 1 (latched later) leaves for good
        [0.0, 0.0, 0.0, 0.0],  # t=5
    ]
    norms, cfg = _risk_by_errors(errors)
    cfg |= {
        "latch": {"step": 1},
        "max_active": {"schedule": "step", "start": 2, "end": 1, "steps": 3},
    }
    ds = run_brute(4, cfg, norms, errors)
    assert [d.k for d in ds] == [2, 2, 2, 1, 1]
    assert [d.active for d in ds] == [[3], [1, 3], [1, 3], [3], [3]]
    assert ds[2].order == [3, 1, 0] and ds[2].exceed[0]
    assert ds[3].latched == [0, 0, 0, 1]
    assert ds[4].candidates == [3]


def test_pinned_units_are_outside_the_budget() -> None:
    errors = [[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0, 2.0]]
    norms, cfg = _risk_by_errors(errors)
    cfg |= {"lock_steps": 5, "max_active": 1, "pinned": {"units": ["x"], "from": {"step": 3}}}
    ds = run_brute(3, cfg, norms, errors, pinned=[True, False, False])
    assert ds[1].chosen == [0] and ds[1].lock == [5, 0, 0]
    # from step 3 unit 0 is pinned: not a candidate, its lock is cleared, R = A + P
    assert ds[2].pinned == [0] and ds[2].candidates == [] and ds[2].lock == [0, 0, 0]
    assert ds[3].active == [0, 1] and ds[3].chosen == [1]


def test_accounting() -> None:
    norms = [[1.0, 1.0]] * 2 + [[1.0, NAN], [INF, -INF], [1.0, 1.0]]
    brute = BruteV2(2, {"max_active": 0, "pinned": {"units": "all"}}, pinned=[True, True])
    for row in norms:
        brute.step(row)
    assert brute.recovered == [4, 4]
    assert brute.nonfinite == [1, 2]
    assert brute.first_nonfinite == (3, 1)
    assert brute.plan == [0, 1]
