"""The int8 (W8A8) backend: quantization bounds, exact integer GEMM, autograd, LoRA training."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import get_backend
from gnmr_dist.backends.int8 import (
    INT32_SAFE_K,
    QMAX,
    Int8Backend,
    Int8LowCost,
    Int8Recovery,
    W8A8LinearFn,
    _emulated_gemm,
    dequantize,
    int8_gemm,
    int_mm_is_exact_on_cpu,
    quantize_symmetric,
)
from tests.integrations.deepspeed.common import llama
from tests.requires import require

# fp32 division t / s rounds with relative error 2^-24, so |t/s - q| <= 1/2 + 127 * 2^-24.
BOUND_SLACK = 1 + 2 * QMAX * 2.0**-24


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - approx).pow(2).sum().item())


def exact_error(t: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|t - q * scale| in float64 (exact for fp32 operands)."""
    return (t.double() - q.double() * scale.double()).abs()


def int8_reference(x, w_q, w_scale, bias, granularity="token"):
    """The W8A8 forward from an int64 GEMM: independent of ``int8_gemm``."""
    x_q, x_scale = quantize_symmetric(x.reshape(-1, x.shape[-1]), granularity)
    acc = x_q.long() @ w_q.long().t()
    y = acc.float() * (x_scale * w_scale.t()) + bias
    return y.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------------------- quantization


def test_weight_rowwise_round_trip_within_half_scale():
    torch.manual_seed(0)
    w = torch.randn(256, 512) * torch.logspace(-3, 1, 256).unsqueeze(1)  # rows 4 decades apart
    q, s = quantize_symmetric(w, "row")
    assert q.dtype == torch.int8 and s.shape == (256, 1)
    assert q.abs().max() == QMAX and torch.equal(q.abs().amax(dim=1), torch.full((256,), QMAX))
    assert (exact_error(w, q, s) <= s.double() / 2 * BOUND_SLACK).all()
    db = sqnr_db(w, dequantize(q, s))
    w_tensor = dequantize(*quantize_symmetric(w, "tensor"))
    db_small = sqnr_db(w[:64], dequantize(q, s)[:64])
    db_small_tensor = sqnr_db(w[:64], w_tensor[:64])
    print(
        f"weight SQNR: row-wise {db:.1f} dB (smallest quarter of rows {db_small:.1f} dB), "
        f"tensor-wise {sqnr_db(w, w_tensor):.1f} dB ({db_small_tensor:.1f} dB)"
    )
    # uniform rounding noise s^2/12 with s ~ 3.2 sigma / 127 for 512 Gaussians: ~42 dB, every row
    assert db >= 40.0 and db_small >= 40.0
    assert db_small_tensor <= 1.0  # one scale for all rows rounds the small rows to zero


def test_activation_per_token_round_trip_and_outlier_tokens():
    torch.manual_seed(1)
    x = torch.randn(4, 32, 128)
    x[:, ::8] *= 100.0  # outlier tokens
    x2 = x.reshape(-1, 128)
    q, s = quantize_symmetric(x2, "token")
    assert s.shape == (128, 1)
    assert (exact_error(x2, q, s) <= s.double() / 2 * BOUND_SLACK).all()
    db_token = sqnr_db(x2, dequantize(q, s))
    q_t, s_t = quantize_symmetric(x2, "tensor")
    assert (
        s_t.shape == (1, 1) and (exact_error(x2, q_t, s_t) <= s_t.double() / 2 * BOUND_SLACK).all()
    )
    normal = torch.ones(128, dtype=torch.bool)
    normal[::8] = False
    db_normal_tensor = sqnr_db(x2[normal], dequantize(q_t, s_t)[normal])
    print(
        f"activation SQNR: per-token {db_token:.1f} dB, ordinary tokens per-tensor "
        f"{db_normal_tensor:.1f} dB"
    )
    assert db_token >= 40.0
    assert db_normal_tensor <= 10.0  # one outlier token flattens every other token's grid


