"""Hand-computed traces for the controller (docs/algorithm.md), one behaviour per test."""

from __future__ import annotations

import math

import pytest
import torch

from gnmr_dist import GNMRConfig, GNMRController, Schedule

INF = math.inf
NAN = math.nan


def make(u, ctrl_kw=None, **kw):
    """A controller over ``u`` units with the tests' small policy, ``kw`` overriding it and
    ``ctrl_kw`` passed to the controller (costs, pinned, eligible)."""
    base = {
        "max_active": 1,
        "lock_steps": 2,
        "window": 4,
        "alpha": 1.5,
        "beta": 2.0,
        "warmup_steps": 0,
    }
    base.update(kw)
    return GNMRController(u, GNMRConfig.from_dict(base), **(ctrl_kw or {}))


def run(ctrl, rows):
    return [ctrl.step(r) for r in rows]


def test_first_step_scores_one_and_plateau_never_exceeds():
    ctrl = make(3)
    for d in run(ctrl, [[2.0, 0.5, 7.0]] * 20):
        assert d.gnmr.tolist() == [1.0, 1.0, 1.0]
        assert d.delta_gnmr.tolist() == [1.0, 1.0, 1.0]
        assert d.risk.tolist() == pytest.approx([1 / 1.5] * 3, rel=0, abs=0)
        assert d.active == () and d.candidates == ()


def test_spike_selected_then_held_by_lock_then_released():
    ctrl = make(2, lock_steps=2)
    ds = run(ctrl, [[1, 1]] * 3 + [[1, 4], [1, 1], [1, 1], [1, 1]])
    spike = ds[3]
    # S=3, c=3 -> mean 1 -> GNMR 4; W=[1,1,1] -> dGNMR 4; risk max(4/1.5, 4/2) = 8/3
    assert spike.gnmr[1].item() == 4.0 and spike.delta_gnmr[1].item() == 4.0
    assert spike.risk[1].item() == pytest.approx(8 / 3)
    assert spike.active == (1,) and spike.candidates == (1,)
    after = ds[4]
    # S=7, c=4 -> GNMR = 1 / 1.75; W=[1,1,1,4] -> mean 1.75 -> dGNMR = GNMR / 1.75
    assert after.gnmr[1].item() == pytest.approx(1 / 1.75)
    assert after.delta_gnmr[1].item() == pytest.approx(1 / 1.75 / 1.75)
    assert after.active == (1,)  # lock 2 -> 1: still held
    assert ds[5].active == () and ds[6].active == ()  # lock 1 -> 0: released


def test_lock_steps_zero_and_one_hold_for_exactly_one_decision():
    for lock in (0, 1):
        ctrl = make(1, lock_steps=lock)
        ds = run(ctrl, [[1]] * 3 + [[10], [1], [1]])
        assert [d.active for d in ds[3:]] == [(0,), (), ()]


def test_step_change_decays_towards_new_plateau():
    ctrl = make(1, window=2, max_active=0)
    ds = run(ctrl, [[1]] * 4 + [[3]] * 3)
    # step 5: mean 1 -> 3; step 6: mean (4+3)/5 = 1.4 -> 3/1.4; step 7: mean 10/6 -> 1.8
    assert [d.gnmr.item() for d in ds[4:]] == pytest.approx([3.0, 3 / 1.4, 1.8])
    # dGNMR at step 7: W = [3, 3/1.4] -> mean; GNMR 1.8 divided by it
    assert ds[6].delta_gnmr.item() == pytest.approx(1.8 / ((3 + 3 / 1.4) / 2))


def test_zero_history_scores_one_then_inf_when_it_moves():
    ctrl = make(1)
    ds = run(ctrl, [[0.0], [0.0], [0.0], [0.5], [0.5]])
    assert [d.gnmr.item() for d in ds[:3]] == [1.0, 1.0, 1.0]
    assert [d.delta_gnmr.item() for d in ds[:3]] == [1.0, 1.0, 1.0]
    assert ds[3].gnmr.item() == INF and ds[3].active == (0,)
    # the inf GNMR is not added to W, the norm is: S=0.5, c=4 -> mean 0.125 -> GNMR 4
    assert ds[4].gnmr.item() == 4.0
    assert ds[4].delta_gnmr.item() == 4.0  # W = [1, 1, 1]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_norm_is_infinitely_risky_and_leaves_history_alone(bad):
    ctrl = make(2)
    ds = run(ctrl, [[1, 2], [1, 2], [bad, 2], [1, 4]])
    d = ds[2]
    assert d.gnmr[0].item() == INF and d.delta_gnmr[0].item() == INF and d.risk[0].item() == INF
    assert d.active == (0,) and d.telemetry.num_nonfinite == 1 and d.telemetry.max_risk == INF
    # unit 0 history is still S=2, c=2; the bad step left no trace in it
    assert ds[3].gnmr[0].item() == 1.0 and ds[3].delta_gnmr[0].item() == 1.0
    assert ds[3].gnmr[1].item() == 2.0


