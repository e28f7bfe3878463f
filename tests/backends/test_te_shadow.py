"""te_fp8's damage term on CPU: the shadow route on Transformer Engine stand-ins.

The stand-in TE of ``te_stand_ins`` stands in for TE's module types and their state (``fp8_meta``
scales); the numbers are the project's own. Each test recomputes ``B(u)`` independently: it
captures every call's GEMM input and output gradient with hooks of its own, recomputes a
``LayerNormLinear``'s norm with torch, and sums ``wgrad_bound(quantize_wgrad_operands(...))``
(the plain-tensor API, itself checked against brute force in ``test_shadow``/``test_te_casts``),
then asserts the backend's sums equal it bit for bit: every recipe, Linear and LayerNormLinear
(LayerNorm; RMSNorm with zero-centred gamma), low-cost and recovered units, two micro-batches,
delayed scaling's scales read from the module when they are used.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gnmr_dist.backends import RECOVERY
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.shadow import ShadowRoute, quantize_wgrad_operands, wgrad_bound
from gnmr_dist.backends.te_fp8 import _SR_SEED, TEFp8Backend
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS
from tests.backends import te_stand_ins as stand_ins
from tests.backends import test_te_nvfp4 as fp4_stand_ins
from tests.backends.te_stand_ins import call
from tests.backends.test_te_nvfp4 import B200

fake_te, mcore, no_te = stand_ins.fake_te, stand_ins.mcore, stand_ins.no_te  # fixtures
device = fp4_stand_ins.device

CPU = torch.device("cpu")
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")


def ln_linear(te, n_in, n_out, seed, norm, zero_centred):
    """A stand-in ``LayerNormLinear``: TE's attribute names, its norm then its GEMM."""

    class LayerNormLinear(te.LayerNormLinear):
        def forward(self, x, is_first_microbatch=None):
            w = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
            if self.normalization == "RMSNorm":
                h = F.rms_norm(x.float(), (n_in,), w.float(), self.eps)
            else:
                b = self.layer_norm_bias.float()
                h = F.layer_norm(x.float(), (n_in,), w.float(), b, self.eps)
            return te.Linear.forward(self, h.to(x.dtype))

    layer = LayerNormLinear(n_in, n_out, seed=seed)
    layer.normalization, layer.eps, layer.zero_centered_gamma = norm, 1e-5, zero_centred
    g = torch.Generator().manual_seed(seed + 100)
    layer.layer_norm_weight = torch.nn.Parameter(torch.rand(n_in, generator=g) + 0.5)
    bias = torch.randn(n_in, generator=g) if norm == "LayerNorm" else None
    layer.layer_norm_bias = None if bias is None else torch.nn.Parameter(bias)
    return layer


def reference_norm(layer, x, fused):
    w = layer.layer_norm_weight.detach().float() + (1 if layer.zero_centered_gamma else 0)
    if layer.normalization == "RMSNorm":
        h = F.rms_norm(x.float(), (x.shape[-1],), w, 1e-5)
    else:
        h = F.layer_norm(x.float(), (x.shape[-1],), w, layer.layer_norm_bias.float(), 1e-5)
    return h if fused else h.to(x.dtype)


def make(rec, kind, recipe):
    if kind == "linear":
        layers = [rec.te.Linear(64, 64, seed=i) for i in range(2)]
    else:
        norm, zc = ("LayerNorm", False) if kind == "layernorm" else ("RMSNorm", True)
        layers = [ln_linear(rec.te, 64, 64, i, norm, zc) for i in range(2)]
    for i, layer in enumerate(layers):  # distinct delayed-scaling state per module
        layer.fp8_meta["scaling_fwd"].scale.copy_(torch.tensor([3.0 + i, 7.0, 7.0]))
        layer.fp8_meta["scaling_bwd"].scale.copy_(torch.tensor([2.0**12 + i, 5.0, 5.0]))
    return [layer.to(torch.bfloat16) for layer in layers]


def capture(layers, log):
    """Record every call's module input and output gradient, independently of the backend."""
    for uid, layer in enumerate(layers):

        def hook(module, args, out, uid=uid):
            entry = {"uid": uid, "x": args[0].detach().clone()}
            out = out[0] if isinstance(out, tuple) else out  # megatron's (out, bias)
            out.register_hook(lambda dy: entry.__setitem__("dy", dy.detach().clone()))
            log.append(entry)

        layer.register_forward_hook(hook)


