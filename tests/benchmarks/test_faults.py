"""Issue 35's instruments: the function-preserving outlier changes only what a narrow format sees,
TE AutoswitchGemm's rule switches the GEMMs it should, and the new arms (per-GEMM recovery, a
fixed set, the forward-only late switch on its schedule) spend what they claim."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.harness.arms import Arm, Outlier, OutlierPlan
from benchmarks.harness.autoswitch import GemmLedger, _score
from benchmarks.harness.branch import Instrument, run_branch
from benchmarks.harness.model import Batches
from benchmarks.harness.training import ArmRun
from tests.benchmarks.test_harness import tiny_trunk

BF16 = {"format": "bf16"}
FP4T = {"format": "e2m1", "granularity": "tensor"}
Q = {"backend": "fp8_emulated", "low_cost": FP4T, "recovery": BF16}
INST = Instrument(
    trunk_steps=8, points=(3, 5), horizon=3, evals=(1, 3), eval_batches=1, late_at="schedule"
)
PLAN = OutlierPlan(offset=0, rise=2, hold=2, growth=1024.0)


@pytest.fixture(scope="module")
def trunk(tmp_path_factory, one_thread):
    return tiny_trunk(tmp_path_factory.mktemp("trunk"), Q, INST)


def _branch(setup, root, arm, point=3, plan=PLAN):
    return run_branch(replace(setup, outlier_plan=plan), arm, INST, 3, point, root, False)


def test_outlier_window_and_powers_of_two():
    o = Outlier("m", 3, start=10, rise=3, hold=2, growth=2.0)
    assert [o.factor(t) for t in range(9, 16)] == [None, 2.0, 4.0, 8.0, 8.0, 8.0, None]
    with pytest.raises(ValueError, match="power of two"):
        Outlier("m", 3, start=1, growth=3.0)
    a, b = PLAN.at(7, 100, 4, 344), PLAN.at(7, 250, 4, 344)
    assert (a.module, a.channel) == (b.module, b.channel) and (a.start, b.start) == (100, 250)


def test_the_outlier_preserves_bf16_bit_for_bit_and_hurts_fp4(trunk):
    """BF16 (8 exponent bits) computes the same with and without the outlier; per-tensor E2M1
    does not, and the branch records where it struck."""
    setup, root = trunk
    bf16 = Arm("BF16", "recovery", **Q)
    with_fault, without = _branch(setup, root, bf16), _branch(setup, root, bf16, plan=None)
    assert with_fault["train_loss"] == without["train_loss"]
    assert with_fault["heldout"] == without["heldout"]
    assert with_fault["outliers"][0]["module"].endswith("mlp.down_proj")
    low = Arm("low-cost", "static", **Q)
    assert (
        _branch(setup, root, low)["train_loss"]
        != _branch(setup, root, low, plan=None)["train_loss"]
    )


def test_the_outlier_is_exact_in_a_bf16_gemm():
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(4, 16) * 0.02
    d = torch.ones(16)
    d[5] = 2.0**10
    a = (x.bfloat16().float() @ w.bfloat16().float().t()).float()
    b = ((x * d).bfloat16().float() @ (w / d).bfloat16().float().t()).float()
    assert torch.equal(a, b)


def test_autoswitch_scores_underflow_and_mse():
    t = torch.tensor([1.0, 1e-3, 0.5, 0.0])
    q = torch.tensor([1.0, 0.0, 0.5, 0.0])  # one non-zero lost of four: 25% underflow
    assert _score(t, q) == pytest.approx(0.25 / 0.05)
    assert _score(t, t) == 0.0
    ledger = GemmLedger(2)
    assert ledger.judge(1, 2, (t, q)) and not ledger.judge(0, 0, (t, t))
    assert ledger.unit_scores().tolist() == [0.0, pytest.approx(5.0)]


def test_autoswitch_arms(trunk):
    """The uncapped rule switches GEMMs on its own (per-tensor E2M1 underflows far beyond 5%);
    capped at 2 units it recovers at most 2 per step, all three GEMMs, from the second step."""
    setup, root = trunk
    free = _branch(setup, root, Arm("auto", "autoswitch", **Q))
    assert sum(free["gemms_high"]) > 0 and 0 < free["flops_recovered"] <= 1
    capped = _branch(setup, root, Arm("auto 2", "autoswitch_k", max_active=2, **Q))
    assert capped["recovered_unit_steps"] <= 2 * 2  # nothing before the first scores
    assert capped["gemms_high"][0] == capped["gemms_high"][1] == capped["gemms_high"][2]
    low = _branch(setup, root, Arm("low-cost", "static", **Q))
    off = Arm("auto", "autoswitch", **{**Q, "recovery": FP4T})  # high = low: nothing changes
    assert _branch(setup, root, off)["train_loss"] == low["train_loss"]


def test_fixed_and_per_gemm_arms_count_their_work(trunk):
    setup, root = trunk
    fixed = _branch(setup, root, Arm("u0", "fixed", units=(0,), **Q))
    assert fixed["unit_recovered"][0] == 3 and fixed["recovered_unit_steps"] == 3
    s = replace(setup, steps=8, seed=3)
    sizes = ArmRun(s, Arm("x", "static", **Q), Batches(s.heldout, s)).registry.sizes
    assert fixed["flops_recovered"] == pytest.approx(sizes[0] / sum(sizes))
    fwd = _branch(setup, root, Arm("u0 fprop", "fixed", units=(0,), gemms=("fprop",), **Q))
    assert fwd["flops_recovered"] == pytest.approx(fixed["flops_recovered"] / 3)
    assert fwd["gemms_high"] == [3, 0, 0]
    bf16 = _branch(setup, root, Arm("BF16", "recovery", **Q))
    assert bf16["flops_recovered"] == pytest.approx(1.0)


def test_late_switches_act_at_the_end_of_the_trunks_schedule(trunk):
    """A late rule acts in the last steps of the run (the trunk's schedule ends at 8), so a
    branch ending before them runs low-cost, and one ending the schedule switches; the
    forward-only switch (a pinned block from a step, fprop only) recovers a third of the work."""
    setup, root = trunk
    late = Arm("late", "late", late_steps=1, **Q)
    assert _branch(setup, root, late, point=3)["recovered_unit_steps"] == 0
    assert _branch(setup, root, late, point=5)["recovered_unit_steps"] == 14
    # the decision of step 7 holds from step 7 on and is the plan of step 8 (docs/algorithm.md)
    pinned = {"max_active": 0, "pinned": {"units": "all", "from": {"step": 7}}}
    fwd = Arm("late fwd", "gnmr", controller=pinned, gemms=("fprop",), **Q)
    got = _branch(setup, root, fwd, point=5)
    assert got["gemms_high"] == [14, 0, 0]
    assert got["flops_recovered"] == pytest.approx(1 / 3 / 3)


def test_preregistered_verdicts_use_bonferroni_intervals():
    from benchmarks.harness.preregistered import COMPARISONS, t_quantile, verdict
    from benchmarks.harness.stats import t95

    assert [round(t_quantile(0.975, df), 3) for df in (1, 4, 9, 30)] == [
        t95(d) for d in (1, 4, 9, 30)
    ]
    assert t_quantile(1 - 0.05 / 8, 9) == pytest.approx(3.111, abs=1e-3)  # 98.75%, 10 seeds
    assert len(COMPARISONS) == 4 and COMPARISONS[0].rival == "random 4"
    diffs = [-0.010, -0.012, -0.008, -0.011, -0.009, -0.010, -0.013, -0.007, -0.010, -0.010]
    m, half, word = verdict(diffs)
    assert word == "better" and m == pytest.approx(-0.01) and half > 0
    # resolved at 95% but not at the family's 98.75%: the adjustment is what decides
    noisy = [-0.02, -0.004, -0.015, 0.001, -0.012, -0.009]
    assert verdict(noisy, family=1)[2] == "better" and verdict(noisy)[2] == "not resolved"


def test_fault_arms_name_the_preregistered_rivals():
    from benchmarks.harness.preregistered import family
    from benchmarks.sweep.branch_arms import make_arms
    from benchmarks.sweep.regimes import FAULT_REGIMES

    for regime in FAULT_REGIMES.values():
        names = {a.name for a, _ in make_arms(regime, (4,), 28)}
        own = family(regime.name, 4)  # the fault sweeps' four, or the regime's own family
        wanted = {c.arm for c in own} | {c.rival for c in own}
        if regime.backend != "fp8_emulated":  # TE's rule runs on fp8_emulated's specs only
            wanted = {a for a in wanted if not a.startswith("TE autoswitch")}
        assert wanted <= names
        assert len(names) == len(make_arms(regime, (4,), 28))  # no name twice


def test_the_loss_oracle_takes_the_units_of_largest_single_gain():
    from benchmarks.sweep.loss_oracle import oracle_arm, single_arms
    from benchmarks.sweep.regimes import FAULT_REGIMES

    regime = FAULT_REGIMES["outlier_fp8_tensor"]
    h = regime.instrument.horizon
    singles = single_arms(regime, regime.units)
    assert [a.units for a in singles[:2]] == [(0,), (1,)] and len(singles) == 28
    gain = {5: 0.02, 9: 0.03, 27: 0.01, 3: 0.01}  # 27 and 3 tie: the lower id goes first
    records = {("low-cost", 1, 100): {"heldout": {str(h): 2.5}}}
    for u in range(28):
        records[(f"single {u}", 1, 100)] = {"heldout": {str(h): 2.5 - gain.get(u, 0.0)}}
    arm = oracle_arm(regime, records, 1, 100, 3)
    assert arm.name == "loss oracle 3" and arm.units == (3, 5, 9) and arm.policy == "fixed"


def test_autoswitch_draws_the_same_bits_in_every_process(trunk):
    """Stochastic rounding under the rule is keyed by (step, unit, operator, call), never by an
    address: two runs of the same NVFP4 branch train the same."""
    setup, root = trunk
    q = {**Q, "low_cost": {"format": "e2m1"}}
    a, b = (_branch(setup, root, Arm("auto", "autoswitch", **q)) for _ in range(2))
    assert a["train_loss"] == b["train_loss"] and a["gemms_high"] == b["gemms_high"]
    # with its high path the low-cost one, the rule draws the bits the backend draws: the same
    # stochastic rounding pairs it with every other arm
    off = Arm("auto", "autoswitch", **{**q, "recovery": q["low_cost"]})
    low = Arm("low-cost", "static", **q)
    assert _branch(setup, root, off)["train_loss"] == _branch(setup, root, low)["train_loss"]
