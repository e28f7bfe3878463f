"""The stand-ins of Transformer Engine and of megatron-core's TE linears, for the te_fp8 tests.

Transformer Engine needs CUDA and does not install here, so a stand-in ``transformer_engine``
package is put in ``sys.modules``. It keeps TE's signatures
(``autocast(enabled, calibrating, recipe, amax_reduction_group)`` from 2.9,
``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` before), records the regions that
are active in a stack, and its ``Linear`` records that stack and ``self.fp8`` (innermost region
governs) in each forward, as TE's modules do. megatron-core's TE linears are megatron's own
source text executed over that stand-in (:func:`build_fake_megatron`, the ``mcore`` fixture).
Used by ``test_te_fp8``, ``test_te_fp8_megatron``, ``test_te_shadow``, ``test_te_nvfp4``,
``test_gemm_subset`` and the DeepSpeed shadow-error test.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import dataclasses
import enum
import importlib.util
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
