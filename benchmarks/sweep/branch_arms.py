"""The arms of the branch sweeps (:mod:`benchmarks.sweep.fp4`): the controls, NVIDIA's rules and
the budgeted selectors, built for one regime (:mod:`benchmarks.sweep.regimes`).

The arms in detail: docs/benchmarks.md#sweep-fp4.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import NULL_ARMS
from benchmarks.sweep.regimes import Regime

ERROR_EVERY = 8
NVIDIA_SHARE = 0.15
"""NVIDIA keeps about 15% of the linear layers in BF16 (arXiv 2509.25149)."""


def nvidia_k(units: int) -> int:
    """NVIDIA's rule at this model's size: the nearest whole count to 15% of the units."""
    return max(1, round(NVIDIA_SHARE * units))


def make_arms(regime: Regime, budgets: Sequence[int], units: int) -> list[tuple[Arm, bool]]:
    """(arm, perturbed) of every control and budgeted policy (module docstring)."""
    q = regime.backend_args()
    k_nv, horizon = nvidia_k(units), regime.instrument.horizon
    late = max(1, round(horizon * k_nv / units))
    arms: list[tuple[Arm, bool]] = [
        (Arm("low-cost", "static", **q), False),
        (Arm("BF16", "recovery", **q), False),
        (Arm(f"NVIDIA last-{k_nv}", "last_units", max_active=k_nv, **q), False),
        (Arm(f"NVIDIA late-{late}", "late", late_steps=late, **q), False),
        (Arm("first+last", "first_last", **q), False),
        (Arm(NULL_ARMS[0], "recovery", **q), True),
        (Arm(NULL_ARMS[1], "static", **q), True),
    ]
    if regime.stochastic:
        reseeded = {**q, "low_cost": {**q["low_cost"], "seed": 1}}
        arms.append((Arm("low-cost (SR seed 1)", "static", **reseeded), False))
    for k in budgets:
        e = regime.error_policy()
        arms += [
            (Arm(f"random {k}", "random", max_active=k, **q), False),
            (Arm(f"GNMR {k}", "gnmr", max_active=k, **q), False),
            (
                Arm(
                    f"GNMR+e {k}", "gnmr", max_active=k, controller=e, error_every=ERROR_EVERY, **q
                ),
                False,
            ),
            (Arm(f"oracle {k}", "oracle", max_active=k, **q), False),
        ]
    return arms


def step_time_arms(regime: Regime) -> tuple[Arm, Arm]:
    """``NVIDIA last-k`` and ``GNMR+e k`` at NVIDIA's budget ``k``, as the sweep runs them."""
    k = nvidia_k(regime.units)
    arms = {arm.name: arm for arm, _ in make_arms(regime, [k], regime.units)}
    return arms[f"NVIDIA last-{k}"], arms[f"GNMR+e {k}"]
