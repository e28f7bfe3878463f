"""``gnmr_dist.testing.scores`` (torch) against the controller's numpy policy, bit for bit.

docs/algorithm.md#properties claims the two agree bit for bit. At every step of a trace the
controller's own history (read through ``state_dict()``) goes through
:func:`~gnmr_dist.testing.scores.risk_scores`, and its GNMR, delta-GNMR and risk must have the
same bytes as the decision's. The window mean is summed oldest to newest, column by column, as
the doc's ``mean W(u)`` reads and as the policy sums it. Traces: a realistic one (log-normal
norms, spikes, zeros, NaN and +-inf, a unit whose history stays all zeros, then moves), with and
without the damage term, and hypothesis' scenarios of ``test_properties``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.testing.scores import error_scores, ratio, risk_scores
from tests.core.test_properties import SETTINGS, error_rows, scenarios


def torch_scores(ctrl, cfg, norms, errors):
    """``risk_scores`` at the controller's next step, from its saved history."""
    state, t = ctrl.state_dict(), ctrl.step_count + 1
    window, length = state["window_buffer"], state["window_len"]
    total = torch.zeros(ctrl.num_units, dtype=torch.float64)
    for j in range(window.shape[1]):  # oldest to newest; leading zeros of a short window add 0
        total = total + window[:, j]
    mean = total / torch.where(length > 0, length, torch.ones_like(length))
    alpha, beta = cfg.thresholds_at(t)
    return risk_scores(
        torch.as_tensor(norms, dtype=torch.float64),
        state["norm_sum"],
        state["norm_count"],
        mean,
        length,
        alpha,
        beta,
        errors=None if errors is None else torch.as_tensor(errors, dtype=torch.float64),
        gamma=cfg.gamma_at(t),
    )


def assert_bitwise_over(ctrl, cfg, trace, errors):
    for row, e in zip(trace, errors, strict=True):
        want = torch_scores(ctrl, cfg, row, e)
        d = ctrl.step(row, errors=e)
        for name, got, ref in zip(
            ("gnmr", "delta_gnmr", "risk"), (d.gnmr, d.delta_gnmr, d.risk), want, strict=True
        ):
            assert got.numpy().tobytes() == ref.numpy().tobytes(), (d.step, name, got, ref)


def realistic_trace(units: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms [steps, units] and error scores [steps, units] with every edge the policy has."""
    g = torch.Generator().manual_seed(3)
    base = torch.exp(2 * torch.randn(units, generator=g, dtype=torch.float64))
    norms = base * torch.exp(0.3 * torch.randn(steps, units, generator=g, dtype=torch.float64))
    norms = torch.where(torch.rand(steps, units, generator=g) < 0.02, norms * 40, norms)
    norms = torch.where(torch.rand(steps, units, generator=g) < 0.03, 0.0, norms)
    norms = torch.where(torch.rand(steps, units, generator=g) < 0.005, math.nan, norms)
    norms = torch.where(torch.rand(steps, units, generator=g) < 0.003, math.inf, norms)
    norms[: steps // 3, 0] = 0.0  # all-zero history: scores 1, then +inf when it moves
    errors = torch.rand(steps, units, generator=g, dtype=torch.float64)
    errors = torch.where(torch.rand(steps, units, generator=g) < 0.01, math.nan, errors)
    return norms, errors


@pytest.mark.parametrize(
    "gamma", [None, 0.6, {"schedule": "linear", "start": 1.0, "end": 0.3, "steps": 50}]
)
def test_numpy_policy_equals_torch_scores_on_a_realistic_trace(gamma):
    cfg = GNMRConfig(
        max_active=4,
        lock_steps=5,
        window=8,
        alpha={"schedule": "cosine", "start": 4.0, "end": 1.5, "steps": 100},
        warmup_steps=8,
        gamma=gamma,
    )
    norms, errors = realistic_trace(units=48, steps=200)
    ctrl = GNMRController(48, cfg)
    rows = list(errors) if gamma is not None else [None] * len(norms)
    assert_bitwise_over(ctrl, cfg, list(norms), rows)


@SETTINGS
@given(scenarios())
def test_numpy_policy_equals_torch_scores_on_random_scenarios(case):
    u, cfg, eligible, trace, errors = case
    config = GNMRConfig.from_dict(cfg)
    ctrl = GNMRController(u, config, eligible=eligible)
    assert_bitwise_over(ctrl, config, trace, error_rows(errors, trace))


def test_ratio_conventions():
    a = torch.tensor([3.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    b = torch.tensor([1.5, 0.0, 0.0, 4.0], dtype=torch.float64)
    assert ratio(a, b).tolist() == [2.0, 1.0, math.inf, 0.0]


def test_error_scores_make_every_non_finite_value_inf():
    e = torch.tensor([0.5, math.nan, -math.inf, math.inf, 0.0], dtype=torch.float64)
    assert error_scores(e).tolist() == [0.5, math.inf, math.inf, math.inf, 0.0]


def test_risk_scores_needs_errors_and_gamma_together():
    one = torch.ones(2, dtype=torch.float64)
    count = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="both errors and gamma"):
        risk_scores(one, one, count, one, count, 1.5, 2.0, errors=one)


def test_the_core_names_of_the_reference_are_deprecated_aliases():
    """Moved to ``gnmr_dist.testing`` (issue 45): the old names warn for one release."""
    import gnmr_dist.core
    from gnmr_dist.testing import scores

    assert "risk_scores" not in gnmr_dist.core.__all__
    for name in ("error_scores", "ratio", "risk_scores"):
        with pytest.warns(DeprecationWarning, match=f"gnmr_dist.testing.scores.{name}"):
            assert getattr(gnmr_dist.core, name) is getattr(scores, name)
