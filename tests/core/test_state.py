"""Checkpoint state: weights_only loads, exact resume, and loud failures on bad state."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.state import StateIntegrityError, seal, unseal


def trained(u=3, steps=12, **cfg):
    ctrl = GNMRController(u, GNMRConfig(warmup_steps=0, **cfg))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ctrl.step(torch.rand(u, generator=g, dtype=torch.float64) * 3)
    return ctrl


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_is_plain_and_loads_weights_only():
    state = roundtrip(trained().state_dict())
    assert state["step"] == 12 and state["num_units"] == 3
    assert all(isinstance(v, (torch.Tensor, int, dict)) for v in state.values())


def test_state_dict_is_a_copy():
    ctrl = trained()
    state = ctrl.state_dict()
    before = state["norm_sum"].clone()
    ctrl.step([1.0, 1.0, 1.0])
    assert torch.equal(state["norm_sum"], before)


def mutated(key, value, **cfg):
    """A hand edit that re-seals: the checksum matches, the shape and invariant checks must
    catch it."""
    state = trained(**cfg).state_dict()
    state[key] = value
    return seal(state)


@pytest.mark.parametrize(
    "state, match",
    [
        ({"step": 1}, "missing"),
        (mutated("version", 99), "format version 99"),
        (mutated("num_units", 4), "num_units=4, this controller has 3"),
        (
            mutated("norm_sum", torch.zeros(4, dtype=torch.float64)),
            r"'norm_sum' is torch.float64 \[4\]",
        ),
        (
            mutated("norm_count", torch.zeros(3)),
            r"'norm_count' is torch.float32 \[3\], expected torch.int64",
        ),
        (mutated("lock", [0, 0, 0]), "'lock' is list, not a tensor"),
        (mutated("lock", torch.tensor([0, -1, 0])), r"lock\[1\] = -1 \(locks lie in"),
        (mutated("lock", torch.tensor([9, 0, 0])), r"lock\[0\] = 9 .*lock_steps=8"),
        (
            mutated("window_len", torch.tensor([8, 99, 8])),
            r"window_len\[1\] = 99 is outside \[0, min\(window=8, step=12\)\]",
        ),
        (
            mutated("norm_count", torch.tensor([12, 13, 12])),
            r"norm_count\[1\] = 13 is outside \[0, step=12\]",
        ),
        (
            mutated("norm_sum", torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64)),
            r"norm_sum\[1\] = nan",
        ),
        (
            mutated("norm_sum", torch.tensor([1.0, -2.0, 1.0], dtype=torch.float64)),
            r"norm_sum\[1\] = -2.0",
        ),
        (
            mutated("window_len", torch.tensor([8, 5, 8])),
            r"window_buffer\[1, 0\] = .* with window_len 5 .*right-aligned after zeros",
        ),
        (mutated("step", -5), "step = -5 is not an integer >= 0"),
        ([1, 2, 3], "must be a dict"),
    ],
)
def test_bad_state_is_refused_with_a_reason(state, match):
    fresh = GNMRController(3, GNMRConfig(warmup_steps=0))
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    assert all(
        torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor)
    )


def test_locks_beyond_the_budget_or_on_ineligible_units_are_refused():
    state = trained(max_active=1).state_dict()
    state["lock"] = torch.tensor([2, 3, 0])
    with pytest.raises(ValueError, match="lock is held by 2 units, more than max_active=1"):
        GNMRController(3, GNMRConfig(warmup_steps=0, max_active=1)).load_state_dict(seal(state))
    state = trained().state_dict()
    state["eligible"] = torch.tensor([True, False, True])
    state["lock"] = torch.tensor([0, 3, 0])
    with pytest.raises(ValueError, match=r"lock\[1\] = 3 .*unit 1 eligible: False"):
        GNMRController(3, GNMRConfig(warmup_steps=0)).load_state_dict(seal(state))


@pytest.mark.parametrize("key", ["step", "norm_sum", "window_buffer", "lock", "config"])
def test_an_edit_without_resealing_names_the_altered_field(key):
    state = trained().state_dict()
    if key == "step":
        state["step"] += 1  # still a reachable state: only the checksum tells
    elif key == "config":
        state["config"] = {**state["config"], "alpha": 9.0}
    else:
        state[key] = state[key].clone()
        state[key].view(-1)[0] += 1
    field = "config.alpha" if key == "config" else key
    with pytest.raises(StateIntegrityError, match=rf"{field} was altered"):
        GNMRController(3, GNMRConfig(warmup_steps=0)).load_state_dict(state)


def test_a_dropped_or_added_field_is_named():
    state = trained().state_dict()
    del state["lock"]
    state["extra"] = 1
    with pytest.raises(StateIntegrityError, match="lock is missing; extra was added"):
        unseal(state, "state")


def test_a_state_without_checksum_loads_with_a_warning(caplog):
    state, _ = unseal(trained().state_dict(), "state")
    ctrl = GNMRController(3, GNMRConfig(warmup_steps=0))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.core.integrity"):
        ctrl.load_state_dict(state)
    assert "has no checksum" in caplog.text and ctrl.step_count == 12


def test_the_checksum_does_not_depend_on_strides_or_pickling():
    state = trained().state_dict()
    state["window_buffer"] = state["window_buffer"].t().contiguous().t()  # same values
    assert not state["window_buffer"].is_contiguous()
    ctrl = GNMRController(3, GNMRConfig(warmup_steps=0))
    ctrl.load_state_dict(roundtrip(state))  # the checksum verifies: no refusal
    assert ctrl.step_count == 12
    assert torch.equal(ctrl.state_dict()["window_buffer"], state["window_buffer"])


def test_window_change_is_refused():
    state = trained().state_dict()
    with pytest.raises(ValueError, match="saved with window=8, the config has window=4"):
        GNMRController(3, GNMRConfig(window=4)).load_state_dict(state)


def test_policy_change_is_logged_and_current_policy_wins(caplog):
    state = trained(max_active=4).state_dict()
    ctrl = GNMRController(3, GNMRConfig(max_active=1, warmup_steps=0))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.core.controller"):
        ctrl.load_state_dict(state)
    assert "saved with policy" in caplog.text
    assert ctrl.step_count == 12
    for _ in range(5):
        assert len(ctrl.step([50.0, 50.0, 50.0]).active) <= 1


def test_reset_forgets_everything():
    ctrl = trained()
    ctrl.reset()
    fresh = GNMRController(3, GNMRConfig(warmup_steps=0))
    a, b = ctrl.state_dict(), fresh.state_dict()
    assert a["step"] == 0
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


# ---------------------------------------------------------------- section 2.1 and the format

# The state a controller saved before gamma existed (format version 1): the same keys and
# tensors, and a config dict without "gamma".
V1_KEYS = {
    "version",
    "num_units",
    "step",
    "config",
    "eligible",
    "norm_sum",
    "norm_count",
    "window_buffer",
    "window_len",
    "lock",
}


def test_format_2_adds_its_keys_and_the_error_term_none():
    from gnmr_dist.core.controller import STATE_VERSION

    assert STATE_VERSION == 2
    v2 = {"latched", "lr_peak", "recovered", "nonfinite", "first_nonfinite", "plan"}
    for cfg in (GNMRConfig(warmup_steps=0), GNMRConfig(warmup_steps=0, gamma=0.5)):
        state = GNMRController(3, cfg).state_dict()
        # the checksum is one more key: releases that predate it read the state as before
        assert set(state) == V1_KEYS | v2 | {"checksum"} and state["version"] == 2
    assert "gamma" not in GNMRController(3).state_dict()["config"]


def test_state_saved_before_gamma_loads_without_a_policy_warning(caplog):
    old = roundtrip(trained().state_dict())
    assert old["config"] == {
        "max_active": 4,
        "lock_steps": 8,
        "window": 8,
        "alpha": 1.5,
        "beta": 2.0,
        "warmup_steps": 0,
    }
    ctrl = GNMRController(3, GNMRConfig(warmup_steps=0))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.core.controller"):
        ctrl.load_state_dict(old)
    assert caplog.text == "" and ctrl.step_count == 12


def test_turning_the_error_term_on_at_resume_keeps_the_history(caplog):
    state = roundtrip(trained().state_dict())
    plain = GNMRController(3, GNMRConfig(warmup_steps=0))
    plain.load_state_dict(state)
    scored = GNMRController(3, GNMRConfig(warmup_steps=0, gamma=0.5))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.core.controller"):
        scored.load_state_dict(state)
    assert "saved with policy" in caplog.text
    a = plain.step([1.0, 2.0, 3.0])
    b = scored.step([1.0, 2.0, 3.0], errors=[0.0, 0.0, 1.0])
    assert torch.equal(a.gnmr, b.gnmr) and torch.equal(a.delta_gnmr, b.delta_gnmr)
    assert b.risk[2].item() >= 2.0 and 2 in b.active


def test_state_saved_with_gamma_resumes_exactly():
    ctrl = GNMRController(3, GNMRConfig(warmup_steps=0, max_active=1, gamma=0.4))
    g = torch.Generator().manual_seed(5)
    rows = torch.rand(20, 3, generator=g, dtype=torch.float64)
    errs = torch.rand(20, 3, generator=g, dtype=torch.float64)
    for t in range(10):
        ctrl.step(rows[t], errors=errs[t])
    resumed = GNMRController(3, GNMRConfig(warmup_steps=0, max_active=1, gamma=0.4))
    resumed.load_state_dict(roundtrip(ctrl.state_dict()))
    for t in range(10, 20):
        a, b = ctrl.step(rows[t], errors=errs[t]), resumed.step(rows[t], errors=errs[t])
        assert (a.active, a.candidates) == (b.active, b.candidates)
        assert torch.equal(a.risk, b.risk) and torch.equal(a.error, b.error)


# ---------------------------------------------------------------- format 2 (policy v2)

V2_CFG = {
    "warmup_steps": 0,
    "max_active": {"schedule": "linear", "start": 1, "end": 3, "clock": "lr_decay"},
    "lock_steps": 2,
    "latch": {"lr_decay": 0.1},
    "max_share": 0.8,
    "pinned": {"units": "all", "from": {"step": 30}},
}
V2_KW = {"costs": [3, 2, 2, 1], "total_cost": 24}


def v2_trace(steps=40, u=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(steps, u, generator=g, dtype=torch.float64) * 3
    rows[6, 2] = float("nan")
    rows[9, 0] = float("inf")
    lrs = [min(1.0, (t + 1) / 3) * (1 - t / steps) for t in range(steps)]  # d = 0.1 at t ~ 6
    return rows, lrs


def v2_controller(cfg=None, **kw):
    return GNMRController(4, GNMRConfig.from_dict(cfg or V2_CFG), **{**V2_KW, **kw})


def test_format_2_round_trip_and_resume_equal_the_uninterrupted_run():
    rows, lrs = v2_trace()
    whole = v2_controller()
    full = [whole.step(r, lr=lr) for r, lr in zip(rows, lrs, strict=True)]
    assert any(d.pinned for d in full) and any(d.telemetry.num_latched for d in full[:12])
    for cut in (5, 17, 33):
        first = v2_controller()
        for t in range(cut):
            first.step(rows[t], lr=lrs[t])
        state = roundtrip(first.state_dict())
        assert state["version"] == 2 and float(state["lr_peak"]) == max(lrs[:cut])
        resumed = v2_controller()
        resumed.load_state_dict(state)
        again = resumed.state_dict()
        assert all(
            torch.equal(state[k], again[k]) for k in state if isinstance(state[k], torch.Tensor)
        )
        for t in range(cut, len(rows)):
            got, want = resumed.step(rows[t], lr=lrs[t]), full[t]
            assert (got.active, got.chosen, got.pinned) == (want.active, want.chosen, want.pinned)
            assert got.telemetry == want.telemetry
        for name in ("recovered", "nonfinite", "latches", "locks"):
            assert torch.equal(getattr(resumed, name), getattr(whole, name)), name
        assert resumed.first_nonfinite == whole.first_nonfinite == (7, 2)


def as_version_1(state):
    """What a format-1 controller saved: the same history and locks, none of format 2's keys."""
    body, _ = unseal(state, "state")
    for key in ("latched", "lr_peak", "recovered", "nonfinite", "first_nonfinite", "plan"):
        del body[key]
    return seal({**body, "version": 1})


