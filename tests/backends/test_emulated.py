"""The emulated FP8 linear (three quantized GEMMs) and the ``fp8_emulated`` backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnmr_dist.backends import RECOVERY, get_backend
from gnmr_dist.backends.emulated import EmulatedBackend
from gnmr_dist.backends.emulated_linear import emulated_linear
from gnmr_dist.backends.emulated_options import EmulatedOptions, LinearQuantSpec
from gnmr_dist.backends.numerics.formats import FORMATS
from gnmr_dist.backends.numerics.rounding import round_to_format
from gnmr_dist.backends.numerics.scaled import quantize_dequantize, sqnr_db


def spec(fmt="e4m3", grad=None, granularity="block", block=128):
    return LinearQuantSpec(FORMATS[fmt], FORMATS[grad or fmt], granularity, block)


def reference_linear(x, w, b, dy, s: LinearQuantSpec):
    """The three GEMMs written out with explicitly dequantized inputs (module docstring)."""
    act, wt = (1, s.block), (s.block, s.block)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])

    def q(t, fmt, tile, dim):
        return quantize_dequantize(t, fmt, s.granularity, block=tile, dim=dim)

    y = q(x2, s.x_format, act, -1) @ q(w, s.x_format, wt, -1).t() + b
    dx = q(dy2, s.grad_format, act, -1) @ q(w, s.x_format, wt, 0)
    dw = q(dy2, s.grad_format, act, 0).t() @ q(x2, s.x_format, act, 0)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, dy2.sum(dim=0)


def run_linear(x, w, b, dy, s):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = emulated_linear(x, w, b, s)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


# ---------------------------------------------------------------------- the autograd function


def test_identity_spec_passes_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    s = spec("fp32", granularity="block")
    assert torch.autograd.gradcheck(lambda *a: emulated_linear(*a, s), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: emulated_linear(x, w, None, s), (x, w))
    assert emulated_linear(x, w, b, s).dtype == torch.float64


@pytest.mark.parametrize(
    "fmt, grad, granularity",
    [
        ("e4m3", "e4m3", "block"),
        ("e4m3", "e5m2", "block"),
        ("e4m3", "e5m2", "tensor"),
        ("e4m3", "e4m3", "row"),
        ("e2m3", "e3m2", "row"),
        ("e3m2", "e3m2", "block"),
        ("bf16", "bf16", "none"),
    ],
)
def test_forward_and_grads_equal_explicit_dequantized_gemms(fmt, grad, granularity):
    """Ragged everywhere: K=300, N=200, M=3*70 are not multiples of the 128 tiles."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 70, 300, generator=gen)
    w = torch.randn(200, 300, generator=gen) / 17
    b = torch.randn(200, generator=gen)
    dy = torch.randn(3, 70, 200, generator=gen) * 1e-3
    s = spec(fmt, grad, granularity)
    got = run_linear(x, w, b, dy, s)
    want = reference_linear(x, w, b, dy, s)
    for name, g, r in zip(("y", "dx", "dW", "db"), got, want, strict=True):
        assert g.shape == r.shape and torch.equal(g, r), name
    # and it did quantize: plain fp32 differs, within the format's SQNR
    plain = run_linear(x, w, b, dy, spec("fp32"))
    for name, g, p in zip(("y", "dx", "dW"), got, plain, strict=False):
        assert not torch.equal(g, p), name
        floor = {"e4m3": 22, "e2m3": 18, "e3m2": 14, "bf16": 40}[fmt]
        assert sqnr_db(p, g) > floor, (name, sqnr_db(p, g))


def test_fp8_e4m3_block_sqnr_of_outputs_and_grads():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(256, 512, generator=gen), torch.randn(384, 512, generator=gen) / 22
    b, dy = torch.zeros(384), torch.randn(256, 384, generator=gen)
    got = run_linear(x, w, b, dy, spec())
    plain = run_linear(x, w, b, dy, spec("fp32"))
    s = [sqnr_db(p, g) for p, g in zip(plain[:3], got[:3], strict=True)]
    print(f"\ne4m3 block linear SQNR: y {s[0]:.1f} dB, dx {s[1]:.1f} dB, dW {s[2]:.1f} dB")
    # two M=3 inputs per product: ~31.5 dB each -> ~28.5 dB, minus a little for the sums
    assert all(v > 26.0 for v in s), s
    assert torch.equal(got[3], plain[3])  # db is not quantized


def test_mixed_dtypes_keep_input_and_param_dtypes():
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    layer = nn.Linear(128, 64)
    y = emulated_linear(x, layer.weight, layer.bias, spec())
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


# ------------------------------------------------------------------------------ the backend


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 192), nn.ReLU(), nn.Linear(192, 64))