def test_zero_rows_and_bf16_input():
    x = torch.zeros(3, 8)
    x[1] = torch.linspace(-1, 1, 8)
    q, s = quantize_symmetric(x.bfloat16(), "token")
    assert s.dtype == torch.float32 and s[0, 0] == 1.0 and s[2, 0] == 1.0
    assert torch.equal(q[0], torch.zeros(8, dtype=torch.int8))
    assert torch.equal(q[1], torch.round(x[1] * QMAX).to(torch.int8))


# ---------------------------------------------------------------------------- integer GEMM


@pytest.mark.isa  # without VNNI, oneDNN's int8 GEMM saturates: the emulation must take over
def test_the_cpu_check_tells_whether_int_mm_is_exact_here():
    torch.manual_seed(8)
    a = torch.randint(-QMAX, QMAX + 1, (64, 256), dtype=torch.int8)
    b = torch.randint(-QMAX, QMAX + 1, (64, 256), dtype=torch.int8)
    exact_here = torch.equal(torch._int_mm(a, b.t()).long(), a.long() @ b.long().t())
    assert int_mm_is_exact_on_cpu() == exact_here


@pytest.mark.isa
def test_int8_gemm_is_exact_against_int64():
    torch.manual_seed(2)
    for m, k, n in [(37, 64, 48), (5, 3, 7), (64, 256, 128)]:
        a = torch.randint(-QMAX, QMAX + 1, (m, k), dtype=torch.int8)
        b = torch.randint(-QMAX, QMAX + 1, (n, k), dtype=torch.int8)
        a[0], b[0] = QMAX, -QMAX  # extreme row: |sum| = k * 127^2
        acc = int8_gemm(a, b)
        assert acc.dtype == torch.int32
        ref = a.long() @ b.long().t()
        assert torch.equal(acc.long(), ref)
        assert torch.equal(_emulated_gemm(a, b), acc)  # the fallback where _int_mm does not fit
        sa, sb = torch.rand(m, 1), torch.rand(n, 1)
        assert torch.equal(acc.float() * (sa * sb.t()), ref.float() * (sa * sb.t()))


def test_emulated_gemm_beyond_int32_range_is_exact():
    k = INT32_SAFE_K + 7  # k * 127^2 > 2^31 - 1: int32 accumulation would overflow
    a = torch.full((2, k), QMAX, dtype=torch.int8)
    b = torch.full((3, k), -QMAX, dtype=torch.int8)
    acc = int8_gemm(a, b)
    assert acc.dtype == torch.int64
    assert torch.equal(acc, torch.full((2, 3), -k * QMAX * QMAX, dtype=torch.int64))


def test_forward_matches_int64_reference_bit_for_bit():
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 9, 64), torch.randn(48, 64), torch.randn(48)
    w_q, w_s = quantize_symmetric(w, "row")
    quant = lambda t: quantize_symmetric(t, "token")  # noqa: E731
    y = W8A8LinearFn.apply(x, w, b, w_q, w_s, quant, int8_gemm)
    assert torch.equal(y, int8_reference(x, w_q, w_s, b))
    rel = ((y - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()).item()
    print(f"W8A8 linear relative error vs fp32: {rel:.2e}")
    assert 0 < rel < 2e-2


# ---------------------------------------------------------------------------- autograd


def _identity_quant(t):
    return t, torch.ones(t.shape[0], 1, dtype=t.dtype)


def _float_gemm(a, b):
    return a @ b.t()


def test_function_calculus_passes_gradcheck_with_identity_quantization():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ones = torch.ones(4, 1, dtype=torch.float64)

    def fn(x, w, b):
        return W8A8LinearFn.apply(x, w, b, w.detach(), ones, _identity_quant, _float_gemm)

    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_int8_gradients_equal_dequantize_then_autograd_reference():
    torch.manual_seed(5)
    x = torch.randn(2, 7, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    w_q, w_s = quantize_symmetric(w.detach(), "row")
    quant = lambda t: quantize_symmetric(t, "token")  # noqa: E731
    dy = torch.randn(2, 7, 24)
    W8A8LinearFn.apply(x, w, b, w_q, w_s, quant, int8_gemm).backward(dy)

    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b_ref = b.detach().clone().requires_grad_()
    # dx through the weight the forward used; dW and db through the unquantized input
    y_ref = F.linear(x_ref, dequantize(w_q, w_s)) + F.linear(x.detach(), w_ref, b_ref)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(w.grad, w_ref.grad)
    assert torch.equal(b.grad, b_ref.grad)


def test_frozen_weight_gets_no_gradient_and_saves_no_input():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16)
    w_q, w_s = quantize_symmetric(w, "row")
    y = W8A8LinearFn.apply(
        x, w, None, w_q, w_s, lambda t: quantize_symmetric(t, "token"), int8_gemm
    )
    assert y.grad_fn.saved_tensors[2] is None  # x is not kept when W is frozen
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 8) @ dequantize(w_q, w_s))


