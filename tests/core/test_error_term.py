"""Hand-computed traces for docs/algorithm.md#damage-term, the damage-aware error term.

``risk = max(GNMR / alpha_t, dGNMR / beta_t, e / gamma_t)``; the errors never enter the history
and every other rule of section 2 is unchanged. One behaviour per test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gnmr_dist import GNMRConfig, GNMRController
from tests.core.test_controller import make as make_controller

INF = math.inf
NAN = math.nan


def make(u, **kw):
    """test_controller's small controller, with the section 2.1 term on (gamma 0.5)."""
    return make_controller(u, **{"gamma": 0.5, **kw})


def run(ctrl, norms, errors):
    return [ctrl.step(n, errors=e) for n, e in zip(norms, errors, strict=True)]


def history(ctrl):
    s = ctrl.state_dict()
    return [s[k] for k in ("norm_sum", "norm_count", "window_buffer", "window_len")]


def test_risk_is_the_max_of_three_terms():
    ctrl = make(3)
    ds = run(ctrl, [[1, 1, 1]] * 3 + [[1, 4, 1]], [[0.1, 0.1, 0.1]] * 3 + [[0.6, 0.1, 2.0]])
    d = ds[3]
    # unit 0: flat norms, e / gamma = 1.2; unit 1: GNMR 4 -> 8/3 beats 0.2; unit 2: 4.0
    assert d.risk.tolist() == pytest.approx([1.2, 8 / 3, 4.0], rel=1e-15)
    assert d.error.tolist() == [0.6, 0.1, 2.0] and d.gamma == 0.5
    assert d.exceed.tolist() == [True, True, True]
    assert d.telemetry.num_error_exceed == 2 and d.telemetry.num_exceed == 3
    assert d.active == (2,) and d.candidates == (0, 1, 2)


def test_unit_with_lasting_error_stays_active_while_its_gnmr_is_flat():
    ctrl = make(2, lock_steps=2)
    norms = [[1.0, 2.0]] * 12
    errors = [[0.0, 0.1]] * 2 + [[0.0, 0.9]] * 6 + [[0.0, 0.1]] * 4
    ds = run(ctrl, norms, errors)
    assert all(d.gnmr.tolist() == [1.0, 1.0] for d in ds)  # the norms never move
    assert [d.active for d in ds[:2]] == [(), ()]
    # e / gamma = 1.8 > 1 at every step: exceeds, re-locked, kept in A for all six steps
    for d in ds[2:8]:
        assert d.active == (1,) and bool(d.exceed[1])
        assert d.risk[1].item() == pytest.approx(1.8)
    # the error falls: one more decision on the lock (2 -> 1), then released
    assert ds[8].active == (1,) and not bool(ds[8].exceed[1])
    assert ds[9].active == () and ds[10].active == ()


def test_lock_counts_down_only_after_the_error_falls():
    ctrl = make(1, lock_steps=3)
    run(ctrl, [[1.0]] * 4, [[0.1], [2.0], [2.0], [2.0]])
    assert ctrl.locks.tolist() == [3]
    ctrl.step([1.0], errors=[0.0])
    assert ctrl.locks.tolist() == [2]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_error_is_infinitely_risky_and_leaves_history_alone(bad):
    a, b = make(2), make(2)
    norms = [[1, 2], [1, 2], [1, 2], [1, 4]]
    da = run(a, norms, [[0, 0], [0, 0], [bad, 0], [0, 0]])
    db = run(b, norms, [[0, 0]] * 4)
    d = da[2]
    assert d.risk[0].item() == INF and d.error[0].item() == INF
    assert d.gnmr[0].item() == 1.0 and d.delta_gnmr[0].item() == 1.0  # the norm was fine
    assert d.active == (0,) and d.telemetry.max_risk == INF
    assert d.telemetry.num_error_exceed == 1 and d.telemetry.num_nonfinite == 0
    for x, y in zip(da, db, strict=True):
        assert torch.equal(x.gnmr, y.gnmr) and torch.equal(x.delta_gnmr, y.delta_gnmr)
    assert all(torch.equal(x, y) for x, y in zip(history(a), history(b), strict=True))


