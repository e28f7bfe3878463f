"""The arms of the branch sweeps (:mod:`benchmarks.sweep.branches`): the controls, NVIDIA's
rules and the budgeted selectors, built for one regime (:mod:`benchmarks.sweep.regimes`).

The arms in detail: docs/benchmarks.md#sweep-fp4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import NULL_ARMS
from benchmarks.harness.lean import LEAN_RISE
from benchmarks.sweep.regimes import Regime

ERROR_EVERY = 8
OFF = 1e30
"""A norm threshold (``alpha``, ``beta``) no finite score reaches: the ``e-only`` arms' norm terms
off (a non-finite norm still scores +inf and exceeds, as in every arm)."""
NVIDIA_SHARE = 0.15
"""NVIDIA keeps about 15% of the linear layers in BF16 (arXiv 2509.25149)."""


def nvidia_k(units: int) -> int:
    """NVIDIA's rule at this model's size: the nearest whole count to 15% of the units."""
    return max(1, round(NVIDIA_SHARE * units))


def make_arms(regime: Regime, budgets: Sequence[int], units: int) -> list[tuple[Arm, bool]]:
    """(arm, perturbed) of every control and budgeted policy (module docstring); a fault
    regime's are :func:`fault_arms`."""
    if regime.arm_set == "compact":
        return compact_arms(regime, budgets)
    if regime.arm_set == "wgrad":
        return wgrad_arms(regime, budgets)
    if regime.family == "faults":
        return fault_arms(regime, budgets, units)
    if regime.family == "paper":
        return paper_arms(regime, budgets, units)
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


NVIDIA_LATE_FROM = 0.82
"""NVIDIA's forward-only switch starts at 8.2T of 10T tokens (arXiv 2509.25149, app. D)."""


def fault_arms(regime: Regime, budgets: Sequence[int], units: int) -> list[tuple[Arm, bool]]:
    """(arm, perturbed) of a fault regime (issue 35): the controls, NVIDIA's three rules, TE
    AutoswitchGemm's rule and, per budget ``k``, random-k, seed GNMR, GNMR+e, the gradient-gap
    oracle, the capped AutoswitchGemm rule, GNMR+e v2 and issue 44's ablation: ``e-only k``
    (GNMR+e with the norm thresholds off: the same damage term, ``gamma``, lock and budget) and
    ``GNMR+e lean k`` (GNMR+e whose damage term counts a unit's ``e`` only where it rises
    :data:`~benchmarks.harness.lean.LEAN_RISE` times above the unit's usual level,
    :mod:`benchmarks.harness.lean`).

    Spend: the time rules are placed on the trunk's schedule (``T`` steps) and sized in a run's
    terms, ``share = k / units`` of the unit-steps (all GEMMs in the last ``share T`` steps;
    forward only, a third of the work, from ``T (1 - 3 share)``), NVIDIA's own forward-only
    switch from 82% of the schedule. GNMR+e v2 caps its recovered work at the same share
    (``max_share``, twice the units) and recovers all three GEMMs: the outlier damages fprop and
    wgrad through ``x D`` and dgrad through the shrunk column of ``W D^-1`` (its ``dx_c``
    underflows). The forward-only switches are left out under delayed scaling, whose amax
    history per tensor serves two GEMMs; the AutoswitchGemm rules run on ``fp8_emulated``'s
    specs only (:mod:`benchmarks.harness.autoswitch`), so another backend has none."""
    q, k_nv = regime.backend_args(), nvidia_k(units)
    steps = regime.instrument.trunk_steps
    delayed = regime.low_cost.get("scaling") == "delayed"
    switch = regime.backend == "fp8_emulated"
    arms: list[tuple[Arm, bool]] = [
        (Arm("low-cost", "static", **q), False),
        (Arm("BF16", "recovery", **q), False),
        (Arm(NULL_ARMS[0], "recovery", **q), True),
        (Arm(NULL_ARMS[1], "static", **q), True),
        (Arm(f"NVIDIA last-{k_nv}", "last_units", max_active=k_nv, **q), False),
    ]
    if switch:
        arms.append((Arm("TE autoswitch", "autoswitch", **q), False))
    if regime.stochastic:
        reseeded = {**q, "low_cost": {**q["low_cost"], "seed": 1}}
        arms.append((Arm("low-cost (SR seed 1)", "static", **reseeded), False))
    late = round(steps * k_nv / units)
    arms.append((Arm(f"NVIDIA late-{late}", "late", late_steps=late, **q), False))
    if not delayed:
        arms.append((_late_forward("NVIDIA late fwd (82%)", NVIDIA_LATE_FROM, steps, q), False))
        share = max(0.0, 1 - 3 * k_nv / units)
        arms.append((_late_forward("late fwd (same work)", share, steps, q), False))
    e = {**regime.error_policy()}
    for k in budgets:
        v2 = {**e, "max_active": 2 * k, "max_share": round(k / units, 4)}
        arms += [
            (Arm(f"random {k}", "random", max_active=k, **q), False),
            (Arm(f"GNMR {k}", "gnmr", max_active=k, **q), False),
            (Arm(f"GNMR+e {k}", "gnmr", max_active=k, controller=e, error_every=1, **q), False),
            (
                Arm(
                    f"GNMR+e v2 {k}",
                    "gnmr",
                    max_active=2 * k,
                    controller=v2,
                    error_every=1,
                    **q,
                ),
                False,
            ),
        ]
        if switch:
            arms.append((Arm(f"TE autoswitch {k}", "autoswitch_k", max_active=k, **q), False))
        arms.append((Arm(f"oracle {k}", "oracle", max_active=k, **q), False))
        arms += _ablation(k, e, q)
    return arms