def test_locked_unit_is_displaced_by_a_riskier_one():
    ctrl = make(3, max_active=1, lock_steps=5)
    ds = run(ctrl, [[1, 1, 1]] * 4 + [[3, 1, 1], [1, 9, 1], [1, 1, 1], [1, 1, 1]])
    assert ds[4].active == (0,)
    displaced = ds[5]
    assert displaced.candidates == (0, 1) and displaced.active == (1,)
    assert ctrl.locks.tolist() == [0, 3, 0]  # unit 1 locked at step 6 for 5 steps, 2 spent
    assert ds[6].active == (1,) and 0 not in ds[6].candidates  # unit 0 lost its lock
    assert ds[7].active == (1,)


def test_lock_counters_after_displacement():
    ctrl = make(3, max_active=1, lock_steps=5)
    run(ctrl, [[1, 1, 1]] * 4 + [[3, 1, 1]])
    assert ctrl.locks.tolist() == [5, 0, 0]
    ctrl.step([1, 9, 1])
    assert ctrl.locks.tolist() == [0, 5, 0]
    ctrl.step([1, 1, 1])
    assert ctrl.locks.tolist() == [0, 4, 0]


def test_ties_broken_by_lower_id():
    ctrl = make(4, max_active=2)
    ds = run(ctrl, [[1, 1, 1, 1]] * 3 + [[1, 5, 5, 5]])
    assert ds[3].candidates == (1, 2, 3) and ds[3].active == (1, 2)


def test_riskiest_first_under_budget():
    ctrl = make(4, max_active=2)
    ds = run(ctrl, [[1, 1, 1, 1]] * 3 + [[6, 3, 9, 4]])
    assert ds[3].candidates == (0, 1, 2, 3) and ds[3].active == (0, 2)
    assert ds[3].telemetry.num_exceed == 4 and ds[3].telemetry.num_active == 2


def test_warmup_scores_but_selects_nothing():
    ctrl = make(2, warmup_steps=4)
    ds = run(ctrl, [[1, 1], [1, 1], [1, 8], [1, 1], [1, 1], [1, 1], [1, 8]])
    assert ds[2].telemetry.num_exceed == 1
    assert all(d.candidates == () and d.active == () for d in ds[:4])
    assert ds[6].active == (1,)
    # the warm-up spike entered the history: S = 1+1+8+1+1+1 = 13 over 6 steps
    assert ds[6].gnmr[1].item() == pytest.approx(8 / (13 / 6))


def test_ineligible_unit_is_scored_but_never_selected():
    ctrl = GNMRController(3, GNMRConfig(max_active=2, warmup_steps=0), eligible=[True, False, True])
    ds = run(ctrl, [[1, 1, 1]] * 3 + [[1, 9, 3]])
    assert ds[3].exceed.tolist() == [False, True, True]
    assert ds[3].active == (2,) and ds[3].candidates == (2,)
    assert ds[3].telemetry.num_exceed == 2 and ds[3].telemetry.num_exceed_eligible == 1


def test_zero_budget_observes_only():
    ctrl = make(2, max_active=0)
    ds = run(ctrl, [[1, 1]] * 3 + [[1, 50]])
    assert ds[3].candidates == (1,) and ds[3].active == ()
    assert ctrl.locks.tolist() == [0, 0]


