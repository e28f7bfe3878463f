"""Issue 43's fault instrument on ``torchao_fp8``'s real casts: the function-preserving outlier
inside torchao's FP8 GEMM, ``B(u)`` taken on the trained weight's gradient
(``scale_gradient_columns``) against a bound computed here from an independent FP8 cast, the
linears computing in BF16 (the recovery path a real BF16 GEMM, the low-cost path torchao's own
``Float8Linear`` of a BF16 model, bit for bit), the regime built as ``outlier_fp8_tensor`` is
and branched from the same trunks, and the cost model's price of torchao's recipes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from benchmarks.harness.arms import Arm, Outlier, OutlierPlan
from benchmarks.harness.branch import Instrument, run_branch, trunk_file
from benchmarks.harness.cost import Formats, price
from benchmarks.harness.forwards import install_forwards
from gnmr_dist.backends import get_backend
from tests.backends.test_gradient_columns import scaled_step
from tests.benchmarks.test_harness import tiny_trunk

pytest.importorskip("torchao.float8")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

LOW = {"recipe": "tensorwise", "pad_inner_dim": True}
AO = {"backend": "torchao_fp8", "low_cost": LOW, "recovery": {"recipe": "bf16"}}
TRUNK = {"backend": "fp8_emulated", "recovery": {"format": "bf16"}}
INST = Instrument(
    trunk_steps=8, points=(3, 5), horizon=3, evals=(1, 3), eval_batches=1, late_at="schedule"
)
PLAN = OutlierPlan(offset=0, rise=2, hold=2, growth=2.0**10)


def fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An independent tensorwise FP8 cast, dequantized: ``fp8(t * s) / s`` with
    ``s = max(dtype) / amax(t)`` (taken in float64, then fp32), saturating."""
    big = torch.finfo(dtype).max
    s = (big / t.detach().abs().amax().double()).float()
    return (t.float() * s).clamp(-big, big).to(dtype).float() / s


# -- B(u) on the trained weight's gradient ---------------------------------------------------------


def _bound(f: float, columns: bool, recovered: bool = False) -> tuple[float, float]:
    """``B(u)`` of :func:`~tests.backends.test_gradient_columns.scaled_step` under torchao's
    casts, and the bound computed here from :func:`fp8` on the trained weight's gradient."""
    backend = get_backend("torchao_fp8", low_cost=LOW, recovery={"recipe": "bf16"})
    got, x, d, dy = scaled_step(backend, f, columns, recovered)
    xd, c = x * d, d.reciprocal() if columns else torch.ones(64)
    ref = dy.norm() * ((xd - fp8(xd, torch.float8_e4m3fn)) * c).norm()
    ref += (fp8(dy, torch.float8_e5m2) - dy).norm() * (xd * c).norm()
    return got, float(ref)


def test_the_bound_is_taken_on_the_trained_weights_gradient():
    for f, columns in ((1.0, False), (2.0**6, True), (2.0**6, False), (2.0**20, True)):
        got, ref = _bound(f, columns)
        assert got == pytest.approx(ref, rel=1e-5)
    base = _bound(1.0, columns=False)[0]
    assert _bound(1.0, columns=True)[0] == base  # D = 1: nothing moves
    told, untold = _bound(2.0**6, columns=True)[0], _bound(2.0**6, columns=False)[0]
    assert abs(told / base - 1) < 0.1 < untold / base - 1  # the scale alone does not count
    assert _bound(2.0**20, columns=True)[0] > 5 * base  # past e4m3's range: real damage counts


def test_a_recovered_unit_is_scored_in_shadow_on_the_same_gradient():
    assert _bound(2.0**20, True, recovered=True)[0] == pytest.approx(_bound(2.0**20, True)[0])


# -- the linears in BF16, the outlier inside torchao's GEMM -------------------------------------


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.proj = nn.Linear(64, 48)


