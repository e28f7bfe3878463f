"""``fp8_emulated`` with FP4 low-cost paths: NVIDIA's NVFP4 recipe and MXFP4.

The GEMMs are checked against a composition of the numerics (fprop, dgrad, wgrad with the
Hadamard transform and stochastic rounding), the stochastic rounding for the properties the
recipe relies on (unbiased weight gradients; the same bits on two ranks holding the same
values, whatever else drew from torch's generator, and after a resume), and the error score
``B(u)`` for its bound on both paths (the shadow of a recovered unit draws what the low-cost
path would have drawn).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnmr_dist.backends import get_backend
from gnmr_dist.backends.emulated_linear import EmulatedCall, emulated_linear
from gnmr_dist.backends.emulated_options import LinearQuantSpec
from gnmr_dist.backends.numerics.formats import NVFP4_WEIGHT_BLOCK
from gnmr_dist.backends.numerics.hadamard import hadamard_rotate
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize
from tests import multiproc

NVFP4 = {"format": "e2m1"}
MXFP4 = {"format": "e2m1", "granularity": "mxfp4"}


def nvfp4_spec(**options) -> LinearQuantSpec:
    backend = get_backend("fp8_emulated", low_cost={**NVFP4, **options})
    return backend.specs["low_cost"]


def test_nvfp4_defaults_are_nvidias_recipe_and_mxfp4_the_plain_one():
    s = nvfp4_spec()
    assert (s.granularity, s.block, s.weight_2d, s.stochastic, s.hadamard) == (
        "nvfp4",
        16,
        True,
        True,
        True,
    )
    assert s.x_format.name == s.grad_format.name == "e2m1" and s.weight_transposable
    m = get_backend("fp8_emulated", low_cost=MXFP4).specs["low_cost"]
    assert (m.granularity, m.block, m.weight_2d, m.stochastic, m.hadamard) == (
        "mxfp4",
        32,
        False,
        False,
        False,
    )
    assert not m.weight_transposable
    off = nvfp4_spec(stochastic_rounding=False, hadamard=False, weight_2d=False)
    assert (off.stochastic, off.hadamard, off.weight_2d) == (False, False, False)


@pytest.mark.parametrize(
    "low_cost, message",
    [
        ({"format": "e4m3", "granularity": "nvfp4"}, r"format 'e4m3' cannot use granularity"),
        ({"format": "e2m1", "grad_format": "e5m2"}, r"grad_format 'e5m2' cannot use"),
        ({"format": "e2m1", "block": 32}, r"granularity 'nvfp4' has blocks of 16, got block 32"),
        ({"format": "e4m3", "weight_2d": True}, r"weight_2d applies to granularity 'nvfp4'"),
        ({"format": "bf16", "stochastic_rounding": True}, r"stochastic_rounding needs a narrow"),
        ({"format": "e2m1", "hadamard": 1}, r"hadamard must be true, false or null, got 1"),
        ({"format": "e2m1", "seed": "x"}, r"seed must be an integer, got 'x'"),
        (
            {"format": "e4m3", "granularity": "tensor", "scaling": "delayed", "hadamard": True},
            r"hadamard applies to current scaling",
        ),
    ],
)
def test_fp4_option_errors_name_the_field(low_cost, message):
    with pytest.raises(ValueError, match=message):
        get_backend("fp8_emulated", low_cost=low_cost)


def test_bf16_gradients_beside_fp4_forward_are_a_plain_cast():
    s = get_backend(
        "fp8_emulated",
        low_cost={"format": "e2m1", "grad_format": "bf16", "stochastic_rounding": False},
    ).specs["low_cost"]
    dy = torch.randn(32, 48)
    assert torch.equal(s.act(dy, s.grad_format, dim=0), dy.bfloat16().float())


def reference_gemms(x, w, dy, spec, seed):
    """NVIDIA's three NVFP4 GEMMs composed from the numerics (what emulated_linear must equal)."""
    xq = quantize_dequantize(x, "e2m1", "nvfp4", dim=-1)
    wq = quantize_dequantize(w, "e2m1", "nvfp4", block=NVFP4_WEIGHT_BLOCK, dim=-1)
    y = xq @ wq.t()
    call = EmulatedCall(spec, seed=seed)
    dyq = quantize_dequantize(
        dy, "e2m1", "nvfp4", dim=-1, rounding="stochastic", seed=call.seed_of(0)
    )
    dx = dyq @ wq
    dyr, xr = hadamard_rotate(dy, 0), hadamard_rotate(x, 0)
    dyq_m = quantize_dequantize(
        dyr, "e2m1", "nvfp4", dim=0, rounding="stochastic", seed=call.seed_of(1)
    )
    dw = dyq_m.t() @ quantize_dequantize(xr, "e2m1", "nvfp4", dim=0)
    return y, dx, dw