def test_schedule_values():
    lin = Schedule("linear", 4.0, 2.0, 4)
    cos = Schedule("cosine", 4.0, 2.0, 4)
    const = Schedule("constant", 4.0, 2.0, 4)
    assert [lin.at(t) for t in (1, 2, 3, 5, 100)] == [4.0, 3.5, 3.0, 2.0, 2.0]
    assert [cos.at(t) for t in (1, 3, 5, 9)] == pytest.approx([4.0, 3.0, 2.0, 2.0])
    assert cos.at(2) == pytest.approx(2 + 2 * (1 + math.cos(math.pi / 4)) / 2)
    assert [const.at(t) for t in (1, 50)] == [4.0, 4.0]


def test_tightening_schedule_turns_a_steady_ratio_into_an_exceedance():
    # GNMR of a unit whose norm doubles and stays: 2, then 2/(1.2), ... ; alpha falls 4 -> 1.5.
    alpha = {"schedule": "linear", "start": 4.0, "end": 1.5, "steps": 5}
    ctrl = make(1, alpha=alpha, beta=100.0)
    ds = run(ctrl, [[1.0]] * 4 + [[2.0]] * 3)
    assert [d.alpha for d in ds] == pytest.approx([4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.5])
    assert ds[4].gnmr.item() == 2.0 and not bool(ds[4].exceed)  # 2 / 2.0 = 1, not > 1
    assert ds[5].gnmr.item() == pytest.approx(2 / 1.2) and bool(ds[5].exceed)


def test_accepts_numpy_and_tensor_on_any_dtype():
    import numpy as np

    a, b = make(2), make(2)
    for row in ([1, 2], [3, 1], [1, 1]):
        da = a.step(np.asarray(row, dtype=np.float32))
        db = b.step(torch.tensor(row, dtype=torch.bfloat16))
        assert da.active == db.active and torch.equal(da.risk, db.risk)
        assert da.risk.dtype == torch.float64


@pytest.mark.parametrize(
    "norms, match",
    [
        ([1.0, 2.0], "1-D vector of num_units=3"),
        ([[1.0, 2.0, 3.0]], "got shape \\[1, 3\\]"),
        ([1.0, -2.0, 3.0], "must be >= 0"),
    ],
)
def test_bad_norms_vector_is_named(norms, match):
    with pytest.raises(ValueError, match=match):
        make(3).step(norms)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_units must be an integer >= 1"):
        GNMRController(0)
    with pytest.raises(ValueError, match="eligible must be a 1-D mask of length num_units=3"):
        GNMRController(3, eligible=[True, False])
    with pytest.raises(ValueError, match="eligible must hold booleans"):
        GNMRController(2, eligible=[0.5, 1.0])


def test_active_mask_and_telemetry_dict():
    ctrl = make(3, max_active=2)
    d = run(ctrl, [[1, 1, 1]] * 3 + [[1, 9, 9]])[-1]
    assert d.active_mask.tolist() == [False, True, True]
    t = d.telemetry.as_dict()
    assert t["num_active"] == 2.0 and t["num_locked"] == 2.0 and t["num_candidates"] == 2.0


def test_decision_matches_the_numpy_twin_and_its_lazy_fields_agree():
    """The controller decides as benchmarks.overhead.controller's numpy twin on a trace with
    spikes and NaNs; a decision is read-only, its tensors are made on demand and kept as they
    are by later steps, its telemetry counts them."""
    from benchmarks.overhead.controller import NumpyTwin, trace

    cfg = GNMRConfig(max_active=2, warmup_steps=3)
    ctrl, twin = GNMRController(64, cfg), NumpyTwin(64, cfg)
    for row in trace(64, 300, seed=3):
        d = ctrl.step(row)
        assert d.active == twin.step(row.numpy())
    t = d.telemetry
    assert t.num_exceed == int(d.exceed.sum()) and t.num_candidates == len(d.candidates)
    assert t.num_active == len(d.active) and t.max_risk == float(d.risk.max())
    assert d.risk is d.risk and d.risk.dtype == torch.float64  # one tensor, made once
    assert set(d.active) <= set(d.candidates) and d.active_mask.sum() == len(d.active)
    with pytest.raises(AttributeError, match="property 'step' of 'Decision' object has no setter"):
        d.step = 5  # read-only
    # a decision keeps its values: the controller's later steps write new arrays, not these
    kept = {k: getattr(d, k).clone() for k in ("risk", "gnmr", "delta_gnmr", "exceed")}
    for row in trace(64, 20, seed=4):
        ctrl.step(row)
    assert all(torch.equal(getattr(d, k), v) for k, v in kept.items())
