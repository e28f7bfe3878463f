"""Checkpoint state: weights_only loads, exact resume, and loud failures on bad state."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from gnmr_dist import GNMRConfig, GNMRController


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


def mutated(key, value):
    state = trained().state_dict()
    state[key] = value
    return state


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
        (mutated("lock", torch.tensor([0, -1, 0])), "negative counts or locks"),
        (mutated("window_len", torch.tensor([0, 99, 0])), r"window lengths outside \[0, 8\]"),
        (
            mutated("norm_sum", torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64)),
            "non-finite history",
        ),
        (mutated("step", -5), "step=-5 is negative"),
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
