"""te_fp8 with megatron-core's TE linears on CPU: megatron's own source text executed over the
stand-in TE (:mod:`tests.backends.te_stand_ins`), recovered through its ``te_quant_params``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnmr_dist.backends import LOW_COST, RECOVERY
from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS
from tests.backends import te_stand_ins as stand_ins
from tests.backends.te_stand_ins import (
    LABEL,
    _is_reset,
    _staleify,
    call,
    mcore_config,
    megatron_fp8,
    quant_params,
)

fake_te, no_te, mcore = stand_ins.fake_te, stand_ins.no_te, stand_ins.mcore  # fixtures


def test_megatron_source_reads_te_quant_params_in_every_forward(mcore):
    from gnmr_dist.integrations.megatron.te import MEGATRON_TE_LINEARS, is_megatron_te_linear

    _, module, make = mcore()
    forwards = {"TELinear", "TELayerNormColumnParallelLinear", "TEGroupedLinear"}
    assert forwards <= module.LINEARS and set(MEGATRON_TE_LINEARS) <= module.LINEARS
    for name in forwards:  # every other class inherits one of these forwards...
        forward = inspect.getsource(getattr(module, name).forward)
        read = "_get_fp8_autocast_for_quant_params(self.te_quant_params, self.training)"
        assert read in forward and "with quant_context:" in forward, name
        init = inspect.getsource(getattr(module, name).__init__)
        for attr in (
            "self.te_quant_params: Optional[TEQuantizationParams] = None",
            "self.is_first_microbatch = True",
            "self.te_return_bias = ",
            "self.disable_parameter_transpose_cache = ",
        ):
            assert attr in init, (name, attr)
    for name in module.LINEARS:  # ...or calls it (0.19's LM head) and is detected by its MRO
        cls = getattr(module, name)
        assert any(c.__name__ in forwards for c in cls.__mro__), name
        assert is_megatron_te_linear(make(name)), name
    recipe = inspect.getsource(module._get_fp8_autocast_for_quant_recipe)
    assert "return fp8_autocast(enabled=False)" in recipe
    assert "if not qrecipe.override_quantized_autocast:" in recipe


def test_megatron_operator_recovers_through_its_own_te_quant_params(mcore):
    rec, module, make = mcore()
    names = (
        "TELayerNormColumnParallelLinear",
        "TERowParallelLinear",
        "TEColumnParallelGroupedLinear",
    )
    layers = [make(n, seed=i) for i, n in enumerate(names)]
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap(dict(enumerate(layers)), names={1: "linear_proj"})
    assert be.switched_units == {0, 1, 2}
    be.apply({1}, step=1)
    recipe = rec.recipe.Float8CurrentScaling(fp8_format=rec.recipe.Format.HYBRID)
    outer = (True, recipe, None)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    rec.calls.clear()
    with megatron_fp8(rec, recipe):
        y = reference_chain = x
        for layer in layers:
            y = F.gelu(call(layer, y))
    # megatron's own region, from te_quant_params: fp8_autocast(enabled=False), nothing else
    assert [c[2] for c in rec.calls] == [
        {"enabled": True, "fp8_recipe": recipe, "fp8_group": None},
        {"enabled": False},
    ]
    assert [m.seen for m in layers] == [[(outer,)], [(outer, (False, None, None))], [(outer,)]]
    assert [be.fp8_ran(u) for u in range(3)] == [True, False, True]
    assert be.report().ran == {0: {LOW_COST}, 1: {RECOVERY}, 2: {LOW_COST}}
    assert [m.will_execute_quantized(True) for m in layers] == [True, False, True]  # megatron's
    for layer in layers:  # the module's own computation is untouched
        reference_chain = F.gelu(F.linear(reference_chain, layer.weight, layer.bias))
    assert torch.equal(y, reference_chain)
    assert layers[1].te_quant_params.training_recipe == module.TEQuantizationRecipe()
    assert layers[1].te_quant_params.evaluation_recipe is None  # evaluation follows the plan
    assert layers[0].te_quant_params is None and layers[2].te_quant_params is None
    be.apply(set(), step=2)
    with megatron_fp8(rec, recipe):
        call(layers[1], x)
    assert layers[1].te_quant_params is None and layers[1].seen[-1] == (outer,)
    assert be.report().ran == {1: {LOW_COST}} and be.fp8_ran(1)


def test_micro_batches_and_recomputation_read_the_same_te_quant_params(mcore):
    rec, _, make = mcore()
    layers = [make("TEColumnParallelLinear", seed=0), make("TERowParallelLinear", seed=1)]
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap(dict(enumerate(layers)))
    be.apply({0}, step=4)
    recipe = rec.recipe.Float8CurrentScaling()

    def block(x):
        with megatron_fp8(rec, recipe):  # megatron's recompute re-enters the layer's context
            return call(layers[1], F.gelu(call(layers[0], x)))

    for micro in torch.randn(2, 3, 8).unbind():  # two micro-batches, recomputed in backward
        checkpoint(block, micro, use_reentrant=False).sum().backward()
    assert [len(m.seen) for m in layers] == [4, 4]  # 2 forwards + 2 recomputations each
    assert set(layers[0].seen) == {((True, recipe, None), (False, None, None))}
    assert set(layers[1].seen) == {((True, recipe, None),)}
    assert be.report().ran == {0: {RECOVERY}, 1: {LOW_COST}}


def test_original_te_quant_params_come_back_as_the_same_object(mcore):
    _, module, make = mcore()
    layer, other = make("TERowParallelLinear"), make("TELinear", seed=1)
    original = quant_params(
        module, {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"}, evaluation={}
    )
    layer.te_quant_params = original
    frozen, pickled = copy.deepcopy(original), pickle.dumps(original)
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap({0: layer, 1: other})
    for step, plan in enumerate([{0}, {0}, {1}, set(), {0, 1}], start=1):
        be.apply(plan, step)
        assert (layer.te_quant_params is original) == (0 not in plan), step
        assert original == frozen and pickle.dumps(original) == pickled  # never mutated
    be.unwrap()  # from recovery: the original objects are back, the forwards are gone
    assert layer.te_quant_params is original and other.te_quant_params is None
    assert pickle.dumps(layer.te_quant_params) == pickled
    assert "forward" not in vars(layer) and "forward" not in vars(other)


def test_stronger_recovery_recipe_is_megatrons_enabled_region_with_its_amax_group(mcore):
    group = object()
    rec, module, make = mcore(amax_group=group)
    config = mcore_config(tp_only_amax_red=True)
    layers = [make("TELinear", config, seed=0), make("TELinear", config, seed=1)]
    be = TEFp8Backend(
        operators=MEGATRON_OPERATORS,
        low_cost={"recipe": "tensorwise"},
        recovery={"recipe": "blockwise"},
    )
    be.wrap(dict(enumerate(layers)))
    be.apply({0}, step=1)
    training = layers[0].te_quant_params.training_recipe
    assert training.fp8_quantization_recipe == module.Fp8Recipe.blockwise
    assert (training.fp8_format, training.tp_only_amax_red) == ("hybrid", True)
    low = rec.recipe.Float8CurrentScaling(fp8_format=rec.recipe.Format.HYBRID)
    rec.calls.clear()
    with megatron_fp8(rec, low, group):
        call(layers[1], call(layers[0], torch.ones(2, 8)))
    inner = rec.calls[1][2]
    assert set(inner) == {"enabled", "fp8_recipe", "fp8_group"}
    assert inner["enabled"] is True and inner["fp8_group"] is group
    assert type(inner["fp8_recipe"]).__name__ == "Float8BlockScaling"
    assert inner["fp8_recipe"].kwargs == {"fp8_format": rec.recipe.Format.HYBRID}
    assert rec.amax_calls == [{"with_context_parallel": True, "tp_only_amax_red": True}]
    assert layers[0].seen == [((True, low, group), (True, inner["fp8_recipe"], group))]
    assert layers[1].seen == [((True, low, group),)]
    assert be.fp8_ran(0) and be.fp8_ran(1)
    assert be.report().ran == {0: {RECOVERY}, 1: {LOW_COST}}


def test_layer_units_keep_nested_regions_and_their_te_quant_params(mcore):
    _, _, make = mcore()
    layer_unit = nn.ModuleDict(
        {
            "qkv": make("TELayerNormColumnParallelLinear"),
            "proj": make("TERowParallelLinear", seed=1),
        }
    )
    operator = make("TERowParallelLinear", seed=2)
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap({0: layer_unit, 1: operator})
    assert be.switched_units == {1}
    be.apply({0, 1}, step=1)
    assert all(m.te_quant_params is None for m in layer_unit.values())
    low = be.low_cost_recipe
    with be.autocast():  # outside megatron (or in its layer context), one outer region
        for m in (*layer_unit.values(), operator):
            call(m, torch.ones(1, 8))
    backend_inner, megatron_inner = (False, low, None), (False, None, None)
    assert [m.seen for m in layer_unit.values()] == [[((True, low, None), backend_inner)]] * 2
    assert operator.seen == [((True, low, None), megatron_inner)]
    assert be.report().ran == {0: {RECOVERY}, 1: {RECOVERY}}
    assert not any(be.fp8_ran(u) for u in (0, 1))


@pytest.mark.parametrize("reseed", ["reset", "keep"])
def test_megatron_operator_back_from_recovery_follows_the_reseed_policy(mcore, reseed):
    rec, _, make = mcore()
    config = mcore_config(fp8_recipe="delayed")
    layers = [make("TERowParallelLinear", config, seed=i) for i in range(2)]
    be = TEFp8Backend(
        operators=MEGATRON_OPERATORS, low_cost={"recipe": "delayed", "reseed": reseed}
    )
    be.wrap(dict(enumerate(layers)))
    be.apply({0}, step=1)
    with megatron_fp8(rec, be.low_cost_recipe):  # delayed: megatron's one outer region
        for layer in layers:
            call(layer, torch.ones(1, 8))
    assert layers[0].seen == [((True, be.low_cost_recipe, None), (False, None, None))]
    _staleify(layers)
    be.apply(set(), step=2)
    assert [m.resets for m in layers] == ([1, 0] if reseed == "reset" else [0, 0])
    assert [_is_reset(m) for m in layers] == [reseed == "reset", False]
    assert layers[0].te_quant_params is None


BF16_OWN = {"training": {}}
MXFP8_OWN = {"training": {"fp8_quantization_recipe": "mxfp8", "fp8_format": "hybrid"}}
CUSTOM_OWN = {
    "training": {"fp8_quantization_recipe": "custom", "custom_recipe_factory": "my.recipes.factory"}
}


@pytest.mark.parametrize(
    ("config", "own", "options", "match"),
    [
        ({"fp8_recipe": "delayed"}, None, {},
         r"fp8_recipe='delayed' but gnmr\.low_cost is recipe='tensorwise'"),
        ({"fp8": "e4m3"}, None, {}, r"config\.fp8='e4m3', .*fp8_format='hybrid'"),
        ({"fp8": None}, None, {}, r"without FP8 or FP4 \(config\.fp8 and config\.fp4 are None\)"),
        ({"cuda_graph_impl": "local"}, None, {}, r"CUDA-graphs its layer \(cuda_graph_impl='local"),
        ({"enable_cuda_graph": True}, None, {}, r"\(enable_cuda_graph=True\)"),
        ({}, BF16_OWN, {}, r"te_quant_params already run it in BF16"),
        ({}, MXFP8_OWN, {"recovery": {"recipe": "blockwise"}},
         r"recipe 'mxfp8', which gnmr\.recovery\.recipe 'blockwise' is not known to be stronger"),
        ({}, CUSTOM_OWN, {"recovery": {"recipe": "mxfp8"}}, r"recipe 'custom'"),
    ],
)  # fmt: skip
def test_what_te_quant_params_cannot_switch_is_refused_at_wrap(mcore, config, own, options, match):
    _, module, make = mcore()
    layer, fine = make("TERowParallelLinear", mcore_config(**config)), make("TELinear", seed=1)
    if own is not None:
        layer.te_quant_params = quant_params(module, **own)
    before = layer.te_quant_params
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"}, **options)
    with pytest.raises(ValueError, match=match) as err:
        be.wrap({0: fine, 3: layer}, names={3: "decoder.layers.0.self_attention.linear_proj"})
    assert str(err.value).startswith(f"te_fp8: {LABEL}")  # names the module
    assert be.units == set() and be.switched_units == set()  # nothing installed
    assert "forward" not in vars(layer) and "forward" not in vars(fine)
    assert layer.te_quant_params is before


def test_bf16_recovery_accepts_what_it_is_stronger_than(mcore):
    _, module, make = mcore()
    layers = [make("TELinear", seed=i) for i in range(2)]
    layers[0].te_quant_params = quant_params(module, **MXFP8_OWN)
    layers[1].te_quant_params = quant_params(module, **CUSTOM_OWN)
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap(dict(enumerate(layers)))
    assert be.switched_units == {0, 1}


def test_megatron_without_the_quant_params_fields_is_refused(mcore, monkeypatch):
    rec, module, _ = mcore()
    old = types.ModuleType("megatron.core.extensions.old_te")
    monkeypatch.setitem(sys.modules, old.__name__, old)
    cls = type("TERowParallelLinear", (rec.te.Linear,), {"__module__": old.__name__})
    layer = cls(8, 8)
    layer.config, layer.te_quant_params = mcore_config(), None
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    with pytest.raises(
        RuntimeError, match=r"unit 0 \(TERowParallelLinear\).*lacks \['TEQuantizationP"
    ):
        be.wrap({0: layer})
    old.TEQuantizationParams, old.Fp8Recipe = module.TEQuantizationParams, module.Fp8Recipe
    old.TEQuantizationRecipe = dataclasses.make_dataclass(  # a recipe without the override flags
        "TEQuantizationRecipe", ["fp8_quantization_recipe", "fp4_quantization_recipe", "fp8_format"]
    )
    with pytest.raises(RuntimeError, match=r"lacks \['override_nonquantized_autocast', 'overr"):
        be.wrap({0: layer})
    assert be.units == set() and "forward" not in vars(layer)


def test_te_quant_params_replaced_after_wrap_is_an_error(mcore):
    _, module, make = mcore()
    layer = make("TERowParallelLinear")
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap({0: layer}, names={0: "decoder.layers.0.self_attention.linear_proj"})
    be.apply({0}, step=1)
    layer.te_quant_params = quant_params(module, **MXFP8_OWN)  # e.g. finish_init run again
    with pytest.raises(RuntimeError, match=rf"{re.escape(LABEL)}: te_quant_params was replaced"):
        be.apply(set(), step=2)
    with pytest.raises(RuntimeError, match=r"was replaced after backend\.wrap"):
        call(layer, torch.ones(1, 8))


def test_a_forward_that_ignores_te_quant_params_is_caught(mcore):
    rec, module, _ = mcore()

    class TERowParallelLinear(module.TERowParallelLinear):  # pretends to be megatron's
        def forward(self, x):  # ...but skips the te_quant_params region
            return rec.te.Linear.forward(self, x), None

    layer = TERowParallelLinear.__new__(TERowParallelLinear)
    rec.te.Linear.__init__(layer, 8, 8)
    layer.config, layer.te_quant_params = mcore_config(), None
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap({0: layer})
    be.apply({0}, step=1)
    with (
        megatron_fp8(rec, be.low_cost_recipe),
        pytest.raises(RuntimeError, match=r"ran FP8 although its te_quant_params asked for BF16"),
    ):
        layer(torch.ones(1, 8))


def test_megatron_operator_takes_a_lazily_pending_plan_before_its_forward(mcore):
    """megatron_patches decides after the step and applies the plan at the next forward
    (``backend.before_forward``): a te_quant_params unit must take it before reading its path."""
    rec, _, make = mcore()
    layer = make("TERowParallelLinear", seed=0)
    be = TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": "tensorwise"})
    be.wrap({0: layer})
    be.apply(set(), step=1)
    be.before_forward = lambda: (setattr(be, "before_forward", None), be.apply({0}, step=2))
    recipe = rec.recipe.Float8CurrentScaling(fp8_format=rec.recipe.Format.HYBRID)
    with megatron_fp8(rec, recipe):
        call(layer, torch.randn(4, 8, generator=torch.Generator().manual_seed(3)))
    assert be.before_forward is None
    assert be.report().step == 2 and be.report().ran == {0: {RECOVERY}} and not be.fp8_ran(0)
