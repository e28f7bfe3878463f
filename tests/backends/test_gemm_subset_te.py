"""``gnmr.gemms`` under ``te_fp8``: the route each GEMM subset takes and its quantizer factory,
on CPU against stand-ins of Transformer Engine's classes; the routes themselves against a real
TE only under the ``gpu`` marker. The subsets of the other backends, the block and the
framework runs are in ``test_gemm_subset.py``."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gnmr_dist.backends.gemms import ALL_GEMMS, GEMMS
from gnmr_dist.backends.te_gemms import (
    CUSTOM,
    OVERRIDE,
    REGIONS,
    TEFeatures,
    choose_route,
    split_layouts,
    subset_qfactory,
)
from tests.backends.test_gemm_subset import SUBSETS

# ---------------------------------------------------------------------- te_fp8's routes (CPU)

ALL = TEFeatures(backward_override=True, hybrid=True, non_tn_fp8=True)
HOPPER = TEFeatures(backward_override=True, hybrid=True, non_tn_fp8=False)
TE_2_15 = TEFeatures(backward_override=True, hybrid=False, non_tn_fp8=False)


def test_te_route_per_subset():
    fs = frozenset
    assert choose_route("delayed", "bf16", ALL_GEMMS, TE_2_15) == REGIONS
    assert choose_route("tensorwise", "bf16", fs({"dgrad", "wgrad"}), TE_2_15) == OVERRIDE
    assert choose_route("nvfp4", "bf16", fs({"dgrad", "wgrad"}), ALL) == OVERRIDE
    assert choose_route("tensorwise", "mxfp8", fs({"dgrad", "wgrad"}), ALL) == CUSTOM
    for gemms in (fs(s) for s in SUBSETS if len(s) < 3 and s != ["dgrad", "wgrad"]):
        assert choose_route("blockwise", "bf16", gemms, HOPPER) == CUSTOM
        assert choose_route("tensorwise", "bf16", gemms, ALL) == CUSTOM
        with pytest.raises(ValueError, match=r"TE >= 2\.19\).*TE >= 2\.15 runs only"):
            choose_route("blockwise", "bf16", gemms, TE_2_15)
        with pytest.raises(ValueError, match=r"DelayedScaling takes no backward_override"):
            choose_route("delayed", "bf16", gemms, ALL)
    # Hopper: a per-tensor FP8 quantizer may not write a columnwise layout alone
    assert choose_route("tensorwise", "bf16", fs({"wgrad"}), HOPPER) == CUSTOM
    for gemms in (["fprop"], ["dgrad"], ["fprop", "dgrad"], ["fprop", "wgrad"]):
        with pytest.raises(ValueError, match=r"columnwise layout of \[.*issue #3158"):
            choose_route("tensorwise", "bf16", fs(gemms), HOPPER)


def test_te_subset_factory_gives_each_layout_its_gemms_path():
    """fprop = weight.row x input.row, dgrad = weight.col x grad_output.row, wgrad = input.col
    x grad_output.col: each layout gets the quantizer of its GEMM's path."""

    def make(path, role):
        return (path, getattr(role, "tensor_type", None))

    def hybrid(row, col):
        return ("hybrid", row, col)

    def role(tensor):
        return SimpleNamespace(tensor_type=tensor)

    q = subset_qfactory(frozenset({"fprop"}), make, hybrid)
    assert q(role("input")) == ("hybrid", ("recovery", "input"), ("low_cost", "input"))
    assert q(role("weight")) == ("hybrid", ("recovery", "weight"), ("low_cost", "weight"))
    assert q(role("grad_output")) == ("low_cost", "grad_output")
    assert q(role("output")) == ("recovery", "output") and q(None) == ("recovery", None)
    q = subset_qfactory(frozenset({"dgrad"}), make, hybrid)
    assert q(role("input")) == ("low_cost", "input")
    assert q(role("weight")) == ("hybrid", ("low_cost", "weight"), ("recovery", "weight"))
    want = ("hybrid", ("recovery", "grad_output"), ("low_cost", "grad_output"))
    assert q(role("grad_output")) == want
    assert q(role("grad_input")) == ("recovery", "grad_input")
    assert split_layouts({"wgrad"}) == {
        "input": ("low_cost", "recovery"),
        "grad_output": ("low_cost", "recovery"),
    }
    assert split_layouts(GEMMS) == {} and split_layouts(()) == {}


@pytest.fixture
def te_stand_in(monkeypatch):
    """te_stand_ins' stand-in TE, plus the pieces the subset routes look up: recipes with
    ``backward_override``, ``CustomRecipe``, ``RecipeState``, the hybrid and identity
    quantizers, and ``is_non_tn_fp8_gemm_supported`` (a Blackwell here)."""
    from tests.backends.te_stand_ins import build_fake_te

    def install(hybrid=True):
        modules, rec = build_fake_te()
        recipe = modules["transformer_engine.common.recipe"]
        for cls in ("Float8CurrentScaling", "Float8BlockScaling", "NVFP4BlockScaling"):
            getattr(recipe, cls).backward_override = None
        extra = {}
        if hybrid:
            recipe.CustomRecipe = type(
                "CustomRecipe", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)}
            )
            quantization = types.ModuleType("transformer_engine.pytorch.quantization")
            quantization.RecipeState = SimpleNamespace(
                create=lambda r, mode, num_quantizers, roles: SimpleNamespace(
                    make_quantizers=lambda: [(type(r).__name__, mode, roles[0].tensor_type)]
                )
            )
            hybrid_mod = types.ModuleType("transformer_engine.pytorch.tensor.hybrid_tensor")
            hybrid_mod.HybridQuantizer = lambda rowwise_quantizer, columnwise_quantizer: (
                "hybrid",
                rowwise_quantizer,
                columnwise_quantizer,
            )
            identity = types.ModuleType("transformer_engine.pytorch.tensor.identity_tensor")
            identity.IdentityQuantizer = lambda: "identity"
            utils = types.ModuleType("transformer_engine.pytorch.utils")
            utils.is_non_tn_fp8_gemm_supported = lambda: True
            extra = {
                m.__name__: m
                for m in (
                    quantization,
                    hybrid_mod,
                    identity,
                    utils,
                    types.ModuleType("transformer_engine.pytorch.tensor"),
                )
            }
        for name, module in {**modules, **extra}.items():
            monkeypatch.setitem(sys.modules, name, module)
        rec.te, rec.recipe = modules["transformer_engine.pytorch"], recipe
        return rec

    return install