@pytest.mark.parametrize("kind", ["linear", "layernorm", "rmsnorm zero-centred"])
@pytest.mark.parametrize(
    ("recipe", "reseed"), [(r, "reset") for r in RECIPES] + [("delayed", "keep")]
)
def test_te_fp8_sums_are_the_shadow_bound_of_each_call(fake_te, device, recipe, kind, reseed):
    rec = fake_te()
    device(B200)
    low = {"recipe": recipe} | ({"reseed": reseed, "margin": 1} if recipe == "delayed" else {})
    be = TEFp8Backend(low_cost=low)
    layers = make(rec, kind, recipe)
    be.wrap(dict(enumerate(layers)))
    be.track_errors(3)
    log: list[dict] = []
    capture(layers, log)
    g = torch.Generator().manual_seed(7)
    be.apply({1}, step=4)
    for micro in range(2):
        x = (torch.randn(2, 64, 64, generator=g) * (1 + 5 * micro)).bfloat16().requires_grad_()
        with be.autocast():
            y = layers[1](F.gelu(layers[0](x)))
        for layer in layers:  # TE updates the backward scales between forward and backward
            layer.fp8_meta["scaling_bwd"].scale[0] *= 2
        y.float().square().sum().backward()
    want = torch.zeros(3, dtype=torch.float64)
    calls: dict[int, int] = {}
    for entry in log:
        uid, layer = entry["uid"], layers[entry["uid"]]
        n = calls[uid] = calls.get(uid, -1) + 1
        x = (
            entry["x"]
            if kind == "linear"
            else reference_norm(layer, entry["x"], recipe == "delayed")
        )
        kwargs = {}
        if recipe == "delayed" and (uid == 0 or reseed == "keep"):  # the module's own scales
            kwargs = {
                "x_scale": layer.fp8_meta["scaling_fwd"].scale[0],
                "dy_scale": layer.fp8_meta["scaling_bwd"].scale[0] / 2 ** (1 - n),
            }
        ops = quantize_wgrad_operands(
            x, entry["dy"], be.shadow_recipe, seed=sr_seed(_SR_SEED, 4, uid, 0, n), **kwargs
        )
        want[uid] += wgrad_bound(ops)
    got = be.error_sums(CPU)
    assert (got[:2] > 0).all() and got[2] == 0
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert be.report().ran == {0: {"low_cost"}, 1: {RECOVERY}}


def test_a_recovered_delayed_unit_is_scored_at_its_return_scale(fake_te):
    """reset: the scale of its own amax with the margin; keep: its frozen scale."""
    rec = fake_te()
    scores = {}
    for reseed in ("reset", "keep"):
        be = TEFp8Backend(low_cost={"recipe": "delayed", "reseed": reseed})
        (layer,) = make(rec, "linear", "delayed")[:1]
        layer.fp8_meta["scaling_fwd"].scale.fill_(1e-3)  # a stale, far too small scale
        be.wrap({0: layer})
        be.track_errors(1)
        be.apply({0}, step=1)
        with be.autocast():
            layer(torch.randn(8, 64).bfloat16()).float().sum().backward()
        scores[reseed] = float(be.error_sums(CPU)[0])
    assert scores["keep"] > 10 * scores["reset"] > 0  # the frozen scale flushes x to zero


def test_error_every_measures_only_on_its_steps(fake_te, monkeypatch):
    rec = fake_te()
    be = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    layers = make(rec, "linear", "tensorwise")
    be.wrap(dict(enumerate(layers)))
    be.track_errors(2, every=2)
    measured = []
    original = ShadowRoute.measure
    monkeypatch.setattr(
        ShadowRoute, "measure", lambda self, *a, **k: measured.append(1) or original(self, *a, **k)
    )
    for step in (1, 2, 3):
        be.apply(set(), step)
        with be.autocast():
            layers[1](layers[0](torch.randn(4, 64).bfloat16())).float().sum().backward()
        sums = be.error_sums(CPU)
        assert (sums > 0).all() if step == 2 else (sums == 0).all()
        assert len(measured) == (2 if step >= 2 else 0)