def fwd_bwd(model, x):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def test_recovery_fp32_unit_is_the_plain_module_and_low_cost_is_fp8():
    backend = get_backend("fp8_emulated", low_cost={"format": "e4m3"}, recovery={"format": "fp32"})
    assert isinstance(backend, EmulatedBackend)
    model, ref = make_model(), make_model()
    backend.wrap({0: model[0], 1: model[2]})
    backend.apply(active={1}, step=1)
    h = torch.randn(8, 16, 192)
    y1, dh1, g1 = fwd_bwd(model[2], h)
    y1_ref, dh1_ref, g1_ref = fwd_bwd(ref[2], h)
    assert torch.equal(y1, y1_ref) and torch.equal(dh1, dh1_ref)
    assert all(torch.equal(a, b) for a, b in zip(g1, g1_ref, strict=True))

    x = torch.randn(8, 16, 256)
    y0, dx0, g0 = fwd_bwd(model[0], x)
    y0_ref, dx0_ref, g0_ref = fwd_bwd(ref[0], x)
    assert not torch.equal(y0, y0_ref) and not torch.equal(g0[0], g0_ref[0])
    for got, want in ((y0, y0_ref), (dx0, dx0_ref), (g0[0], g0_ref[0])):
        assert 26.0 < sqnr_db(want, got) < 40.0
    report = backend.report()
    assert report.step == 1 and report.planned == {1}
    assert report.recovered == {1} and report.low_cost == {0}


def test_all_units_on_fp32_recovery_equal_the_unwrapped_model():
    backend = EmulatedBackend(recovery={"format": "fp32"})
    model, ref = make_model(), make_model()
    backend.wrap({0: model[0], 1: model[2]})
    backend.apply(active={0, 1}, step=3)
    x = torch.randn(32, 256)
    y, dx, grads = fwd_bwd(model, x)
    y_ref, dx_ref, grads_ref = fwd_bwd(ref, x)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
    assert backend.report().ran == {0: {RECOVERY}, 1: {RECOVERY}}


def test_default_recovery_is_bf16_gemm_inputs_with_fp32_accumulation():
    backend = EmulatedBackend()
    layer = nn.Linear(256, 64)
    backend.wrap({0: layer})
    backend.apply(active={0}, step=1)
    x = torch.randn(16, 256)
    want = round_to_format(x, "bf16") @ round_to_format(layer.weight, "bf16").t() + layer.bias
    assert torch.equal(layer(x), want)


def test_backward_uses_the_path_of_its_forward():
    """A plan change between forward and backward does not change the gradients."""
    backend = EmulatedBackend(recovery={"format": "fp32"})
    model = make_model()
    backend.wrap({0: model[0], 1: model[2]})
    x = torch.randn(32, 256)
    backend.apply(active=set(), step=1)
    _, _, want = fwd_bwd(model, x)
    y = model(x)
    backend.apply(active={0, 1}, step=2)  # switched before backward
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want, strict=True))


def test_options_defaults_and_resolution():
    backend = EmulatedBackend()
    assert backend.low_cost == EmulatedOptions()
    low, rec = backend.specs["low_cost"], backend.specs["recovery"]
    assert (low.x_format.name, low.grad_format.name, low.granularity, low.block) == (
        "e4m3",
        "e4m3",
        "block",
        128,
    )
    assert (rec.x_format.name, rec.grad_format.name, rec.granularity) == ("bf16", "bf16", "none")
    hybrid = EmulatedBackend(low_cost={"grad_format": "e5m2", "granularity": "row"})
    assert hybrid.specs["low_cost"].grad_format.name == "e5m2"
    assert hybrid.specs["low_cost"].granularity == "row"
    assert EmulatedBackend(recovery={"format": "fp32"}).specs["recovery"].is_identity


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"low_cost": {"formt": "e4m3"}},
            r"unknown key gnmr\.low_cost\.formt; did you mean 'format'",
        ),
        (
            {"recovery": {"granularty": "row"}},
            r"gnmr\.recovery\.granularty; did you mean 'granularity'",
        ),
        (
            {"low_cost": {"format": "e4m2"}},
            r"gnmr\.low_cost\.format must be one of \['bf16', 'e2m1', 'e2m3', 'e3m2', 'e4m3', "
            r"'e5m2', 'fp16', 'fp32'\], got 'e4m2'",
        ),
        ({"recovery": {"grad_format": "fp8"}}, r"gnmr\.recovery\.grad_format must be one of \["),
        (
            {"low_cost": {"granularity": "channel"}},
            r"gnmr\.low_cost\.granularity must be one of \['tensor', 'row', 'block', 'none', "
            r"'nvfp4', 'mxfp4'\]",
        ),
        ({"low_cost": {"block": 0}}, r"gnmr\.low_cost\.block must be an integer >= 1, got 0"),
        ({"low_cost": {"block": True}}, r"gnmr\.low_cost\.block must be an integer >= 1"),
    ],
)
def test_option_errors_name_the_field_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_backend("fp8_emulated", **kwargs)