def _recovered_forward(backend, rec):
    layer = rec.te.Linear(8, 8)
    backend.wrap({0: layer})
    backend.apply({0}, step=1)
    with backend.autocast():
        layer(torch.ones(2, 8))
    return layer.seen[-1]


def test_te_fp8_dgrad_wgrad_in_bf16_is_the_low_cost_recipe_with_backward_override(te_stand_in):
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    rec = te_stand_in(hybrid=False)
    backend = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    backend.set_gemms(["dgrad", "wgrad"])
    assert backend.route == OVERRIDE
    outer, inner = _recovered_forward(backend, rec)
    assert outer == (True, backend.low_cost_recipe, None)
    assert inner[0] is True and inner[1] is backend.subset_recipe
    assert type(inner[1]).__name__ == "Float8CurrentScaling"
    assert inner[1].kwargs == {
        **backend.low_cost_recipe.kwargs,
        "backward_override": "high_precision",
    }
    with pytest.raises(ValueError, match=r"TE >= 2\.19"):
        TEFp8Backend(low_cost={"recipe": "tensorwise"}).set_gemms(["fprop"])
    with pytest.raises(ValueError, match="DelayedScaling takes no backward_override"):
        TEFp8Backend(low_cost={"recipe": "delayed"}).set_gemms(["dgrad", "wgrad"])
    mlp = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    mlp.set_gemms(["dgrad", "wgrad"])
    with pytest.raises(ValueError, match=r"unit 0 holds a LayerNormMLP"):
        mlp.wrap({0: nn.Sequential(rec.te.LayerNormMLP(8, 8))})
    assert mlp.units == frozenset()


def test_te_fp8_other_subsets_run_a_custom_recipe_of_per_layout_quantizers(te_stand_in):
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    rec = te_stand_in()
    backend = TEFp8Backend(low_cost={"recipe": "blockwise"})
    backend.set_gemms(["fprop"])
    assert backend.route == CUSTOM
    _, inner = _recovered_forward(backend, rec)
    custom = inner[1]
    assert inner[0] is True and type(custom).__name__ == "CustomRecipe"
    q = custom.kwargs["qfactory"]
    low = ("Float8BlockScaling", "forward", "input")
    assert q(SimpleNamespace(tensor_type="input")) == ("hybrid", "identity", low)
    grad = ("Float8BlockScaling", "backward", "grad_output")
    assert q(SimpleNamespace(tensor_type="grad_output")) == grad
    stronger = TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": "mxfp8"})
    stronger.set_gemms(["dgrad", "wgrad"])
    q = stronger.subset_recipe.kwargs["qfactory"]
    assert stronger.route == CUSTOM
    assert q(SimpleNamespace(tensor_type="grad_output")) == (
        "MXFP8BlockScaling",
        "backward",
        "grad_output",
    )


# ---------------------------------------------------------------------- te_fp8 on a GPU

GPU_SIZE = 256


def _te_run(te, module, region, x, dy):
    """``(y, dx, dW)`` of one forward and backward of ``module`` inside ``region()``."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with region():
        y = module(xi)
    y.backward(dy)
    return y.detach(), xi.grad, module.weight.grad.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("gemms", SUBSETS, ids="+".join)
def test_te_fp8_subset_routes_against_plain_transformer_engine(gemms):
    """A blockwise low-cost ``te.Linear`` recovered with each subset: the recovered GEMMs give
    the BF16 module's results, the others plain TE blockwise FP8's, bit for bit (a subset the
    installed TE has no route for is skipped with the reason)."""
    import contextlib

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.gpu.te_guard import require_cuda_and_te

    te, te_recipe = require_cuda_and_te()
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    try:
        backend = TEFp8Backend(low_cost={"recipe": "blockwise"})
        backend.set_gemms(gemms)
    except (ImportError, RuntimeError, ValueError) as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    lin = te.Linear(GPU_SIZE, GPU_SIZE, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4 * GPU_SIZE, GPU_SIZE, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn_like(x)

    def fp8_region():
        recipe = te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.HYBRID)
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=recipe)
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe)

    fp8 = _te_run(te, lin, fp8_region, x, dy)
    bf16 = _te_run(te, lin, contextlib.nullcontext, x, dy)
    backend.wrap({0: lin})
    backend.apply({0}, step=1)
    got = _te_run(te, lin, backend.autocast, x, dy)
    backend.unwrap()
    for i, gemm in enumerate(GEMMS):
        want = (bf16 if gemm in gemms else fp8)[i]
        assert torch.equal(got[i], want), (gemms, gemm, backend.route)
    assert all(not torch.equal(a, b) for a, b in zip(fp8, bf16, strict=True))