def _ablation(k: int, e: dict[str, Any], q: dict[str, Any]) -> list[tuple[Arm, bool]]:
    """Issue 44's ablation of ``GNMR+e k`` (:func:`fault_arms`): its norm terms off, and its
    damage term lean."""
    only = {**e, "alpha": OFF, "beta": OFF}
    return [
        (Arm(f"e-only {k}", "gnmr", max_active=k, controller=only, error_every=1, **q), False),
        (
            Arm(
                f"GNMR+e lean {k}",
                "gnmr",
                max_active=k,
                controller=e,
                error_every=1,
                lean_rise=LEAN_RISE,
                **q,
            ),
            False,
        ),
    ]


def _statics(q: dict[str, Any]) -> list[tuple[Arm, bool]]:
    """The two static paths and their null controls."""
    return [
        (Arm("low-cost", "static", **q), False),
        (Arm("BF16", "recovery", **q), False),
        (Arm(NULL_ARMS[0], "recovery", **q), True),
        (Arm(NULL_ARMS[1], "static", **q), True),
    ]


def compact_arms(regime: Regime, budgets: Sequence[int]) -> list[tuple[Arm, bool]]:
    """Issue 44's stage-5 fault regimes (TE's delayed defaults, the deep model): the statics and
    nulls and, per budget ``k``, ``GNMR+e k`` and ``e-only k`` (the error term every step, as in
    :func:`fault_arms`), ``random k`` and ``NVIDIA last-k``: NVIDIA's rule at the same ``k``,
    the last ``k`` units of the model (not 15% of them: the question is the budget's
    selection)."""
    q, e = regime.backend_args(), regime.error_policy()
    arms = _statics(q)
    for k in budgets:
        arms += [
            (Arm(f"GNMR+e {k}", "gnmr", max_active=k, controller=e, error_every=1, **q), False),
            _ablation(k, e, q)[0],
            (Arm(f"random {k}", "random", max_active=k, **q), False),
            (Arm(f"NVIDIA last-{k}", "last_units", max_active=k, **q), False),
        ]
    return arms