def test_nvfp4_linear_runs_nvidias_three_gemms():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen, requires_grad=True)  # 40 tokens: a ragged RHT block
    w = torch.randn(48, 64, generator=gen, requires_grad=True)
    dy = torch.randn(40, 48, generator=gen)
    spec = nvfp4_spec()
    y = EmulatedCall(spec, seed=123)(x, w, None)
    y.backward(dy)
    ry, rdx, rdw = reference_gemms(x.detach(), w.detach(), dy, spec, 123)
    assert torch.equal(y, ry) and torch.equal(x.grad, rdx)
    assert torch.allclose(w.grad, rdw, rtol=1e-5, atol=1e-5)  # same products, summed apart
    exact = dy.t() @ x.detach()
    assert 0.05 < (w.grad - exact).norm() / exact.norm() < 0.4


def test_stochastic_nvfp4_weight_gradients_are_unbiased():
    """Stochastic rounding of ``dy`` is unbiased: averaged over 200 seeds, the weight gradient
    approaches ``dy^T Q(x)`` (x is rounded to nearest, the same in every draw) with an error
    ~1/sqrt(200) of one draw's; rounding ``dy`` to nearest keeps its error."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(24, 32, generator=gen)
    dy = torch.randn(64, 24, generator=gen)
    target = dy.t() @ quantize_dequantize(x, "e2m1", "nvfp4", dim=0)

    def wgrad(spec, seed):
        wp = w.clone().requires_grad_(True)
        EmulatedCall(spec, seed=seed)(x, wp, None).backward(dy)
        return wp.grad

    def rel(g):
        return float((g - target).norm() / target.norm())

    sr = nvfp4_spec(hadamard=False)
    mean = sum(wgrad(sr, s) for s in range(200)) / 200
    one, nearest = (
        rel(wgrad(sr, 0)),
        rel(wgrad(nvfp4_spec(hadamard=False, stochastic_rounding=False), 0)),
    )
    assert rel(mean) < 0.15 * one and nearest > 0.5 * one, (rel(mean), one, nearest)


# ------------------------------------------------------------------ reproducible rounding


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))


def grads_at(backend, net, step, batch):
    backend.apply(set(), step)
    net.zero_grad()
    net(batch).square().mean().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_draws_depend_on_step_unit_and_seed_not_on_the_global_generator():
    net, batch = model(), torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    backend = get_backend("fp8_emulated", low_cost=NVFP4)
    backend.wrap({0: net[0], 1: net[2]})
    a = grads_at(backend, net, 5, batch)
    torch.rand(1000)  # a data loader drawing from torch's generator in between
    b = grads_at(backend, net, 5, batch)
    c = grads_at(backend, net, 6, batch)
    assert all(
        torch.equal(u.view(torch.int32), v.view(torch.int32)) for u, v in zip(a, b, strict=True)
    )
    assert not torch.equal(a[0], c[0])
    # a fresh backend (a resumed run) at step 5 draws the same bits
    net2 = model()
    fresh = get_backend("fp8_emulated", low_cost=NVFP4)
    fresh.wrap({0: net2[0], 1: net2[2]})
    d = grads_at(fresh, net2, 5, batch)
    assert all(torch.equal(u, v) for u, v in zip(a, d, strict=True))
    # another seed option is another draw of the rounding noise
    net3 = model()
    other = get_backend("fp8_emulated", low_cost={**NVFP4, "seed": 1})
    other.wrap({0: net3[0], 1: net3[2]})
    assert not torch.equal(grads_at(other, net3, 5, batch)[0], a[0])


def test_probe_passes_do_not_shift_the_training_draws():
    net, batch = model(), torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    backend = get_backend("fp8_emulated", low_cost=NVFP4)
    backend.wrap({0: net[0], 1: net[2]})
    plain = grads_at(backend, net, 7, batch)
    backend.apply(set(), 7)
    with backend.measuring():
        net(batch).square().mean().backward()  # a probe pass before the step's own
    net.zero_grad()
    net(batch).square().mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), plain, strict=True))


def _rank_grads(rank: int, world: int) -> list[bytes]:
    """Both ranks hold the same values; rank 1's torch generator is drawn from first."""
    if rank == 1:
        torch.rand(12345)
    net, batch = model(), torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    backend = get_backend("fp8_emulated", low_cost=NVFP4)
    backend.wrap({0: net[0], 1: net[2]})
    return [g.numpy().tobytes() for g in grads_at(backend, net, 11, batch)]