def test_errors_do_not_change_the_norm_history():
    g = torch.Generator().manual_seed(1)
    norms = torch.rand(30, 4, generator=g, dtype=torch.float64) * 3
    norms[7, 2] = NAN
    errors = torch.rand(30, 4, generator=g, dtype=torch.float64) * 2
    plain = GNMRController(4, GNMRConfig(max_active=2, warmup_steps=0))
    scored = GNMRController(4, GNMRConfig(max_active=2, warmup_steps=0, gamma=0.7))
    for t in range(30):
        a, b = plain.step(norms[t]), scored.step(norms[t], errors=errors[t])
        assert torch.equal(a.gnmr, b.gnmr) and torch.equal(a.delta_gnmr, b.delta_gnmr)
        assert bool((b.risk >= a.risk).all())  # a third term can only raise the risk
    # S, c and W bit-identical; only the locks (decisions) differ
    assert all(torch.equal(x, y) for x, y in zip(history(plain), history(scored), strict=True))


def test_scaling_one_units_norms_changes_nothing_with_the_error_term():
    g = torch.Generator().manual_seed(2)
    norms = torch.rand(25, 3, generator=g, dtype=torch.float64) + 0.1
    errors = torch.rand(25, 3, generator=g, dtype=torch.float64)
    scaled = norms.clone()
    scaled[:, 1] *= 2.0**-17  # exact in binary: bit-identical scores
    loose = norms.clone()
    loose[:, 1] *= 37.3
    runs = []
    for series in (norms, scaled, loose):
        ctrl = make(3, max_active=2, gamma=0.8)
        runs.append([ctrl.step(series[t], errors=errors[t]) for t in range(25)])
    for a, b, c in zip(*runs, strict=True):
        assert (a.active, a.candidates) == (b.active, b.candidates) == (c.active, c.candidates)
        assert torch.equal(a.risk, b.risk)
        assert torch.allclose(a.risk, c.risk, rtol=1e-12, atol=0)


def test_error_term_alone_selects_a_unit_at_full_budget():
    ctrl = make(4, max_active=2, gamma=0.25)
    norms = [[1, 1, 1, 1]] * 3 + [[3, 5, 1, 1]]
    errors = [[0, 0, 0, 0]] * 3 + [[0, 0, 0, 1.5]]
    d = run(ctrl, norms, errors)[3]
    # risks: unit 0 max(2, 1.5) = 2; unit 1 max(10/3, 2.5) = 10/3; unit 3 e / gamma = 6
    assert d.candidates == (0, 1, 3)
    assert d.active == (1, 3)  # the error-only unit outranks the GNMR spike of unit 0
    assert d.gnmr[3].item() == 1.0 and d.risk[3].item() == 6.0
    assert ctrl.locks.tolist() == [0, 2, 0, 2]


def test_warmup_and_eligibility_still_apply():
    ctrl = GNMRController(
        2, GNMRConfig(gamma=1.0, warmup_steps=2, max_active=2), eligible=[True, False]
    )
    ds = run(ctrl, [[1, 1]] * 4, [[5, 5]] * 4)
    assert all(d.candidates == () for d in ds[:2])
    assert ds[2].candidates == (0,) and ds[3].active == (0,)
    assert ds[3].telemetry.num_exceed == 2 and ds[3].telemetry.num_exceed_eligible == 1


def test_gamma_schedule_is_evaluated_at_each_step():
    gamma = {"schedule": "linear", "start": 4.0, "end": 1.0, "steps": 3}
    ctrl = make(1, gamma=gamma)
    ds = run(ctrl, [[1.0]] * 5, [[2.0]] * 5)
    assert [d.gamma for d in ds] == [4.0, 3.0, 2.0, 1.0, 1.0]
    assert [bool(d.exceed[0]) for d in ds] == [False, False, False, True, True]
    assert [d.risk[0].item() for d in ds[3:]] == [2.0, 2.0]


def test_zero_errors_reproduce_section_2_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    norms = torch.rand(20, 3, generator=g, dtype=torch.float64) * 4
    plain, scored = make(3, gamma=None), make(3, gamma=0.1)
    for t in range(20):
        a, b = plain.step(norms[t]), scored.step(norms[t], errors=torch.zeros(3))
        assert (a.active, a.candidates) == (b.active, b.candidates)
        assert torch.equal(a.risk, b.risk) and a.error is None and a.gamma is None
        assert a.telemetry.num_error_exceed == 0 and b.telemetry.num_error_exceed == 0
    assert torch.equal(plain.locks, scored.locks)