def test_a_format_1_state_loads_with_no_latches_no_peak_zero_counts_and_no_plan():
    ctrl = trained(max_active=2, lock_steps=3)
    old = roundtrip(as_version_1(ctrl.state_dict()))
    assert set(old) == V1_KEYS | {"checksum"} and int((old["lock"] > 0).sum()) > 0
    resumed = GNMRController(3, GNMRConfig(warmup_steps=0, max_active=2, lock_steps=3))
    resumed.load_state_dict(old)
    state = resumed.state_dict()
    assert state["version"] == 2 and float(state["lr_peak"]) == 0.0
    assert not state["latched"].any() and not state["plan"].any()
    assert not state["recovered"].any() and state["first_nonfinite"].tolist() == [0, -1]
    assert torch.equal(state["lock"], old["lock"]) and state["step"] == 12
    # the decisions go on as the uninterrupted run's (the plan only feeds the accounting)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        row = torch.rand(3, generator=g, dtype=torch.float64) * 3
        assert resumed.step(row).active == ctrl.step(row).active
    unsealed, _ = unseal(as_version_1(trained().state_dict()), "state")
    GNMRController(3, GNMRConfig(warmup_steps=0)).load_state_dict(unsealed)  # with a warning


def v2_state(**cfg):
    rows, lrs = v2_trace()
    ctrl = v2_controller({**V2_CFG, **cfg})
    for t in range(12):
        ctrl.step(rows[t], lr=lrs[t])
    return ctrl, unseal(ctrl.state_dict(), "state")[0]


