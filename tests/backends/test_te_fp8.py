"""te_fp8 on CPU: which TE regions each unit runs in, recipes, versions, reseeding, options.

Over the stand-in TE of :mod:`tests.backends.te_stand_ins`; megatron-core's TE linears are in
``test_te_fp8_megatron``. The numerics of FP8 are tested on a GPU in
``tests/gpu/test_te_fp8_gpu.py`` and by ``gnmr-gpu-check`` (:mod:`gnmr_dist.train.gpu_check`).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gnmr_dist.backends import LOW_COST, RECOVERY, get_backend
from gnmr_dist.backends.te_fp8 import TEFp8Backend, is_te_module, reset_delayed_scaling
from tests.backends import te_stand_ins as stand_ins
from tests.backends.te_stand_ins import (
    _is_reset,
    _scaling,
    _staleify,
    reference,
    stack,
)

fake_te, no_te, mcore = stand_ins.fake_te, stand_ins.no_te, stand_ins.mcore  # fixtures


# ---------------------------------------------------------------------- regions per path


def test_outer_region_once_and_inner_disabled_region_only_for_recovered_units(fake_te):
    rec = fake_te()
    be = TEFp8Backend(low_cost={"recipe": "delayed"}, recovery={"recipe": "bf16"})
    model, layers = stack(rec.te)
    be.wrap(dict(enumerate(layers)))
    be.apply({1}, step=1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    with be.autocast():
        y = model(x)
    low = be.low_cost_recipe
    outer, inner = (True, low, None), (False, low, None)
    assert [layer.seen for layer in layers] == [[(outer,)], [(outer, inner)], [(outer,)]]
    assert [c[2]["enabled"] for c in rec.calls] == [True, False]  # one outer, one inner
    assert rec.active == []
    assert [be.fp8_ran(u) for u in range(3)] == [True, False, True]
    report = be.report()
    assert report.ran == {0: {LOW_COST}, 1: {RECOVERY}, 2: {LOW_COST}}
    assert report.step == 1 and report.planned == {1}
    # the path changes the region, never the module's own computation
    assert torch.equal(y, reference(layers, x))
    y.sum().backward()
    grads = [layer.weight.grad.clone() for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    reference(layers, x).sum().backward()
    assert all(torch.equal(g, layer.weight.grad) for g, layer in zip(grads, layers, strict=True))


def test_stronger_recovery_recipe_is_an_inner_enabled_region(fake_te):
    rec = fake_te()
    be = TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": "mxfp8"})
    _, layers = stack(rec.te, n=2)
    be.wrap(dict(enumerate(layers)))
    be.apply({0}, step=1)
    with be.autocast():
        layers[1](layers[0](torch.ones(2, 8)))
    outer, inner = (True, be.low_cost_recipe, None), (True, be.recovery_recipe, None)
    assert layers[0].seen == [(outer, inner)] and layers[1].seen == [(outer,)]
    assert be.fp8_ran(0) and be.fp8_ran(1)  # both FP8, with different recipes
    assert type(be.recovery_recipe).__name__ == "MXFP8BlockScaling"


def test_plan_is_read_in_every_forward(fake_te):
    rec = fake_te()
    be = TEFp8Backend()
    _, layers = stack(rec.te, n=1)
    be.wrap({0: layers[0]})
    for step, plan in enumerate([set(), {0}, set()], start=1):
        be.apply(plan, step)
        with be.step_context():
            layers[0](torch.ones(1, 8))
    assert [len(s) for s in layers[0].seen] == [1, 2, 1]
    be.unwrap()
    assert "forward" not in vars(layers[0])


@pytest.mark.parametrize(
    ("new_api", "api", "names"),
    [
        (True, "autocast", ["enabled", "recipe", "amax_reduction_group"]),
        (False, "fp8_autocast", ["enabled", "fp8_recipe", "fp8_group"]),
    ],
)
def test_autocast_argument_names_follow_the_installed_version(fake_te, new_api, api, names):
    rec = fake_te(version="2.20.0" if new_api else "2.8.0", new_api=new_api)
    group = object()
    be = TEFp8Backend(amax_reduction_group=group)
    _, layers = stack(rec.te, n=1)
    be.wrap({0: layers[0]})
    be.apply({0}, step=1)
    with be.autocast():
        layers[0](torch.ones(1, 8))
    assert [c[0] for c in rec.calls] == [api, api]
    assert all(c[1] == () and sorted(c[2]) == sorted(names) for c in rec.calls)  # by keyword
    assert [c[2][names[2]] for c in rec.calls] == [group, group]  # group reaches both regions
    assert [c[2][names[1]] for c in rec.calls] == [be.low_cost_recipe] * 2
    assert be.te_version == ("2.20.0" if new_api else "2.8.0")


# ---------------------------------------------------------------------- recipes and versions


def test_recipes_are_built_from_names_with_te_defaults(fake_te):
    rec = fake_te()
    fmt = rec.recipe.Format
    be = TEFp8Backend()
    assert type(be.low_cost_recipe).__name__ == "DelayedScaling"
    assert be.low_cost_recipe.kwargs == {
        "fp8_format": fmt.HYBRID,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "margin": 0,
    }
    assert be.recovery_recipe is None
    low = {
        "fp8_format": "e4m3",
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "margin": 1,
        "reseed": "keep",
    }
    be = TEFp8Backend(low_cost=low)
    assert be.low_cost_recipe.kwargs == {
        "fp8_format": fmt.E4M3,
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "margin": 1,
    }


@pytest.mark.parametrize(
    ("low", "recovery", "low_cls", "rec_cls"),
    [
        ("tensorwise", "blockwise", "Float8CurrentScaling", "Float8BlockScaling"),
        ("tensorwise", "mxfp8", "Float8CurrentScaling", "MXFP8BlockScaling"),
        ("blockwise", "bf16", "Float8BlockScaling", None),
        ("mxfp8", "bf16", "MXFP8BlockScaling", None),
    ],
)
def test_non_delayed_recipes_take_only_the_format(fake_te, low, recovery, low_cls, rec_cls):
    rec = fake_te()
    be = get_backend("te_fp8", low_cost={"recipe": low}, recovery={"recipe": recovery})
    assert type(be.low_cost_recipe).__name__ == low_cls
    assert be.low_cost_recipe.kwargs == {"fp8_format": rec.recipe.Format.HYBRID}
    if rec_cls is None:
        assert be.recovery_recipe is None
    else:
        assert type(be.recovery_recipe).__name__ == rec_cls
        assert be.recovery_recipe.kwargs == {"fp8_format": rec.recipe.Format.HYBRID}


@pytest.mark.parametrize(
    ("version", "recovery", "needs"),
    [("2.1.0", "bf16", "2.2"), ("2.2.0", "blockwise", "2.3")],
)
def test_too_old_te_names_the_version_a_recipe_needs(fake_te, version, recovery, needs):
    recipes = ["DelayedScaling", "MXFP8BlockScaling"]
    if version == "2.2.0":
        recipes.append("Float8CurrentScaling")
    fake_te(version=version, new_api=False, recipes=recipes)
    with pytest.raises(RuntimeError, match=rf">= {needs}; installed: {version}"):
        TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": recovery})
    assert TEFp8Backend()._te.new_autocast is False  # delayed still works on the old TE


@pytest.mark.parametrize("new_api", [True, False])
def test_unsupported_device_raises_with_te_reason(fake_te, new_api):
    reason = "Device compute capability 8.9 or higher required for FP8 execution."
    fake_te(new_api=new_api, support={"fp8": (False, reason)})
    with pytest.raises(RuntimeError, match=r"compute capability 8\.9") as err:
        TEFp8Backend()
    assert "fp8_emulated" in str(err.value)


def test_recovery_recipe_availability_is_checked_too(fake_te):
    fake_te(support={"mxfp8": (False, "Device compute capability 10.0 or higher required")})
    TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": "blockwise"})
    with pytest.raises(RuntimeError, match=r"'mxfp8'.*10\.0"):
        TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": "mxfp8"})


def test_no_cuda_device_during_the_capability_query(fake_te):
    rec = fake_te()

    def no_gpu(return_reason=False):
        raise RuntimeError("No CUDA GPUs are available")

    rec.te.is_fp8_available = no_gpu
    with pytest.raises(RuntimeError, match=r"No CUDA GPUs are available.*fp8_emulated"):
        TEFp8Backend()


def test_missing_te_says_what_to_install_and_points_to_fp8_emulated(no_te):
    with pytest.raises(ImportError) as err:
        get_backend("te_fp8")
    message = str(err.value)
    assert "Transformer Engine" in message and "pip install" in message
    assert "'fp8_emulated' backend" in message


# ---------------------------------------------------------------------- delayed-scaling reseed


def test_reset_applies_exactly_to_units_returning_to_fp8_in_place(fake_te):
    rec = fake_te()
    be = TEFp8Backend()
    _, layers = stack(rec.te, n=4)
    be.wrap(dict(enumerate(layers)))
    tensors = [[id(t) for s in _scaling(m) for t in (s.scale, s.amax_history)] for m in layers]
    be.apply({0, 1}, step=1)
    _staleify(layers)
    be.apply({1, 2}, step=2)  # unit 0 returns; 1 stays in recovery; 2 enters; 3 never left
    assert [m.resets for m in layers] == [1, 0, 0, 0]
    assert [_is_reset(m) for m in layers] == [True, False, False, False]
    _staleify(layers)
    be.apply(set(), step=3)  # 1 and 2 return
    be.apply(set(), step=4)  # nobody returns
    assert [m.resets for m in layers] == [1, 1, 1, 0]
    assert [_is_reset(m) for m in layers] == [False, True, True, False]
    after = [[id(t) for s in _scaling(m) for t in (s.scale, s.amax_history)] for m in layers]
    assert after == tensors


@pytest.mark.parametrize(
    "low_cost", [{"recipe": "delayed", "reseed": "keep"}, {"recipe": "tensorwise"}]
)
def test_no_reset_with_keep_or_without_delayed_scaling(fake_te, low_cost):
    rec = fake_te()
    be = TEFp8Backend(low_cost=low_cost)
    _, layers = stack(rec.te, n=2)
    be.wrap(dict(enumerate(layers)))
    be.apply({0, 1}, step=1)
    _staleify(layers)
    be.apply(set(), step=2)
    assert [m.resets for m in layers] == [0, 0]
    assert not any(_is_reset(m) for m in layers)


def test_reset_fallback_fills_in_place_without_te_helper(fake_te):
    rec = fake_te()

    class OldLinear(rec.te.Linear):  # TE 1.x-like: scale_inv too, no reset helper
        reset_fp8_meta_tensors = None

    layer = OldLinear(8, 8)
    for state in _scaling(layer):
        state.scale_inv = torch.full((3,), 0.25)
    _staleify([layer])
    before = [t for s in _scaling(layer) for t in (s.scale, s.amax_history, s.scale_inv)]
    assert reset_delayed_scaling(layer) == 2
    assert _is_reset(layer)
    assert all(bool((s.scale_inv == 1).all()) for s in _scaling(layer))
    after = [t for s in _scaling(layer) for t in (s.scale, s.amax_history, s.scale_inv)]
    assert all(a is b for a, b in zip(before, after, strict=True))


def test_reset_skips_states_that_are_not_delayed(fake_te):
    rec = fake_te()
    layer = rec.te.Linear(8, 8)
    layer.fp8_meta["scaling_bwd"] = SimpleNamespace(recipe="current scaling: no state")
    layer.fp8_meta["scaling_fwd"].scale.fill_(5.0)
    assert reset_delayed_scaling(layer) == 1  # the helper would fail on the stateless one
    assert layer.resets == 0 and bool((layer.fp8_meta["scaling_fwd"].scale == 1).all())
    layer.fp8_meta = {}  # never ran FP8
    assert reset_delayed_scaling(layer) == 0


# ---------------------------------------------------------------------- units and warnings


def test_supports_te_modules_and_subclasses_only(fake_te, caplog):
    rec = fake_te()
    be = TEFp8Backend()

    class TERowParallelLinear(rec.te.Linear):
        __module__ = "megatron.core.extensions.transformer_engine"

    assert is_te_module(rec.te.Linear(4, 4)) and be.supports(TERowParallelLinear(4, 4))
    assert be.supports(rec.te.LayerNormMLP(4, 4))
    assert not be.supports(nn.Linear(4, 4))  # also called "Linear", but torch's
    assert not be.is_eligible("plain", nn.Sequential(nn.Linear(4, 4)))
    fp8_weights = rec.te.Linear(4, 4)
    fp8_weights.primary_weights_in_fp8 = True
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.backends.te_fp8"):
        assert not be.supports(fp8_weights)
    assert "FP8 primary weights" in caplog.text


def test_low_cost_forward_outside_the_outer_region_warns_once(fake_te, caplog):
    rec = fake_te()
    be = TEFp8Backend()
    _, layers = stack(rec.te, n=2)
    be.wrap(dict(enumerate(layers)))
    be.apply(set(), step=1)
    with caplog.at_level(logging.WARNING, logger="gnmr_dist.backends.te_fp8"):
        with be.autocast():
            layers[1](layers[0](torch.ones(1, 8)))
        assert caplog.records == []
        layers[1](layers[0](torch.ones(1, 8)))
    assert len(caplog.records) == 1 and "backend.autocast()" in caplog.text
    with pytest.raises(KeyError, match="unit 7"):
        be.fp8_ran(7)


# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("low_cost", "recovery", "match"),
    [
        ({"recipee": "delayed"}, None, r"gnmr\.low_cost\.recipee; did you mean 'recipe'"),
        ({"recipe": "fp4"}, None, r"gnmr\.low_cost\.recipe must be one of"),
        ({"fp8_format": "e5m2"}, None, r"gnmr\.low_cost\.fp8_format must be one of"),
        ({"amax_history_len": 0}, None, r"low_cost\.amax_history_len must be an integer >= 1"),
        ({"margin": -1}, None, r"gnmr\.low_cost\.margin must be an integer >= 0"),
        ({"amax_compute_algo": "mean"}, None, r"gnmr\.low_cost\.amax_compute_algo must be one of"),
        ({"reseed": "zero"}, None, r"gnmr\.low_cost\.reseed must be one of \['keep', 'reset'\]"),
        ({"recipe": "mxfp8", "amax_history_len": 16}, None, "applies only to recipe 'delayed'"),
        ({"recipe": "tensorwise", "reseed": "keep"}, None, "reseed applies only to recipe"),
        (None, {"recipe": "delayed"}, r"gnmr\.recovery\.recipe must be one of"),
        (None, {"bits": 8}, r"unknown key gnmr\.recovery\.bits"),
        (None, {"recipe": "tensorwise"}, "low-cost recipe is 'delayed'.*scale would stay 1"),
        ({"recipe": "tensorwise"}, {"recipe": "tensorwise"}, "not of higher fidelity"),
        ({"recipe": "blockwise"}, {"recipe": "mxfp8"}, r"not of higher fidelity.*\['bf16'\]"),
    ],
)
def test_option_errors_name_the_field_before_te_is_needed(no_te, low_cost, recovery, match):
    with pytest.raises(ValueError, match=match):
        get_backend("te_fp8", low_cost=low_cost, recovery=recovery)