def test_errors_accept_tensors_arrays_and_any_float_dtype():
    a, b, c = make(2), make(2), make(2)
    for e in ([0.25, 0.75], [1.0, 0.0]):
        da = a.step([1, 1], errors=e)
        db = b.step([1, 1], errors=np.asarray(e, dtype=np.float32))
        dc = c.step([1, 1], errors=torch.tensor(e, dtype=torch.bfloat16, requires_grad=True))
        assert torch.equal(da.risk, db.risk) and torch.equal(da.risk, dc.risk)
        assert da.error.dtype == torch.float64 and not dc.error.requires_grad


def test_errors_without_gamma_name_the_fix():
    ctrl = make(2, gamma=None)
    with pytest.raises(ValueError, match=r"gnmr\.gamma is not set: set gnmr\.gamma"):
        ctrl.step([1, 1], errors=[0.1, 0.1])
    assert ctrl.step_count == 0


def test_gamma_without_errors_is_refused_and_changes_nothing():
    ctrl = make(2)
    ctrl.step([1, 1], errors=[0, 0])
    before = ctrl.state_dict()
    with pytest.raises(ValueError, match=r"gnmr\.gamma is set, so step\(\) needs errors="):
        ctrl.step([1, 1])
    after = ctrl.state_dict()
    assert after["step"] == 1
    assert all(torch.equal(before[k], after[k]) for k in before if torch.is_tensor(before[k]))


@pytest.mark.parametrize(
    "errors, match",
    [
        ([0.1, 0.2], r"errors must be a 1-D vector of num_units=3 per-unit error scores"),
        ([[0.1, 0.2, 0.3]], r"errors must be a 1-D vector .* got shape \[1, 3\]"),
        ([0.1, -0.2, 0.3], r"errors must be >= 0 .*got -0\.2 for unit 1"),
        (torch.tensor([0.1, 0.2, 0.3j]), r"errors must hold real numbers, got dtype"),
        (np.asarray([0.1, 0.2, 0.3j]), r"errors must hold real numbers, got dtype"),
        ([0.1, 0.2, 0.3j], r"errors must be a 1-D vector of real numbers"),
        (torch.tensor([True, False, True]), r"errors must hold real numbers, got dtype"),
        (["a", "b", "c"], r"errors must be a 1-D vector of real numbers"),
        ([0.1, None, 0.3], r"errors must be a 1-D vector of real numbers"),
    ],
)
def test_bad_errors_vector_is_named(errors, match):
    ctrl = make(3)
    with pytest.raises(ValueError, match=match):
        ctrl.step([1.0, 1.0, 1.0], errors=errors)
    assert ctrl.step_count == 0


@pytest.mark.parametrize(
    "norms, match",
    [
        ([1.0, "x", 2.0], r"norms must be a 1-D vector of real numbers"),
        ([1.0, True, 2.0], r"norms must hold real numbers, got booleans"),
        (np.asarray([1.0, 2.0, 3j]), r"norms must hold real numbers, got dtype torch.complex"),
        (torch.zeros(3, 1), r"norms must be a 1-D vector of num_units=3 per-unit norms"),
        ("abc", r"norms must be a 1-D vector of real numbers"),
        ({0: 1.0}, r"norms must be a 1-D vector of real numbers"),
    ],
)
def test_bad_norms_vector_is_named(norms, match):
    ctrl = make(3, gamma=None)
    with pytest.raises(ValueError, match=match):
        ctrl.step(norms)
    assert ctrl.step_count == 0


def test_norms_are_refused_the_same_way():
    with pytest.raises(ValueError, match=r"norms must hold real numbers"):
        make(2, gamma=None).step(torch.tensor([1.0, 1j]))
    with pytest.raises(ValueError, match=r"norms must be >= 0 \(they are L2 norms\); got -1\.0"):
        make(2, gamma=None).step([1.0, -1.0])


def test_errors_keyword_only():
    ctrl = make(1)
    with pytest.raises(TypeError, match=r"step\(\) takes 2 positional arguments but 3 were given"):
        ctrl.step([1.0], [0.0])
    assert ctrl.step_count == 0


def test_telemetry_dict_carries_the_error_count():
    ctrl = make(2, max_active=2)
    d = run(ctrl, [[1, 1]] * 2, [[0, 0], [0.6, INF]])[-1]
    t = d.telemetry.as_dict()
    assert t["num_error_exceed"] == 2.0 and t["num_exceed"] == 2.0 and t["max_risk"] == INF