def edited(state, **changes):
    out = dict(state)
    for key, value in changes.items():
        if isinstance(value, tuple):  # (index, value) into a copy of the tensor
            tensor = out[key].clone()
            tensor[value[0]] = value[1]
            value = tensor
        out[key] = value
    return seal(out)


def test_format_2_entries_no_run_can_reach_are_refused():
    _, s = v2_state()
    held = int(s["latched"].nonzero()[0])
    free = next(u for u in range(4) if not s["plan"][u] and not s["lock"][u])
    step = s["step"]
    cases = [
        (edited(s, latched=(free, step + 1), plan=(free, True)), rf"latched\[{free}\] = 13 \("),
        (
            edited(s, latched=(free, 3), plan=(free, True), eligible=(free, False)),
            rf"latched\[{free}\] = 3 .*eligible: False",
        ),
        (edited(s, plan=(held, False)), rf"plan\[{held}\] is False for a lock or latch holder"),
        (
            edited(s, plan=(free, True), eligible=(free, False)),
            rf"plan\[{free}\] is True for an ineligible unit",
        ),
        (edited(s, recovered=(0, step)), r"recovered\[0\] = 12 is outside \[0, step - 1\]"),
        (edited(s, nonfinite=(0, step)), r"nonfinite\[0\] = 12 with norm_count"),
        (
            edited(s, first_nonfinite=torch.tensor([0, -1])),
            r"first_nonfinite = \[0, -1\] \(it is \[0, -1\] while no norm was non-finite",
        ),
        (edited(s, first_nonfinite=torch.tensor([step + 1, 2])), r"first_nonfinite = \[13, 2\]"),
        (edited(s, first_nonfinite=torch.tensor([7, 1])), r"first_nonfinite = \[7, 1\]"),
        (edited(s, lr_peak=torch.tensor(-1.0, dtype=torch.float64)), r"lr_peak = -1\.0 is not"),
        (edited(s, lr_peak=torch.tensor(float("nan"), dtype=torch.float64)), r"lr_peak = nan"),
        (edited(s, lr_peak=torch.tensor(1.0)), r"'lr_peak' is torch\.float32 \[\], expected"),
        (edited(s, plan=torch.zeros(3, dtype=torch.bool)), r"'plan' is torch\.bool \[3\]"),
        (seal({k: v for k, v in s.items() if k != "plan"}), r"format 2 without \['plan'\]"),
    ]
    for state, match in cases:
        fresh = v2_controller()
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(state)
        assert fresh.step_count == 0
    _, plain = v2_state(latch=None)
    free = next(u for u in range(4) if not plain["plan"][u] and not plain["lock"][u])
    with pytest.raises(ValueError, match=rf"latched\[{free}\] = 3 .*latch: None"):
        v2_controller().load_state_dict(edited(plain, latched=(free, 3), plan=(free, True)))


