"""Issue 44, stage 5: TE's delayed-scaling defaults as a regime (and the emulation's HYBRID format
and 1024-step history against TE's numbers), the deep model's 112 units, the wgrad-only FP4 rows
at the same linear work as whole units, and their registration."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.harness import preregistered as pr
from benchmarks.harness.arms import Arm
from benchmarks.harness.model import Batches, build_model
from benchmarks.sweep.branch_arms import OFF, make_arms
from benchmarks.sweep.branches import trunks_dir
from benchmarks.sweep.regimes import DEEP_SETUP, FAULT_REGIMES, FP4_REGIMES, FP8_TE_DELAYED
from gnmr_dist.backends.emulated_options import EmulatedOptions, LinearQuantSpec
from gnmr_dist.backends.emulated_scaling import DelayedScales, commit_all
from gnmr_dist.backends.numerics.formats import FORMATS
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled
from gnmr_dist.distributed import UnitRegistry

TE_DELAYED = {"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max"}
TE_DELAYED |= {"margin": 0, "max_fwd": 448.0, "max_bwd": 57344.0}
"""``transformer_engine.common.recipe.DelayedScaling()``'s defaults and ``Format.HYBRID``'s
maxima, read from TE's source (commit 000b637): the reference, written here by hand."""


def test_the_hybrid_regime_is_tes_delayed_scaling_as_it_comes():
    regime = FAULT_REGIMES["outlier_delayed_hybrid"]
    parent = FAULT_REGIMES["outlier_delayed"]
    assert regime.low_cost == FP8_TE_DELAYED
    assert (FP8_TE_DELAYED["format"], FP8_TE_DELAYED["grad_format"]) == ("e4m3", "e5m2")
    for key in ("amax_history_len", "amax_compute_algo", "margin"):
        assert FP8_TE_DELAYED[key] == TE_DELAYED[key]
    spec = LinearQuantSpec.from_options(EmulatedOptions(**regime.low_cost))
    assert spec.x_format.max_value == TE_DELAYED["max_fwd"]
    assert spec.grad_format.max_value == TE_DELAYED["max_bwd"]
    # beside outlier_delayed: the same trunks, outlier, points and arms' backend but the recipe
    assert (regime.setup, regime.trunk, regime.instrument) == (
        parent.setup,
        parent.trunk,
        parent.instrument,
    )
    assert parent.low_cost["amax_history_len"] == 16 and "grad_format" not in parent.low_cost


def test_emulated_hybrid_scales_dy_against_e5m2_and_keeps_a_spike_1024_steps():
    spec = LinearQuantSpec.from_options(EmulatedOptions(**FP8_TE_DELAYED))
    scales = DelayedScales.of(spec)
    assert (scales.x.fmt.name, scales.w.fmt.name, scales.dy.fmt.name) == ("e4m3", "e4m3", "e5m2")
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(64, 32, generator=gen)
    dy = dy / dy.abs().max()  # amax 1
    # step 1: the spike (amax 2^10) enters the history
    scales.dy.quantize(dy * 1024.0, record=True)
    commit_all([scales.dy])
    # then 1023 quiet steps (amax 1): the max over the history is still the spike's
    for _ in range(1023):
        scales.dy.quantize(dy, record=True)
        commit_all([scales.dy])
    q, scale = scales.dy.quantize(dy, record=False)
    assert scale.item() == pytest.approx(1024.0 / 57344.0)
    want = quantize_dequantize_scaled(dy, FORMATS["e5m2"], torch.tensor(1024.0 / 57344.0))
    assert torch.equal(q, want)
    # the 1025th commit pushes the spike out: the scale is the quiet steps' amax (1) / 57344
    scales.dy.quantize(dy, record=True)
    commit_all([scales.dy])
    assert scales.dy.scale().item() == pytest.approx(1.0 / 57344.0)


def test_the_deep_model_has_112_units_and_its_own_trunks():
    regime = FAULT_REGIMES["outlier_delayed_deep"]
    assert regime.setup.outlier_plan is not None
    model = build_model(DEEP_SETUP)
    registry = UnitRegistry.from_model(model, granularity="operator")
    assert registry.num_units == regime.units == 112 == 16 * 7
    assert int(registry.eligible.sum()) == 112
    assert regime.low_cost == FAULT_REGIMES["outlier_delayed"].low_cost
    assert trunks_dir(regime).parent.name == "deep"
    assert regime.instrument.points == (100,) and regime.instrument.trunk_steps == 400
    # the fault strikes a down_proj among all 16 layers, a channel of its 172 inputs
    plan = regime.setup.outlier_plan
    layers = {int(plan.at(s, 100, 16, 172).module.split(".")[2]) for s in range(200)}
    assert layers == set(range(16))
    o = plan.at(1234, 100, 16, 172)
    draw = random.Random(1234)
    assert o.module == f"model.layers.{draw.randrange(16)}.mlp.down_proj"
    assert o.channel == draw.randrange(172)


