"""``torchao_fp8``: torchao's real FP8 GEMMs (``torch._scaled_mm`` on this CPU), switched per step.

Against independent references built with torchao's and torch's own public entry points:
the low-cost path is bit for bit a ``Float8Linear`` that ``convert_to_float8_training`` made
(each recipe), the ``"bf16"`` recovery path bit for bit the plain BF16 ``nn.Linear``, a stronger
recovery recipe that recipe's ``Float8Linear``; under ``gnmr.gemms`` each GEMM bit for bit what
the path the subset gives it computes; ``B(u)`` equals the bound computed from the operands
torchao's wgrad GEMM received (captured as they reach ``aten.mm``). Then what is refused, by name.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gnmr_dist.backends import get_backend
from gnmr_dist.backends.gemms import GEMMS

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_training_tensor import Float8TrainingTensor

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SUBSETS = [list(s) for k in (1, 2) for s in itertools.combinations(GEMMS, k)]
IN, OUT, MICRO = 64, 48, 2


def _rand(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def linear(bias=True, dtype=torch.bfloat16):
    lin = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(_rand(OUT, IN, seed=1, dtype=dtype) / 8)
        if bias:
            lin.bias.copy_(_rand(OUT, seed=2, dtype=dtype))
    return lin


def run(module, dtype=torch.bfloat16, scale=1.0):
    """MICRO forward/backward passes: ``[(y, dx, dW, db), ...]`` (dW, db of that pass)."""
    out = []
    for m in range(MICRO):
        x = (scale * _rand(2, 16, IN, seed=10 + m, dtype=dtype)).requires_grad_()
        y = module(x)
        y.backward(_rand(2, 16, OUT, seed=20 + m, dtype=dtype))
        db = None if module.bias is None else module.bias.grad.clone()
        out.append((y.detach(), x.grad, module.weight.grad.clone(), db))
        module.zero_grad(set_to_none=True)
    return out


def wrapped(plan, *, low=None, rec=None, gemms=None, bias=True, dtype=torch.bfloat16):
    lin = linear(bias, dtype)
    backend = get_backend("torchao_fp8", low_cost=low, recovery=rec, gemms=gemms)
    backend.wrap({0: lin})
    backend.apply(plan, step=1)
    return lin, backend


def float8(recipe, bias=True, dtype=torch.bfloat16):
    """The independent reference: torchao's own module swap."""
    model = nn.Sequential(linear(bias, dtype))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(model[0]).__name__ == "Float8Linear"
    return model[0]