def test_latches_beyond_the_budget_are_refused_and_conformed_on_a_policy_change(caplog):
    _, s = v2_state()
    fixed = GNMRConfig.from_dict({**V2_CFG, "max_active": 1, "latch": {"step": 1}}).to_dict()
    latched = torch.tensor([0, 5, 0, 7])
    state = edited(s, latched=latched, lock=torch.zeros(4, dtype=torch.int64), config=fixed)
    state = edited(unseal(state, "s")[0], plan=torch.tensor([False, True, False, True]))
    with pytest.raises(ValueError, match=r"latched with the locks is held by 2 units, more than"):
        v2_controller(fixed).load_state_dict(state)
    # the same latches under a budget of 2, resumed with 1: the earliest latched stays
    two = edited(unseal(state, "s")[0], config={**fixed, "max_active": 2})
    one = v2_controller(fixed)
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.core.controller"):
        one.load_state_dict(two)
    assert one.latches.tolist() == [0, 5, 0, 0] and "saved with policy" in caplog.text
    # resumed without a latch: every latch is dropped, the locks stay
    off = v2_controller({**fixed, "max_active": 2, "latch": None})
    off.load_state_dict(two)
    assert off.latches.tolist() == [0, 0, 0, 0]


def _spiked(config, eligible=None, steps=5):
    """A controller whose unit 1 (and, with ``spread``, 2 and 3) spiked at the last step."""
    ctrl = GNMRController(4, config, eligible=eligible)
    for t in range(steps):
        ctrl.step([1.0, 1.0, 1.0, 1.0] if t < steps - 1 else [1.0, 50.0, 60.0, 70.0])
    return ctrl