WGRAD_ONLY = ("wgrad",)
"""The GEMM subset of the wgrad-only arms (``gnmr.gemms``, docs/gemms.md)."""


def wgrad_arms(regime: Regime, budgets: Sequence[int]) -> list[tuple[Arm, bool]]:
    """The wgrad-only FP4 rows (issue 44, stage 5): the statics and nulls and, per budget ``k``,
    whole-unit ``GNMR+e k`` and ``random k`` beside ``GNMR+e wgrad 3k`` and ``random wgrad 3k``,
    which recover only the wgrad GEMM of up to ``3k`` units: a GEMM is a third of its unit's
    work, so both spend at most the work of ``k`` units of the same sizes (random: the same
    expected share, ``k / U``). The error term every :data:`ERROR_EVERY` steps, as in the FP4
    sweeps; it measures the low-cost wgrad's error whatever the subset (docs/gemms.md), which
    is what a wgrad-only recovery repairs."""
    q, e = regime.backend_args(), regime.error_policy()
    arms = _statics(q)
    for k in budgets:
        w = 3 * k
        arms += [
            (
                Arm(
                    f"GNMR+e {k}", "gnmr", max_active=k, controller=e, error_every=ERROR_EVERY, **q
                ),
                False,
            ),
            (Arm(f"random {k}", "random", max_active=k, **q), False),
            (
                Arm(
                    f"GNMR+e wgrad {w}",
                    "gnmr",
                    max_active=w,
                    controller=e,
                    error_every=ERROR_EVERY,
                    gemms=WGRAD_ONLY,
                    **q,
                ),
                False,
            ),
            (Arm(f"random wgrad {w}", "random", max_active=w, gemms=WGRAD_ONLY, **q), False),
        ]
    return arms


def paper_arms(regime: Regime, budgets: Sequence[int], units: int) -> list[tuple[Arm, bool]]:
    """(arm, perturbed) of a paper experiment on the branch estimator: the two static paths (the
    recovery one named :attr:`Regime.high`), the null controls, NVIDIA's last-layers rule and,
    per budget ``k``, random-k, the paper's GNMR, GNMR+e and the gradient-gap oracle."""
    q, k_nv = regime.backend_args(), nvidia_k(units)
    arms: list[tuple[Arm, bool]] = [
        (Arm("low-cost", "static", **q), False),
        (Arm(regime.high, "recovery", **q), False),
        (Arm(f"null {regime.high} (1e-6)", "recovery", **q), True),
        (Arm(NULL_ARMS[1], "static", **q), True),
        (Arm(f"NVIDIA last-{k_nv}", "last_units", max_active=k_nv, **q), False),
    ]
    e = regime.error_policy()
    for k in budgets:
        arms += [
            (Arm(f"random {k}", "random", max_active=k, **q), False),
            (Arm(f"GNMR {k}", "gnmr", max_active=k, **q), False),
            (Arm(f"GNMR+e {k}", "gnmr", max_active=k, controller=e, error_every=1, **q), False),
            (Arm(f"oracle {k}", "oracle", max_active=k, **q), False),
        ]
    return arms


def _late_forward(name: str, start: float, steps: int, q: dict[str, Any]) -> Arm:
    """Every unit's fprop on the recovery path from ``start`` of the schedule on (a pinned
    block; the decision of step ``s - 1`` is the plan of step ``s``)."""
    first = round(start * steps)
    pinned = {"max_active": 0, "pinned": {"units": "all", "from": {"step": first - 1}}}
    return Arm(name, "gnmr", controller=pinned, gemms=("fprop",), **q)


def step_time_arms(regime: Regime) -> tuple[Arm, Arm]:
    """``NVIDIA last-k`` and ``GNMR+e k`` at NVIDIA's budget ``k``, as the sweep runs them."""
    k = nvidia_k(regime.units)
    arms = {arm.name: arm for arm, _ in make_arms(regime, [k], regime.units)}
    return arms[f"NVIDIA last-{k}"], arms[f"GNMR+e {k}"]
