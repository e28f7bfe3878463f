"""te_fp8 on CPU: which TE regions each unit runs in, recipes, versions, reseeding, options.

Transformer Engine needs CUDA and does not install here, so a stand-in ``transformer_engine``
package is put in ``sys.modules``. It keeps TE's signatures
(``autocast(enabled, calibrating, recipe, amax_reduction_group)`` from 2.9,
``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` before), records the regions that
are active in a stack, and its ``Linear`` records that stack and ``self.fp8`` (innermost region
governs) in each forward, as TE's modules do. megatron-core's TE linears are megatron's own
source text executed over that stand-in (section "megatron-core's TE linears"). The numerics of
FP8 are tested on a GPU in ``tests/gpu/test_te_fp8_gpu.py`` and by ``gnmr-gpu-check``
(:mod:`gnmr_dist.train.gpu_check`).
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import copy
import dataclasses
import enum
import importlib.util
import inspect
import logging
import pickle
import re
import sys
import types
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
import typing_extensions
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnmr_dist.backends import LOW_COST, RECOVERY, get_backend
from gnmr_dist.backends.te_fp8 import TEFp8Backend, is_te_module, reset_delayed_scaling
from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS
from tests.requires import missing

ALL_RECIPES = (
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
)
KINDS = ("fp8", "mxfp8", "fp8_block_scaling", "nvfp4")
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
            for state in (self.fp8_meta[k] for k in ("scaling_fwd", "scaling_bwd")):
                state.scale.copy_(torch.ones_like(state.scale))
                state.amax_history.copy_(torch.zeros_like(state.amax_history))

        def forward(self, x, is_first_microbatch=None):
            self.fp8 = bool(rec.active and rec.active[-1][0])
            if self.fp8:  # TE keeps the recipe the module last ran FP8 with
                self.fp8_meta["recipe"] = rec.active[-1][1]
            self.seen.append(tuple(rec.active))
            return F.linear(x, self.weight, self.bias)

    class LayerNormMLP(Linear):
        __module__ = "transformer_engine.pytorch.module.layernorm_mlp"

    class LayerNormLinear(Linear):
        __module__ = "transformer_engine.pytorch.module.layernorm_linear"

    class GroupedLinear(Linear):
        __module__ = "transformer_engine.pytorch.module.grouped_linear"

        def forward(self, x, m_splits, is_first_microbatch=None):
            return super().forward(x, is_first_microbatch)

    class FP8GlobalStateManager:
        """TE's process-global state, as far as megatron reads it."""

        @staticmethod
        def is_fp8_enabled():
            return bool(rec.active and rec.active[-1][0])

    root = types.ModuleType("transformer_engine")
    root.__version__ = version
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.fp8_autocast, pt.Linear, pt.LayerNormMLP = fp8_autocast, Linear, LayerNormMLP
    pt.LayerNormLinear, pt.GroupedLinear = LayerNormLinear, GroupedLinear
    legacy = types.ModuleType("transformer_engine.pytorch.fp8")
    legacy.fp8_autocast, legacy.FP8GlobalStateManager = fp8_autocast, FP8GlobalStateManager
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


def _scaling(layer):
    """The forward and backward delayed-scaling states (``fp8_meta`` also holds the recipe)."""
    return [layer.fp8_meta[k] for k in ("scaling_fwd", "scaling_bwd")]


def _staleify(layers):
    for layer in layers:
        for state in _scaling(layer):
            state.scale.fill_(7.0)
            state.amax_history.fill_(3.0)


def _is_reset(layer):
    return all(
        bool((s.scale == 1).all()) and bool((s.amax_history == 0).all()) for s in _scaling(layer)
    )


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


# ---------------------------------------------------------------------- megatron-core's TE linears
#
# The megatron stand-in is megatron's own source text: the ``TEQuantization*`` dataclasses, the
# functions that turn ``te_quant_params`` into a TE region, and every class deriving from TE's
# ``Linear`` / ``LayerNormLinear`` / ``GroupedLinear`` are read from the installed megatron-core's
# ``extensions/transformer_engine.py`` (and ``Fp8Recipe`` from ``enums.py``) and executed over the
# stand-in TE above. Their ``__init__`` needs a real megatron; instances are built with TE's
# ``__init__`` plus the attributes megatron's ``__init__`` sets (checked against the source).

MCORE_MODULE = "megatron.core.extensions.transformer_engine"
TE_BASES = {"te.pytorch.Linear", "te.pytorch.LayerNormLinear", "te.pytorch.GroupedLinear"}
MCORE_DEFS = (
    "_TE_CONFIG_TYPE_KEY",
    "TransformerEngineConfigType",
    "TEQuantizationRecipe",
    "TEQuantizationParams",
    "_get_fp8_autocast_for_quant_recipe",
    "_get_fp8_autocast_for_quant_params",
    "_get_should_context_be_quantized_recipe",
    "_get_should_context_be_quantized_params",
)
LABEL = "decoder.layers.0.self_attention.linear_proj (TERowParallelLinear)"


def megatron_file(relative: str) -> Path | None:
    """A file of the installed megatron-core, found without importing it."""
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(root, relative)).exists():
            return path
    return None