def test_a_state_saved_after_a_resume_with_another_mask_loads_again():
    """The saved plan is conformed on load like the locks: a unit made ineligible leaves it, so
    the state the resumed controller writes passes the plan-eligibility invariant (review of
    policy v2: the reload was refused as corrupted)."""
    config = GNMRConfig(max_active=3, warmup_steps=0, lock_steps=3)
    eligible = [True, False, True, True]
    resumed = GNMRController(4, config, eligible=eligible)
    resumed.load_state_dict(_spiked(config).state_dict())
    assert 1 not in list(resumed.plan)
    again = GNMRController(4, config, eligible=eligible)
    again.load_state_dict(resumed.state_dict())
    assert list(again.plan) == list(resumed.plan)


def test_recovered_counts_the_conformed_plan_after_a_tighter_resume():
    """A resume with a smaller budget runs (and counts) only the units the budget keeps."""
    saved = _spiked(GNMRConfig(max_active=3, warmup_steps=0, lock_steps=3))
    assert list(saved.plan) == [1, 2, 3]
    resumed = GNMRController(4, GNMRConfig(max_active=1, warmup_steps=0, lock_steps=3))
    resumed.load_state_dict(saved.state_dict())
    kept = list(resumed.plan)
    assert len(kept) == 1
    before = resumed.recovered.tolist()
    resumed.step([1.0, 1.0, 1.0, 1.0])
    grown = [a - b for a, b in zip(resumed.recovered.tolist(), before, strict=True)]
    assert [u for u, g in enumerate(grown) if g] == kept