def same(a, b):
    return all(
        (u is None and v is None) or torch.equal(u, v)
        for s, t in zip(a, b, strict=True)
        for u, v in zip(s, t, strict=True)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_low_cost_path_is_float8linear_bit_for_bit(recipe, dtype):
    lin, backend = wrapped((), low={"recipe": recipe}, dtype=dtype)
    got, want = run(lin, dtype), run(float8(recipe, dtype=dtype), dtype)
    assert same(got, want)
    assert backend.report().low_cost == {0} and not backend.report().recovered
    assert not same(got, run(linear(dtype=dtype), dtype))  # FP8 changed every result


@pytest.mark.parametrize("low", ["tensorwise", "rowwise"])
def test_the_bf16_recovery_path_is_the_plain_bf16_linear_bit_for_bit(low):
    lin, backend = wrapped({0}, low={"recipe": low})
    assert same(run(lin), run(linear()))
    assert backend.report().recovered == {0}


@pytest.mark.parametrize("low, rec", [("tensorwise", "rowwise"), ("rowwise", "rowwise_with_gw_hp")])
def test_a_stronger_recovery_recipe_is_its_float8linear_bit_for_bit(low, rec):
    lin, _ = wrapped({0}, low={"recipe": low}, rec={"recipe": rec})
    assert same(run(lin), run(float8(rec)))


def test_switching_moves_no_parameter_and_unwrap_restores_the_module():
    lin, backend = wrapped(())
    params = [id(p) for p in lin.parameters()]
    for step, plan in enumerate([(), (0,), ()], start=2):
        backend.apply(plan, step)
        run(lin)
    assert [id(p) for p in lin.parameters()] == params and type(lin) is nn.Linear
    backend.unwrap()
    assert "forward" not in vars(lin) and same(run(lin), run(linear()))


# ---------------------------------------------------------------------- gnmr.gemms


@pytest.mark.parametrize(
    "low, rec", [("tensorwise", "bf16"), ("rowwise", "bf16"), ("rowwise", "rowwise_with_gw_hp")]
)
def test_each_gemm_of_a_subset_runs_bitwise_on_its_path(low, rec):
    """Bias-free (the projections of a Llama): y, dx and dW of each GEMM are bit for bit those
    of the run with every unit recovered (GEMM in the subset) or none (outside it)."""
    blocks = {"low": {"recipe": low}, "rec": {"recipe": rec}, "bias": False}
    all_low = run(wrapped((), **blocks)[0])
    all_rec = run(wrapped({0}, **blocks)[0])
    for gemms in SUBSETS:
        mixed = run(wrapped({0}, gemms=gemms, **blocks)[0])
        for m, got in enumerate(mixed):
            for i, gemm in enumerate(GEMMS):
                want = (all_rec if gemm in gemms else all_low)[m][i]
                assert torch.equal(got[i], want), (gemms, m, gemm)


def test_a_recovered_fprop_with_a_bias_adds_it_after_the_product():
    """torchao's high-precision fprop is ``mm(x, W^T) + b``, BF16 ``nn.Linear`` one ``addmm``:
    with a bias the recovered fprop differs from the BF16 path by the rounding of that sum
    (at most one BF16 ulp of y); the backward GEMMs stay bit for bit."""
    mixed = run(wrapped({0}, gemms=["fprop"])[0])
    low, rec = run(wrapped(())[0]), run(wrapped({0})[0])
    for got, r, lo in zip(mixed, rec, low, strict=True):
        ulp = torch.finfo(torch.bfloat16).eps * r[0].float().abs().clamp(min=1)
        assert bool(((got[0].float() - r[0].float()).abs() <= ulp).all())
        assert torch.equal(got[1], lo[1]) and torch.equal(got[2], lo[2])
        assert torch.equal(got[3], r[3])


@pytest.mark.parametrize(
    "rec, gemms, message",
    [
        ("rowwise", ["fprop"], r"rounds every scale of a linear one way"),
        ("rowwise_with_gw_hp", ["dgrad"], r"round_scales_to_power_of_2"),
    ],
)
def test_a_subset_torchao_cannot_configure_is_refused_by_name(rec, gemms, message):
    with pytest.raises(ValueError, match=r"gnmr\.gemms \[.*\]: the 'torchao_fp8' backend "):
        get_backend("torchao_fp8", recovery={"recipe": rec}, gemms=gemms)
    with pytest.raises(ValueError, match=message):
        get_backend("torchao_fp8", recovery={"recipe": rec}, gemms=gemms)


# ---------------------------------------------------------------------- the damage term


class WgradOperands(TorchDispatchMode):
    """Records the FP8 operands of every ``aten.mm`` on two torchao tensors whose roles are
    (grad_output, input): the wgrad GEMM's, dequantized in fp32."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a, b = (*args, None, None)[:2]
        fp8 = all(isinstance(t, Float8TrainingTensor) for t in (a, b))
        roles = fp8 and (a._gemm_input_role.value, b._gemm_input_role.value)
        if func is torch.ops.aten.mm.default and roles == ("grad_output", "input"):
            deq = [t._data.float() / t._scale for t in (a, b)]
            self.seen.append((deq[0].t(), deq[1]))  # Q(dy) [M, N], Q(x) [M, K]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_b_is_the_bound_of_the_operands_torchaos_wgrad_gemm_multiplied(recipe):
    lin, backend = wrapped((), low={"recipe": recipe}, dtype=torch.float32)
    backend.track_errors(1)
    backend.apply((), step=1)
    x = _rand(2, 16, IN, seed=3, dtype=torch.float32).requires_grad_()
    dy = _rand(2, 16, OUT, seed=4, dtype=torch.float32)
    with WgradOperands() as mode:
        lin(x).backward(dy)
    ((qdy, qx),) = mode.seen
    x2, dy2 = x.detach().reshape(-1, IN).double(), dy.reshape(-1, OUT).double()
    want = dy2.norm() * (x2 - qx.double()).norm() + (qdy.double() - dy2).norm() * x2.norm()
    got = backend.error_sums(torch.device("cpu"))
    assert float(got[0]) == pytest.approx(float(want), rel=1e-6)
    backend.apply((0,), step=2)  # recovered: the same bound, in shadow
    lin(x).backward(dy)
    assert float(backend.error_sums(torch.device("cpu"))[0]) == pytest.approx(float(want), rel=1e-6)


def test_b_is_the_same_for_every_subset_and_zero_when_wgrad_is_high_precision():
    def score(plan, gemms=None, low="rowwise"):
        lin, backend = wrapped(plan, low={"recipe": low}, gemms=gemms, bias=False)
        backend.track_errors(1)
        backend.apply(plan, step=1)
        run(lin)
        return float(backend.error_sums(torch.device("cpu"))[0])

    want = score(())
    assert want > 0
    for gemms in SUBSETS:
        assert score({0}, gemms) == pytest.approx(want, rel=1e-12), gemms
    assert score((), low="rowwise_with_gw_hp") == 0.0  # torchao keeps wgrad in high precision


def test_projections_sharing_an_input_cast_it_once(monkeypatch):
    q, k = linear(), linear()
    backend = get_backend("torchao_fp8")
    backend.wrap({0: q, 1: k})
    backend.track_errors(2)
    backend.apply((1,), step=1)
    x = _rand(4, IN, seed=5).requires_grad_()
    calls = []
    real = backend._ao.wgrad_cast
    monkeypatch.setattr(backend._ao, "wgrad_cast", lambda t, *a: calls.append(a[-1]) or real(t, *a))
    (q(x).float().sum() + k(x).float().sum()).backward()
    assert sorted(calls) == ["grad_output", "grad_output", "input"]
    assert bool((backend.error_sums(torch.device("cpu")) > 0).all())


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "blocks, error, message",
    [
        (
            {"low_cost": {"recipe": "mxfp8"}},
            RuntimeError,
            r"'mxfp8' runs on torchao's MX kernels"
            r".*compute capability 10\.0\+.*this host has no CUDA device",
        ),
        ({"low_cost": {"recipe": "nvfp4"}}, RuntimeError, r"'nvfp4'.*fp8_emulated"),
        (
            {"low_cost": {"recipe": "rowwise"}, "recovery": {"recipe": "rowwise"}},
            ValueError,
            r"gnmr\.recovery\.recipe: 'rowwise' is not more faithful than the low-cost recipe "
            r"'rowwise'.*allowed: 'rowwise_with_gw_hp', 'bf16'",
        ),
        (
            {"low_cost": {"recipe": "rowwise", "fsdp_float8_all_gather": True}},
            ValueError,
            r"fsdp_float8_all_gather: torchao all-gathers FP8 weights with tensorwise scales only",
        ),
        (
            {"low_cost": {"recipe": "tenserwise"}},
            ValueError,
            r"recipe must be one of .*got 'tenserwise'; did you mean 'tensorwise'\?",
        ),
        (
            {"low_cost": {"fsdp_float8_all_gather": True}, "gemms": ["wgrad"]},
            ValueError,
            r"the 'torchao_fp8' backend cannot .*Drop gnmr\.low_cost\.fsdp_float8_all_gather",
        ),
    ],
)
def test_what_cannot_run_is_refused_when_built(blocks, error, message):
    with pytest.raises(error, match=message):
        get_backend("torchao_fp8", **blocks)


def test_shapes_torchao_cannot_run_and_converted_modules_are_refused_at_wrap():
    backend = get_backend("torchao_fp8")
    with pytest.raises(
        ValueError,
        match=r"unit 3 \(Linear\) has in_features=40, out_features=48;"
        r" torch\._scaled_mm needs both to be multiples of 16 .*\"pad_inner_dim\": true",
    ):
        backend.wrap({3: nn.Linear(40, 48)})
    get_backend("torchao_fp8", low_cost={"pad_inner_dim": True}).wrap({3: nn.Linear(40, 48)})
    block = nn.Sequential(nn.Linear(64, 64))
    convert_to_float8_training(block)
    with pytest.raises(ValueError, match=r"unit 0\.0 \(Float8Linear\) is already a torchao "):
        backend.wrap({0: block})


def test_without_torchao_the_backend_registers_and_is_refused_with_the_fix():
    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "from gnmr_dist.backends import BACKENDS, get_backend\n"
        "assert 'torchao_fp8' in BACKENDS\n"
        "try:\n    get_backend('torchao_fp8')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "the 'torchao_fp8' backend needs torchao >= 0.18" in out.stdout
    assert "pip install torchao==0.18.0" in out.stdout
