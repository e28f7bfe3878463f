"""te_fp8 on CPU: which TE regions each unit runs in, recipes, versions, reseeding, options.

Transformer Engine needs CUDA and does not install here, so a stand-in ``transformer_engine``
package is put in ``sys.modules`` (the only stand-in in this file). It keeps TE's signatures
(``autocast(enabled, calibrating, recipe, amax_reduction_group)`` from 2.9,
``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` before), records the regions that
are active in a stack, and its ``Linear`` records that stack and ``self.fp8`` (innermost region
governs) in each forward, as TE's modules do. The numerics of FP8 are tested on a GPU in
``tests/gpu/test_te_fp8_gpu.py``.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import LOW_COST, RECOVERY, get_backend
from gnmr_dist.backends.te_fp8 import TEFp8Backend, is_te_module, reset_delayed_scaling

ALL_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
KINDS = ("fp8", "mxfp8", "fp8_block_scaling")
TE_NAMES = (
    "transformer_engine",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.fp8",
    "transformer_engine.common",
    "transformer_engine.common.recipe",
)


def _recipe_class(name: str) -> type:
    """A recipe class that records the keyword arguments it was built with."""

    def init(self, **kwargs):
        self.kwargs = kwargs

    return type(name, (), {"__init__": init, "__repr__": lambda self: f"{name}()"})


def build_fake_te(version="2.20.0", new_api=True, recipes=ALL_RECIPES, support=None):
    """A stand-in ``transformer_engine``: returns (modules by name, recorder)."""
    rec = SimpleNamespace(active=[], calls=[])
    support = dict.fromkeys(KINDS, (True, "")) | (support or {})

    class Region:
        def __init__(self, enabled, recipe, group):
            self.state = (enabled, recipe, group)

        def __enter__(self):
            rec.active.append(self.state)
            return self

        def __exit__(self, *exc):
            assert rec.active.pop() is self.state

    def recorded(fn):
        """Record the keyword arguments as passed; TE's signature rejects wrong names."""

        def call(*args, **kwargs):
            rec.calls.append((fn.__name__, args, kwargs))
            return fn(*args, **kwargs)

        return call

    @recorded
    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        return Region(enabled, recipe, amax_reduction_group)

    @recorded
    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
        return Region(enabled, fp8_recipe, fp8_group)

    class Linear(nn.Module):
        """TE-like: reads the innermost region in forward; delayed-scaling state in fp8_meta."""

        __module__ = "transformer_engine.pytorch.module.linear"

        def __init__(self, n_in, n_out, seed=0, history=4):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
            self.bias = nn.Parameter(torch.randn(n_out, generator=g))
            self.fp8, self.seen, self.resets = False, [], 0
            self.fp8_meta = {
                key: SimpleNamespace(scale=torch.ones(3), amax_history=torch.zeros(history, 3))
                for key in ("scaling_fwd", "scaling_bwd")
            }

        def reset_fp8_meta_tensors(self):  # TE's: scale 1, history 0, in place
            self.resets += 1
            for state in self.fp8_meta.values():
                state.scale.copy_(torch.ones_like(state.scale))
                state.amax_history.copy_(torch.zeros_like(state.amax_history))

        def forward(self, x):
            self.fp8 = bool(rec.active and rec.active[-1][0])
            self.seen.append(tuple(rec.active))
            return F.linear(x, self.weight, self.bias)

    class LayerNormMLP(Linear):
        __module__ = "transformer_engine.pytorch.module.layernorm_mlp"

    root = types.ModuleType("transformer_engine")
    root.__version__ = version
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.fp8_autocast, pt.Linear, pt.LayerNormMLP = fp8_autocast, Linear, LayerNormMLP
    legacy = types.ModuleType("transformer_engine.pytorch.fp8")
    for kind in KINDS:
        if new_api:
            setattr(pt, f"is_{kind}_available", lambda return_reason=False, k=kind: support[k])
        else:
            setattr(legacy, f"check_{kind}_support", lambda k=kind: support[k])
    if new_api:
        pt.autocast = autocast
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = enum.Enum("Format", ["E4M3", "E5M2", "HYBRID"])
    for name in recipes:
        setattr(recipe, name, _recipe_class(name))
    common = types.ModuleType("transformer_engine.common")
    root.pytorch, root.common, common.recipe, pt.fp8 = pt, common, recipe, legacy
    return dict(zip(TE_NAMES, (root, pt, legacy, common, recipe), strict=True)), rec


@pytest.fixture
def fake_te(monkeypatch):
    """Install a stand-in TE (``fake_te(version=..., new_api=..., ...)``); returns recorder+TE."""

    def install(**kwargs):
        modules, rec = build_fake_te(**kwargs)
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        rec.te = modules["transformer_engine.pytorch"]
        rec.recipe = modules["transformer_engine.common.recipe"]
        return rec

    return install


@pytest.fixture
def no_te(monkeypatch):
    """Make ``import transformer_engine`` fail, whether or not a real one is installed."""
    for name in TE_NAMES:
        monkeypatch.setitem(sys.modules, name, None)


def stack(te, n=3):
    layers = [te.Linear(8, 8, seed=i) for i in range(n)]
    model = nn.Sequential(*(m for layer in layers for m in (layer, nn.GELU())))
    return model, layers


def reference(layers, x):
    for layer in layers:
        x = F.gelu(F.linear(x, layer.weight, layer.bias))
    return x


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
    low = {"fp8_format": "e4m3", "amax_history_len": 16, "amax_compute_algo": "most_recent",
           "margin": 1, "reseed": "keep"}  # fmt: skip
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


def _staleify(layers):
    for layer in layers:
        for state in layer.fp8_meta.values():
            state.scale.fill_(7.0)
            state.amax_history.fill_(3.0)


def _is_reset(layer):
    return all(
        bool((s.scale == 1).all()) and bool((s.amax_history == 0).all())
        for s in layer.fp8_meta.values()
    )


def test_reset_applies_exactly_to_units_returning_to_fp8_in_place(fake_te):
    rec = fake_te()
    be = TEFp8Backend()
    _, layers = stack(rec.te, n=4)
    be.wrap(dict(enumerate(layers)))
    tensors = [[id(t) for s in m.fp8_meta.values() for t in (s.scale, s.amax_history)]
               for m in layers]  # fmt: skip
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
    after = [[id(t) for s in m.fp8_meta.values() for t in (s.scale, s.amax_history)]
             for m in layers]  # fmt: skip
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
    for state in layer.fp8_meta.values():
        state.scale_inv = torch.full((3,), 0.25)
    _staleify([layer])
    before = [t for s in layer.fp8_meta.values() for t in (s.scale, s.amax_history, s.scale_inv)]
    assert reset_delayed_scaling(layer) == 2
    assert _is_reset(layer)
    assert all(bool((s.scale_inv == 1).all()) for s in layer.fp8_meta.values())
    after = [t for s in layer.fp8_meta.values() for t in (s.scale, s.amax_history, s.scale_inv)]
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