def megatron_definitions(path: Path, names=(), te_linears=False) -> tuple[ast.Module, set[str]]:
    """The named definitions (and the TE-derived classes) of ``path``, at their own lines."""
    found, linears = [], set()
    nodes = (
        n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.stmt)
    )
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Assign):
            name = getattr(node.targets[0], "id", None)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            name = node.name
        else:
            continue
        bases = {ast.unparse(b) for b in getattr(node, "bases", ())}
        derived = te_linears and isinstance(node, ast.ClassDef) and bases & (TE_BASES | linears)
        if derived:
            linears.add(name)
        if name in names or derived:
            found.append(node)
    return ast.Module(body=found, type_ignores=[]), linears


def _exec(tree: ast.Module, namespace: dict, path: Path) -> None:
    """Run megatron's definitions; ``inspect.getsource`` and tracebacks point into ``path``."""
    flags = __future__.annotations.compiler_flag  # megatron's annotations stay unevaluated
    exec(compile(tree, str(path), "exec", flags=flags, dont_inherit=True), namespace)


def build_fake_megatron(rec, monkeypatch, amax_group=None) -> types.ModuleType:
    """megatron's ``extensions.transformer_engine`` over the stand-in TE, in ``sys.modules``."""
    te_file, enums_file = (
        megatron_file(f"core/{f}") for f in ("extensions/transformer_engine.py", "enums.py")
    )
    if te_file is None or enums_file is None:
        missing("needs megatron-core's source (pip install megatron-core)")
    enums: dict = {"enum": enum}
    _exec(megatron_definitions(enums_file, ("Fp8Recipe", "Fp4Recipe"))[0], enums, enums_file)
    module = types.ModuleType(MCORE_MODULE)
    monkeypatch.setitem(sys.modules, MCORE_MODULE, module)  # dataclasses look it up
    legacy = sys.modules["transformer_engine.pytorch.fp8"]
    rec.amax_calls = []

    def get_amax_reduction_group(**kwargs):
        rec.amax_calls.append(kwargs)
        return amax_group

    module.__dict__.update(
        dataclasses=dataclasses,
        enum=enum,
        torch=torch,
        nullcontext=contextlib.nullcontext,
        override=typing_extensions.override,
        te=sys.modules["transformer_engine"],
        FP8GlobalStateManager=legacy.FP8GlobalStateManager,
        fp8_autocast=legacy.fp8_autocast,
        Fp8Recipe=enums["Fp8Recipe"],
        Fp4Recipe=enums["Fp4Recipe"],
        model_parallel_is_initialized=lambda: amax_group is not None,
        get_amax_reduction_group=get_amax_reduction_group,
        **{k: getattr(typing, k) for k in ("Any", "Callable", "Dict", "List", "Optional", "Set")},
    )
    tree, linears = megatron_definitions(te_file, MCORE_DEFS, te_linears=True)
    _exec(tree, module.__dict__, te_file)
    module.LINEARS = frozenset(linears)
    return module


def mcore_config(**overrides) -> SimpleNamespace:
    """The TransformerConfig fields megatron's TE linears and the backend read."""
    fields = {
        "fp8": "hybrid",
        "fp8_recipe": "tensorwise",
        "fp4": None,
        "tp_only_amax_red": False,
        "disable_parameter_transpose_cache": False,
        "cuda_graph_impl": "none",
    }
    return SimpleNamespace(**(fields | overrides))


@pytest.fixture
def mcore(fake_te, monkeypatch):
    """(stand-in TE recorder, megatron module, ``make(class, config=..., seed=...)``)."""

    def install(amax_group=None, **te_kwargs):
        rec = fake_te(**te_kwargs)
        module = build_fake_megatron(rec, monkeypatch, amax_group)

        def make(cls_name, config=None, seed=0, n=8):
            cls = getattr(module, cls_name)
            layer = cls.__new__(cls)
            base = next(c for c in cls.__mro__ if c.__module__.startswith("transformer_engine."))
            base.__init__(layer, n, n, seed=seed)
            config = config or mcore_config()
            # what megatron's __init__ sets (test_megatron_source_... checks the names)
            layer.config, layer.te_return_bias, layer.is_first_microbatch = config, False, True
            layer.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
            layer.te_quant_params = None
            return layer

        return rec, module, make

    return install


def quant_params(module, training, evaluation=None):
    """``TEQuantizationParams`` parsed by megatron from a quant_recipe entry."""
    config = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": training}
    if evaluation is not None:
        config["evaluation_recipe"] = evaluation
    return module.TEQuantizationParams.parse_from_config(SimpleNamespace(config=config))


def megatron_fp8(rec, recipe, group=None):
    """megatron's per-layer context (``get_fp8_context``): TE's fp8_autocast, enabled."""
    return sys.modules["transformer_engine.pytorch.fp8"].fp8_autocast(
        enabled=True, fp8_recipe=recipe, fp8_group=group
    )


def call(layer, x):
    out, bias = layer(x, [x.shape[0]]) if "Grouped" in type(layer).__name__ else layer(x)
    assert bias is None
    return out


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
