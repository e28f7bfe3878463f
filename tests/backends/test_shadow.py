"""The shadow error route (``gnmr_dist/backends/shadow.py``) against ``fp8_emulated``'s own sums.

``fp8_emulated`` measures ``B(u)`` inside its wgrad GEMM's backward. The shadow route measures
from outside, from each call's input and output gradient. Given ``fp8_emulated``'s quantization
(:class:`SpecRecipe`) the two must agree bit for bit, for every format and layout the backend
has, on a plain module and on a ``LayerNormLinear``-shaped one (where the route recomputes the
normalised input from the module's own norm parameters, as it does for TE's modules), low-cost
and recovered, over micro-batches and steps. The plain-tensor API (what a GPU check calls) is
checked against a float64 bound written out here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import LOW_COST, get_backend
from gnmr_dist.backends.error_sums import ErrorSums
from gnmr_dist.backends.numerics import te_casts
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.shadow import (
    ShadowRecipe,
    ShadowRoute,
    SpecRecipe,
    quantize_wgrad_operands,
    wgrad_bound,
)
from gnmr_dist.backends.te_shadow import gemm_input

CPU = torch.device("cpu")

SPECS = {
    "e4m3 1x128 blocks": {},
    "e4m3/e5m2 tensor": {"grad_format": "e5m2", "granularity": "tensor"},
    "e4m3/e5m2 row": {"grad_format": "e5m2", "granularity": "row"},
    "e4m3 delayed": {"granularity": "tensor", "scaling": "delayed", "margin": 1},
    "nvfp4 (RHT, SR)": {"format": "e2m1"},
    "mxfp4": {"format": "e2m1", "granularity": "mxfp4"},
    "fp6 tensor": {"format": "e2m3", "grad_format": "e3m2", "granularity": "tensor"},
    "bf16 dy": {"grad_format": "bf16"},
}
"""``fp8_emulated`` low-cost blocks: every format and layout it has that a TE recipe uses (per
tensor current and delayed, 1 x 128 tiles, rows, NVFP4 with the Hadamard transform and
stochastic rounding), the FP4/FP6 ones beside them, and a path that keeps ``dy``."""


class LNLinear(nn.Module):
    """A ``LayerNormLinear``'s shape and attribute names: norm then linear; the emulated backend
    wraps ``linear``, the route sees the outer module and recomputes the norm."""

    def __init__(self, n_in: int, n_out: int, normalization: str, zero_centered: bool) -> None:
        super().__init__()
        self.normalization, self.eps, self.zero_centered_gamma = normalization, 1e-5, zero_centered
        g = torch.Generator().manual_seed(n_in)
        self.layer_norm_weight = nn.Parameter(torch.rand(n_in, generator=g) + 0.5)
        bias = torch.randn(n_in, generator=g) if normalization == "LayerNorm" else None
        self.layer_norm_bias = None if bias is None else nn.Parameter(bias)
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x):
        w = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            h = F.rms_norm(x, (x.shape[-1],), w, self.eps)
        else:
            h = F.layer_norm(x, (x.shape[-1],), w, self.layer_norm_bias, self.eps)
        return self.linear(h)


def model_of(kind: str) -> tuple[nn.Module, list[nn.Module], list[nn.Module]]:
    """(model, the modules the route sees, the linears the backend wraps), units 0 and 1."""
    torch.manual_seed(0)
    if kind == "plain":
        model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))
        return model, [model[0], model[2]], [model[0], model[2]]
    norm = "RMSNorm" if kind == "rmsnorm zero-centred" else "LayerNorm"
    first, second = LNLinear(64, 48, norm, "zero" in kind), LNLinear(48, 32, norm, False)
    return nn.Sequential(first, nn.GELU(), second), [first, second], [first.linear, second.linear]


def attach(backend, route, sink, seen: list[nn.Module]) -> None:
    """The route on ``seen[u]``'s forward, seeded as the backend seeds unit ``u``'s call."""
    spec, calls = backend.specs[LOW_COST], {}

    def hook_for(uid):
        def hook(module, args, out):
            n = calls.get((backend._step, uid), 0)
            calls[(backend._step, uid)] = n + 1
            scales = backend.delayed_scales(backend._wrapped[uid][0], LOW_COST)
            x_scale = dy_scale = None  # None: the tensor's own amax (an empty history's)
            if scales is not None and uid not in backend._recover and scales.x.filled:
                x_scale, dy_scale = scales.x.scale(), scales.dy.scale
            seed = sr_seed(sr_seed(spec.seed, backend._step, uid, 0, n, 0), 1)
            x = gemm_input(module, args[0], fused_cast=False)
            route.measure(sink, uid, x, out, x_scale=x_scale, dy_scale=dy_scale, seed=seed)

        return hook

    for uid, module in enumerate(seen):
        module.register_forward_hook(hook_for(uid))


@pytest.mark.parametrize("kind", ["plain", "layernorm", "rmsnorm zero-centred"])
@pytest.mark.parametrize("key", sorted(SPECS))
def test_shadow_route_equals_fp8_emulated_bit_for_bit(key, kind):
    model, seen, linears = model_of(kind)
    backend = get_backend("fp8_emulated", low_cost=SPECS[key])
    backend.wrap(dict(enumerate(linears)))
    backend.track_errors(2)
    route, sink = ShadowRoute(SpecRecipe(backend.specs[LOW_COST])), ErrorSums(2)
    attach(backend, route, sink, seen)
    g = torch.Generator().manual_seed(1)
    for step, plan in enumerate([set(), {0}, {1}, set()], start=1):
        backend.apply(plan, step)
        sink.reset()
        for micro in range(2):  # micro-batches, of different scales
            x = (torch.randn(3, 16, 64, generator=g) * (1 + 3 * micro)).requires_grad_()
            model(x).square().sum().backward()
        ours, theirs = sink.total(CPU), backend.error_sums(CPU)
        assert (theirs > 0).all(), (step, theirs)
        assert torch.equal(ours, theirs), (step, plan, ours.tolist(), theirs.tolist())


# ------------------------------------------------------------------ the plain-tensor API


def f64_bound(x, qx, dy, qdy) -> float:
    x, qx, dy, qdy = (t.double() for t in (x, qx, dy, qdy))
    return float(dy.norm() * (x - qx).norm() + (qdy - dy).norm() * x.norm())


@pytest.mark.parametrize("name", ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_quantize_wgrad_operands_is_the_recipes_columnwise_cast(name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, 96, generator=g).bfloat16()
    x[..., 5] *= 50
    dy = (torch.randn(4, 32, 80, generator=g) * 1e-3).bfloat16()
    recipe = ShadowRecipe.of(name)
    scales = {}
    if name == "delayed":
        scales = {"x_scale": torch.tensor(3.0), "dy_scale": torch.tensor(2.0**20)}
    ops = quantize_wgrad_operands(x, dy, recipe, seed=5, **scales)
    x2, dy2 = x.reshape(-1, 96), dy.reshape(-1, 80)
    if name in ("delayed", "tensorwise"):
        sx = scales.get("x_scale", te_casts.scale_from_amax(x2.float().abs().amax(), 448.0))
        want_x = te_casts.cast_tensor(x2, "e4m3", sx).dequantized
        assert torch.equal(ops.x, x2.float()) and torch.equal(ops.qx, want_x)
    elif name == "blockwise":  # TE's columnwise x^T in 1 x 128 tiles: 128 tokens per scale
        want = te_casts.cast_blocks(x2.t(), "e4m3", (1, 128), pow2=True)
        assert torch.equal(ops.qx, want.dequantized.t())
        assert torch.equal(ops.x_cast.scale_inv, want.scale_inv.t())
        assert torch.equal(ops.x_cast.codes.view(torch.uint8), want.codes.t().view(torch.uint8))
    elif name == "mxfp8":
        want = te_casts.cast_mxfp8(x2.t(), "e4m3")
        assert torch.equal(ops.qx, want.dequantized.t())
        assert torch.equal(ops.x_cast.scale_inv, want.scale_inv.t())  # [tokens / 32, K]
        assert ops.dy_cast.codes.dtype == torch.float8_e5m2  # HYBRID: e5m2 gradients
    else:  # nvfp4: both rotated along the tokens; dy rounded stochastically with the seed
        rotated = te_casts.te_rht(dy2.t())  # TE's layout: runs of 16 tokens along the last dim
        assert torch.equal(ops.dy, rotated.t().float())
        nearest = te_casts.cast_nvfp4(rotated)
        sr = te_casts.cast_nvfp4(rotated.t(), rounding="stochastic", seed=5, columnwise=True)
        assert torch.equal(ops.qdy, sr.dequantized)
        assert not torch.equal(ops.qdy, nearest.dequantized.t())
        x_rot = te_casts.te_rht(x2.t())
        assert torch.equal(ops.qx, te_casts.cast_nvfp4(x_rot).dequantized.t())
    bound = wgrad_bound(ops)
    assert bound.dtype == torch.float64 and bound.dim() == 0
    assert float(bound) == pytest.approx(f64_bound(ops.x, ops.qx, ops.dy, ops.qdy), rel=1e-5)


def test_delayed_without_a_scale_uses_the_tensors_amax_and_the_margin():
    x = torch.linspace(-3, 7, 64).reshape(8, 8)
    recipe = ShadowRecipe.of("delayed", margin=2)
    ops = quantize_wgrad_operands(x, x, recipe)
    scale = torch.tensor(448.0 / 4) / torch.tensor(7.0)  # TE's update: (max / 2^margin) / amax
    assert torch.equal(ops.qx, te_casts.cast_tensor(x, "e4m3", scale).dequantized)
    assert ops.dy_cast.codes.dtype == torch.float8_e5m2


def test_shared_input_is_quantized_once_per_version():
    route = ShadowRoute(ShadowRecipe.of("tensorwise"))
    calls = []
    quantize = route.recipe.quantize_x
    route.recipe = type("Counting", (), {})()  # a recipe that counts its x quantizations
    route.recipe.shares_x, route.recipe.rounds = True, (True, True)
    route.recipe.quantize_x = lambda *a: calls.append(1) or quantize(*a)
    route.recipe.quantize_dy = ShadowRecipe.of("tensorwise").quantize_dy
    sink, x = ErrorSums(3), torch.randn(4, 8)
    lins = [nn.Linear(8, 4) for _ in range(3)]
    for uid, lin in enumerate(lins):  # q, k, v of one input
        route.measure(sink, uid, x, lin(x))
    assert len(calls) == 1
    x.mul_(2)  # a new version of the same tensor
    route.measure(sink, 0, x, lins[0](x))
    assert len(calls) == 2