def test_megatron_te_linears_are_scored_through_their_own_switch(mcore):
    rec, _, make_layer = mcore()
    layers = [
        make_layer("TEColumnParallelLinear", seed=0),
        make_layer("TERowParallelLinear", seed=1),
    ]
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap(dict(enumerate(layers)))
    be.track_errors(2)
    assert be.switched_units == {0, 1}
    log: list[dict] = []
    capture(layers, log)
    be.apply({0}, step=1)
    recipe = rec.recipe.Float8CurrentScaling(fp8_format=rec.recipe.Format.HYBRID)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with stand_ins.megatron_fp8(rec, recipe):
        call(layers[1], F.gelu(call(layers[0], x))).square().sum().backward()
    want = torch.zeros(2, dtype=torch.float64)
    for entry in log:
        ops = quantize_wgrad_operands(entry["x"], entry["dy"], be.shadow_recipe)
        want[entry["uid"]] += wgrad_bound(ops)
    assert torch.equal(be.error_sums(CPU), want) and (want > 0).all()


# ------------------------------------------------------------------ what is refused, and how


def test_gamma_is_accepted_with_te_fp8_when_the_block_is_read(no_te):
    block = GNMRBlock.from_dict({"backend": "te_fp8", "gamma": 0.5, "error_every": 10})
    assert block.policy.gamma is not None and block.error_every == 10


@pytest.mark.parametrize(
    ("module", "match"),
    [
        ("LayerNormMLP", r"two GEMMs whose operands .* stay inside the module"),
        ("GroupedLinear", r"grouped quantizers and offsets"),
        ("sequence_parallel", r"runs sequence parallel, so TE all-gathers the sequence shard"),
    ],
)
def test_modules_the_route_cannot_score_are_refused_by_name(fake_te, module, match):
    rec = fake_te()
    layer = getattr(rec.te, module, rec.te.Linear)(8, 8)
    layer.sequence_parallel = module == "sequence_parallel"
    be = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    be.wrap({0: rec.te.Linear(8, 8), 3: layer}, names={3: "decoder.layers.1.mlp"})
    with pytest.raises(ValueError, match=rf"gnmr\.gamma: decoder\.layers\.1\.mlp .*{match}"):
        be.track_errors(4)
    be.track_errors(None)  # without gamma nothing is refused
    assert be.shadow_recipe is None


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"nvfp4_4over6": "all"}, r"NVFP4BlockScaling\(nvfp4_4over6='all'\)"),
        ({"row_scaled_activation": True}, r"NVFP4BlockScaling\(row_scaled_activation=True\)"),
    ],
)
def test_nvfp4_settings_the_route_does_not_reproduce_are_refused(fake_te, device, attrs, match):
    rec = fake_te()
    device(B200)
    be = TEFp8Backend(low_cost={"recipe": "nvfp4"})
    for key, value in attrs.items():
        setattr(be.low_cost_recipe, key, value)
    be.wrap({0: rec.te.Linear(16, 16)})
    with pytest.raises(ValueError, match=match):
        be.track_errors(1)


def test_different_qparams_for_input_and_gradient_are_refused(fake_te):
    fake_te()
    be = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    be.low_cost_recipe.fp8_quant_fwd_inp = SimpleNamespace(power_2_scale=True, amax_epsilon=0.0)
    be.low_cost_recipe.fp8_quant_bwd_grad = SimpleNamespace(power_2_scale=False, amax_epsilon=0.0)
    with pytest.raises(
        ValueError, match=r"quantizes the input with \(True, 0\.0\) and the gradient"
    ):
        be.track_errors(1)
    be.low_cost_recipe.fp8_quant_bwd_grad.power_2_scale = True
    be.track_errors(1)
    assert be.shadow_recipe.pow2 and be.shadow_recipe.grad_format == "e5m2"


def test_te_fp8_measures_at_its_recipes_interval_unless_the_block_says(no_te):
    def every(**block):
        return GNMRBlock.from_dict({"backend": "te_fp8", **block}).error_every

    assert every(gamma=0.5) == 50  # delayed, per tensor
    for recipe, n in [("current", 50), ("block", 100), ("mxfp8", 100), ("nvfp4", 200)]:
        assert every(gamma=0.5, low_cost={"recipe": recipe}) == n, recipe
    assert every(gamma=0.5, error_every=1) == 1
    assert every() == 1  # no gamma: nothing to pace
    assert GNMRBlock.from_dict({"backend": "fp8_emulated", "gamma": 0.5}).error_every == 1