def _forward(path: str, factor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, dW)`` of ``One`` through the harness's forwards (BF16 GEMMs, the outlier on channel 5
    at step 1 when ``factor``) on ``path``."""
    model = One()
    backend = get_backend("torchao_fp8", low_cost=LOW, recovery={"recipe": "bf16"})
    outliers = [Outlier("proj", 5, start=1, rise=1, hold=0, growth=factor)] if factor else []
    install_forwards(backend, model, outliers, lambda: 1, gemm_dtype="bf16")
    backend.wrap({0: model.proj})
    backend.apply([0] if path == "recovery" else [], 1)
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    with backend.step_context():
        y = model.proj(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
    assert y.dtype == torch.float32 and model.proj.weight.grad is not None
    return y.detach(), model.proj.weight.grad


def test_bf16_gemms_are_a_bf16_linear_and_keep_the_outlier_exact():
    y, dw = _forward("recovery", None)
    ref = One().to(torch.bfloat16)
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    y_ref = ref.proj(x.bfloat16())
    y_ref.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).bfloat16())
    assert torch.equal(y, y_ref.float())
    assert torch.equal(dw, ref.proj.weight.grad.float())
    y_f, dw_f = _forward("recovery", 2.0**20)  # x 2^20 on the input, / 2^20 on the weight
    assert torch.equal(y_f, y) and torch.equal(dw_f, dw)


def test_the_low_cost_path_is_float8linear_of_a_bf16_model_and_the_outlier_hurts_it():
    y, dw = _forward("low_cost", None)
    ref = One().to(torch.bfloat16)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(ref, config=replace(config, pad_inner_dim=True))
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    y_ref = ref.proj(x.bfloat16())
    y_ref.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).bfloat16())
    assert type(ref.proj).__name__ == "Float8Linear"
    assert torch.equal(y, y_ref.float()) and torch.equal(dw, ref.proj.weight.grad.float())
    y_f, _ = _forward("low_cost", 2.0**20)
    # e4m3 spans about 2^18: the scale comes from the outlier and every other input underflows
    assert (y_f - y).norm() > 0.5 * y.norm()


# -- the regime and its branches ---------------------------------------------------------------


def test_the_regime_is_outlier_fp8_tensors_fault_on_the_same_trunks():
    from benchmarks.sweep.branch_arms import make_arms
    from benchmarks.sweep.regimes import FAULT_REGIMES, FP4_REGIMES, TRUNK_BF16

    ao, em = FAULT_REGIMES["outlier_torchao_tensorwise"], FAULT_REGIMES["outlier_fp8_tensor"]
    assert repr(ao.setup) == repr(em.setup) and ao.instrument == em.instrument
    assert ao.trunk == em.trunk and ao.trunk_backend == TRUNK_BF16
    for r in (em, *FP4_REGIMES.values()):  # the trunk the others build: the same BF16 path
        assert (r.backend, r.recovery) == (TRUNK_BF16["backend"], TRUNK_BF16["recovery"])
    arms = make_arms(ao, (4,), 28)
    assert all(a.backend == "torchao_fp8" and a.gemm_dtype == "bf16" for a, _ in arms)
    assert not any("autoswitch" in a.name for a, _ in arms)  # an fp8_emulated rule
    assert {"low-cost", "BF16", "GNMR+e 4", "random 4", "NVIDIA last-4"} <= {
        a.name for a, _ in arms
    }


@pytest.mark.slow
def test_branches_of_the_torchao_regime_from_a_bf16_trunk(tmp_path, one_thread):
    """The trunk's bits do not depend on the low-cost block it is built with (so every fault
    regime's trunk is the same); from it, torchao's BF16 arm trains the same with and without
    the outlier, the low-cost arm does not, and GNMR+e scores and recovers on the real casts."""
    setup, _ = tiny_trunk(tmp_path / "a", TRUNK, INST)
    other = {**TRUNK, "low_cost": {"format": "e4m3", "granularity": "tensor"}}
    tiny_trunk(tmp_path / "b", other, INST)
    a, b = (torch.load(trunk_file(tmp_path / r, 3, 5), weights_only=True) for r in "ab")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])

    def branch(arm: Arm, plan: OutlierPlan | None = PLAN) -> dict:
        s = replace(setup, outlier_plan=plan)
        return run_branch(s, arm, INST, 3, 3, tmp_path / "a", False)

    bf16 = Arm("BF16", "recovery", gemm_dtype="bf16", **AO)
    assert branch(bf16)["train_loss"] == branch(bf16, None)["train_loss"]
    low = Arm("low-cost", "static", gemm_dtype="bf16", **AO)
    faulted = branch(low)
    assert faulted["train_loss"] != branch(low, None)["train_loss"]
    assert faulted["outliers"][0]["growth"] == 2.0**10
    e = Arm("GNMR+e 1", "gnmr", max_active=1, controller={"gamma": 0.01}, gemm_dtype="bf16", **AO)
    got = branch(e)
    assert got["recovered_unit_steps"] > 0 and 0 < got["flops_recovered"] < 1


def test_the_cost_model_prices_torchaos_recipes():
    def of(low: str, rec: str = "bf16") -> Formats:
        return Formats("torchao_fp8", {"recipe": low, "pad_inner_dim": True}, {"recipe": rec})

    for hw in ("B200", "GB300", "Hopper"):  # FP8 at twice BF16's rate everywhere
        assert (price(of("tensorwise"), hw).low, price(of("tensorwise"), hw).recovery) == (0.5, 1)
        assert price(of("rowwise"), hw).low == 0.5
        assert price(of("rowwise_with_gw_hp"), hw).low == pytest.approx((0.5 + 0.5 + 1) / 3)
        assert price(of("tensorwise", "rowwise"), hw).recovery == 0.5
    assert "not priced" in str(price(of("mxfp8"), "B200").note)