@pytest.mark.slow
def test_two_ranks_holding_the_same_values_draw_the_same_bits():
    a, b = multiproc.run(_rank_grads, 2)
    assert a == b


# ------------------------------------------------------------------------- error score


def test_error_score_bounds_the_fp4_wgrad_error_and_the_shadow_matches():
    """``B(u)`` of a low-cost NVFP4 unit is ``||dy|| ||Hx - Q(Hx)|| + ||Q(Hdy) - Hdy|| ||x||``
    (recomputed here from the numerics, with the seed the backend derives for the call) and
    bounds the weight gradient's error; a recovered unit's shadow, drawing the same bits,
    reports the same number."""
    gen = torch.Generator().manual_seed(5)
    x, dy = torch.randn(48, 64, generator=gen), torch.randn(48, 32, generator=gen)
    scores = {}
    for path in ("low_cost", "recovery"):
        layer = nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(6)))
        backend = get_backend("fp8_emulated", low_cost=NVFP4)
        backend.wrap({0: layer})
        backend.track_errors(1)
        backend.apply({0} if path == "recovery" else set(), 3)
        layer(x).backward(dy)
        scores[path] = float(backend.error_sums(torch.device("cpu"))[0])
        if path == "low_cost":
            assert (layer.weight.grad - dy.t() @ x).norm() <= scores[path] * (1 + 1e-5)
    xr, dyr = hadamard_rotate(x, 0), hadamard_rotate(dy, 0)
    call_seed = sr_seed(0, 3, 0, 0, 0, 0)  # option seed, step, unit, operator, call, measuring
    dyq = quantize_dequantize(
        dyr, "e2m1", "nvfp4", dim=0, rounding="stochastic", seed=sr_seed(call_seed, 1)
    )
    xq = quantize_dequantize(xr, "e2m1", "nvfp4", dim=0)
    want = dy.norm() * (xq - xr).norm() + (dyq - dyr).norm() * x.norm()
    assert scores["low_cost"] == pytest.approx(float(want), rel=1e-5)
    assert scores["recovery"] == pytest.approx(scores["low_cost"], rel=1e-6)


def test_emulated_linear_without_a_backend_rounds_with_seed_zero():
    spec = nvfp4_spec()
    x, w = torch.randn(16, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    emulated_linear(x, w, None, spec).sum().backward()
    g1 = w.grad.clone()
    w.grad = None
    EmulatedCall(spec, seed=0)(x, w, None).sum().backward()
    assert torch.equal(g1, w.grad) and EmulatedCall(spec, seed=0).seed_of(1) == sr_seed(0, 1)