# ---------------------------------------------------------------------------- backend on nn.Linear


@pytest.mark.isa  # bf16 GEMMs: figures from the CPU's oneDNN kernels
def test_backend_paths_and_weight_cache_invalidation():
    torch.manual_seed(6)
    lin = nn.Linear(32, 16)
    x = torch.randn(5, 32)
    backend = get_backend("int8")
    assert isinstance(backend, Int8Backend) and backend.units == frozenset()
    backend.wrap({0: lin})
    backend.apply([], step=0)
    w_q, w_s = quantize_symmetric(lin.weight.detach(), "row")
    assert torch.equal(lin(x), int8_reference(x, w_q, w_s, lin.bias))
    backend.apply([0], step=1)
    ref = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    assert torch.equal(lin(x), ref) and backend.report().recovered == {0}

    backend.apply([], step=2)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # bumps the version counter: re-quantized
    w_q, w_s = quantize_symmetric(lin.weight.detach(), "row")
    assert torch.equal(lin(x), int8_reference(x, w_q, w_s, lin.bias))
    lin.weight.data.mul_(0.5)  # invisible to the version counter, by PyTorch's design
    stale = lin(x)
    backend.invalidate()
    w_q, w_s = quantize_symmetric(lin.weight.detach(), "row")
    fresh = lin(x)
    assert torch.equal(fresh, int8_reference(x, w_q, w_s, lin.bias))
    assert not torch.equal(stale, fresh)
    lin.weight = nn.Parameter(torch.randn(16, 32))  # a new tensor: re-quantized
    w_q, w_s = quantize_symmetric(lin.weight.detach(), "row")
    assert torch.equal(lin(x), int8_reference(x, w_q, w_s, lin.bias))
    backend.unwrap()
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.isa  # bf16 GEMMs: figures from the CPU's oneDNN kernels
def test_bf16_module_runs_int8_and_returns_bf16():
    torch.manual_seed(7)
    lin = nn.Linear(64, 32, bias=False).bfloat16()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    backend = get_backend("int8", low_cost={"weight_granularity": "tensor"})
    backend.wrap({0: lin})
    y = lin(x)
    w_q, w_s = quantize_symmetric(lin.weight, "tensor")
    assert w_s.shape == (1, 1) and y.dtype == torch.bfloat16
    assert torch.equal(y, int8_reference(x, w_q, w_s, 0.0).bfloat16())


# ---------------------------------------------------------------------------- LoRA on Llama

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_llama():
    require("transformers")
    peft = require("peft")
    model = llama(seed=8, vocab=128, hidden=64, positions=2048)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=PROJECTIONS))


def _registry(model, backend):
    from gnmr_dist.distributed import UnitRegistry

    return UnitRegistry.from_model(model, eligible_fn=backend.is_eligible)


def test_registry_finds_one_unit_per_lora_projection(lora_llama):
    backend = get_backend("int8")
    reg = _registry(lora_llama, backend)
    expected = tuple(
        f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
        for i in range(2)
        for p in PROJECTIONS
    )
    assert reg.names == expected and bool(reg.eligible.all())
    lora = reg.local_modules[0]
    assert backend.targets(lora) == [lora.base_layer]
    assert reg.param_names[reg.param_slots.tolist().index(0)].endswith("q_proj.base_layer.weight")
    assert backend.supports(lora) and backend.supports(nn.Linear(2, 2))
    assert not backend.supports(nn.Conv1d(2, 2, 1))