def test_compact_arms_are_the_statics_nulls_and_four_budgeted_arms_at_one_k():
    for name in ("outlier_delayed_hybrid", "outlier_delayed_deep"):
        regime = FAULT_REGIMES[name]
        arms = {a.name: (a, p) for a, p in make_arms(regime, [4], regime.units)}
        assert list(arms) == [
            "low-cost",
            "BF16",
            "null BF16 (1e-6)",
            "null low-cost (1e-6)",
            "GNMR+e 4",
            "e-only 4",
            "random 4",
            "NVIDIA last-4",
        ]
        assert [p for _, p in arms.values()] == [
            False,
            False,
            True,
            True,
            False,
            False,
            False,
            False,
        ]
        e, only = arms["GNMR+e 4"][0], arms["e-only 4"][0]
        assert e.controller == {"gamma": regime.gamma} and e.error_every == 1
        assert only.controller == {**e.controller, "alpha": OFF, "beta": OFF}
        assert arms["NVIDIA last-4"][0].max_active == 4


def test_wgrad_rows_spend_the_work_of_k_whole_units():
    regime = FAULT_REGIMES["nvfp4_wgrad"]
    parent = FP4_REGIMES["nvfp4"]
    assert (regime.setup, regime.low_cost, regime.gamma) == (
        parent.setup,
        parent.low_cost,
        parent.gamma,
    )
    arms = {a.name: a for a, _ in make_arms(regime, [4], regime.units)}
    w, rw = arms["GNMR+e wgrad 12"], arms["random wgrad 12"]
    assert (w.gemms, w.max_active, rw.gemms, rw.max_active) == (("wgrad",), 12, ("wgrad",), 12)
    assert w.controller == arms["GNMR+e 4"].controller and w.error_every == 8
    # measured: the wgrad of the last 3 units (gate, up, down: one size) is one whole unit's work
    from benchmarks.harness.training import ArmRun

    setup = DEEP_SETUP.__class__(layers=1, hidden=32, heads=2, ffn=64, seq_len=16, batch=2)
    q = regime.backend_args()
    work = {}
    for arm in (
        Arm("whole", "last_units", max_active=1, **q),
        Arm("wgrad", "last_units", max_active=3, gemms=("wgrad",), **q),
    ):
        run = ArmRun(setup, arm, Batches(setup.heldout, setup), evaluates=False)
        run.step(1, Batches(setup.data, setup))
        work[arm.name] = run.flops_recovered
        assert run.gemm_high.tolist() == ([1, 1, 1] if arm.name == "whole" else [0, 0, 3])
    assert work["wgrad"] == pytest.approx(work["whole"])
    assert 0 < work["whole"] < 1


def test_stage5_is_registered_with_arms_that_its_regimes_run():
    for name, build in pr.STAGE5_FAMILIES.items():
        regime = FAULT_REGIMES[name]
        names = {a.name for a, _ in make_arms(regime, [pr.STAGE5_BUDGET], regime.units)}
        family = pr.family(name, pr.STAGE5_BUDGET)
        assert family == build(pr.STAGE5_BUDGET) and len(family) == 4
        assert {x for c in family for x in (c.arm, c.rival)} <= names
        assert pr.STOPPING[name].planned == pr.STAGE5_SEEDS and not pr.STOPPING[name].added
        assert pr.reads_ties(name) == (regime.arm_set == "compact")
    assert [(c.arm, c.rival) for c in pr.wgrad(4)][:2] == [
        ("GNMR+e wgrad 12", "GNMR+e 4"),
        ("random wgrad 12", "random 4"),
    ]


def test_a_regime_without_a_fault_renders_with_its_own_family(tmp_path):
    from tests.benchmarks.test_report import _fault_record, _fault_section, _write_faults

    arms = {"low-cost": (0.010, 0.0), "BF16": (0.0, 1.0), "null BF16 (1e-6)": (0.0, 1.0)}
    arms |= {"null low-cost (1e-6)": (0.010, 0.0), "GNMR+e 4": (0.006, 4 / 28)}
    arms |= {"random 4": (0.008, 4 / 28), "GNMR+e wgrad 12": (0.003, 4 / 28)}
    arms |= {"random wgrad 12": (0.005, 4 / 28)}
    rows = []
    for s in (1, 2, 3, 4, 5):
        for a, (offset, share) in arms.items():
            r = _fault_record(a, s, 325, offset + 1e-4 * ((s * 3 + len(a)) % 3 - 1), share)
            rows.append(r | {"outliers": []})
    _write_faults(tmp_path, rows, name="nvfp4_wgrad")
    text = _fault_section(tmp_path)
    assert "No fault: the low-cost path's uniform damage" in text
    assert "it struck" not in text
    assert "**Design: 5 seeds (1, 2, 3, 4 and 5) x 1 branch points (325)" in text
    assert "| nvfp4_wgrad | GNMR+e wgrad 12 - GNMR+e 4 |" in text
    assert "| nvfp4_wgrad | random wgrad 12 - random 4 |" in text
    assert "(a tie)" not in text.split("GNMR+e wgrad 12 - GNMR+e 4")[1].split("|")[3]
    assert "GNMR+e wgrad 36" not in text  # 3k is not a budget of its own
