"""Checkpoint state: weights_only loads, exact resume, and loud failures on bad state."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.core.integrity import StateIntegrityError, seal, unseal


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