@pytest.mark.isa  # bf16 GEMMs: figures from the CPU's oneDNN kernels
def test_lora_training_int8_base_bf16_recovery(lora_llama):
    model = copy.deepcopy(lora_llama)
    backend = get_backend("int8")
    reg = _registry(model, backend)
    backend.wrap(reg.local_modules)
    wrapped = [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert len(wrapped) == 14 and all(n.endswith("_proj.base_layer") for n in wrapped)

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(9))
    plan = {1, 9}
    losses = []
    for step in range(8):
        backend.apply(plan, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None for _, p in trainable)
        assert all(p.grad.abs().sum() > 0 for n, p in trainable if "lora_B" in n)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        report = backend.report()
        assert report.step == step and report.planned == plan
        assert report.recovered == plan and report.low_cost == set(range(14)) - plan
    print("int8 LoRA losses:", [f"{v:.4f}" for v in losses])
    assert losses[-1] < losses[0] - 0.1
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_fp32_recovery_is_the_unwrapped_module_and_int8_error_is_bounded(lora_llama):
    model = copy.deepcopy(lora_llama)
    with torch.no_grad():  # non-zero adapters, so the LoRA branch is part of every output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    backend = get_backend("int8", recovery={"dtype": "fp32"})
    reg = _registry(model, backend)
    backend.wrap(reg.local_modules)
    unit = reg.index["model.layers.1.mlp.up_proj"]
    module = reg.local_modules[unit]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(10))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        backend.apply([unit], step=0)
        y_recovery = module(x)
        backend.apply([], step=1)
        y_int8 = module(x)
        logits_int8 = model(input_ids=ids).logits
        backend.apply(range(14), step=2)
        logits_fp32_path = model(input_ids=ids).logits
        assert backend.report().recovered == set(range(14))
        backend.unwrap()
        y_plain, logits_plain = module(x), model(input_ids=ids).logits
    assert torch.equal(y_recovery, y_plain)
    assert torch.equal(logits_fp32_path, logits_plain)
    assert not torch.equal(y_int8, y_plain)
    rel = ((logits_int8 - logits_plain).norm() / logits_plain.norm()).item()
    print(f"int8 vs fp32 logits relative error: {rel:.2e}")
    assert 0 < rel < 2e-2


# ---------------------------------------------------------------------------- options


def test_options_defaults_and_validation():
    backend = get_backend("int8")
    assert backend.low_cost == Int8LowCost("row", "token")
    assert backend.recovery == Int8Recovery("bf16")
    with pytest.raises(ValueError, match=r"weight_granularty; did you mean 'weight_granularity'"):
        get_backend("int8", low_cost={"weight_granularty": "row"})
    with pytest.raises(
        ValueError,
        match=r"low_cost\.act_granularity must be one of \['token', 'tensor'\], got 'channel'",
    ):
        Int8Backend(low_cost={"act_granularity": "channel"})
    with pytest.raises(ValueError, match=r"weight_granularity must be one of \['row', 'tensor'\]"):
        Int8Backend(low_cost={"weight_granularity": "token"})
    with pytest.raises(
        ValueError, match=r"gnmr\.recovery\.dtype must be one of \['bf16', 'fp32'\], got 'fp16'"
    ):
        Int8Backend(recovery={"dtype": "fp16"})
    with pytest.raises(ValueError, match=r"gnmr\.recovery\.dtype must be one of .* got 16"):
        Int8Backend(recovery={"dtype": 16})
    with pytest.raises(ValueError, match=r"unknown key gnmr\.recovery\.bits"):
        Int8Backend(recovery={"bits": 16})


def test_lora_detection_by_duck_typing_without_peft(monkeypatch):
    class FakeLora(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = nn.Linear(4, 4)
            self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 1)})

    monkeypatch.setitem(sys.modules, "peft.tuners.lora", None)
    backend = Int8Backend()
    fake = FakeLora()
    assert backend.supports(fake) and backend.targets(fake) == [fake.base_layer]
