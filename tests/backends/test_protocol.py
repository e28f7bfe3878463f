"""The backend protocol: one plan for the whole step, recomputation included; clean unwrap.

The contract tests run every registered backend (``tests/backends/registered.py``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnmr_dist.backends import (
    BACKENDS,
    LOW_COST,
    RECOVERY,
    PrecisionBackend,
    backend_class,
    get_backend,
    registered_operator_types,
)
from gnmr_dist.backends.operators import operators_of
from gnmr_dist.backends.te_runtime import TE_MODULE_TYPES
from tests.backends.registered import backend_params


def model_and_units():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return model, {0: model[0], 1: model[2]}


@pytest.mark.parametrize("name", backend_params())
def test_recomputation_and_micro_batches_see_the_step_plan(name):
    model, units = model_and_units()
    backend = get_backend(name)
    backend.wrap(units)
    x = torch.randn(4, 8, 32)
    backend.apply({1}, step=7)
    for micro in x.chunk(2):  # two micro-batches, one plan
        checkpoint(model, micro, use_reentrant=False).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    report = backend.report()
    assert report.step == 7 and report.planned == {1}
    assert report.ran == {0: {LOW_COST}, 1: {RECOVERY}}  # recompute ran the same paths
    model.zero_grad()
    backend.apply({1}, step=8)
    for micro in x.chunk(2):
        model(micro).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


@pytest.mark.parametrize("name", backend_params())
def test_apply_resets_the_report_and_unknown_units_are_harmless(name):
    model, units = model_and_units()
    backend = get_backend(name)
    backend.wrap(units)
    backend.apply({0, 99}, step=1)
    model(torch.randn(2, 32))
    assert backend.report().recovered == {0}
    backend.apply((), step=2)
    assert backend.report().ran == {}
    assert backend.units == {0, 1}


class LoraLike(nn.Module):
    """peft's shape: a frozen base layer plus adapters, itself the operator."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(8, 8)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(8, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 8, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_nested_operators_belong_to_the_outer_one():
    block = nn.Module()
    block.proj = LoraLike()
    block.out = nn.Linear(8, 8)
    assert [p for p, _ in operators_of(block)] == ["proj", "out"]
    assert [p for p, _ in operators_of(block.proj)] == [""]


# -------------------------------------------------------------------------- the registry


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_declares_the_protocol(name):
    cls = backend_class(name)  # importable on every host: no optional package at module level
    assert issubclass(cls, PrecisionBackend) and cls.name == name
    assert isinstance(cls.operator_types, frozenset)
    assert all(isinstance(t, str) for t in cls.operator_types)
    assert cls.operator_types <= registered_operator_types()
    assert cls.LowCost is not None and cls.Recovery is not None  # parsed strictly


def test_importing_every_backend_imports_no_optional_package():
    code = (
        "import sys; from gnmr_dist.backends import registered_operator_types as r; r(); "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('transformer_engine', 'megatron', 'peft', 'deepspeed', 'torchao')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_unit_registries_find_every_backends_operator_types():
    assert registered_operator_types() == TE_MODULE_TYPES  # te_fp8's; the others: nn.Linear
    assert backend_class("te_fp8").operator_types == TE_MODULE_TYPES


def test_the_base_class_defaults():
    class Plain(PrecisionBackend):
        name = "plain"

    backend = Plain()
    assert backend.recovery_region() is None  # megatron keeps its per-layer context
    assert backend.error_sums(torch.device("cpu")) is None and not backend.reports_errors
    with backend.measuring(), backend.step_context():
        pass
    with pytest.raises(ValueError, match=r"gnmr\.low_cost: the plain backend takes no low_cost "):
        Plain(low_cost={"bits": 4})
    with pytest.raises(ValueError, match=r"unknown backend 'int9'; did you mean 'int8'\? \("):
        get_backend("int9")


def _gnmr_example(cls) -> dict:
    """The ``"gnmr"`` JSON block a backend's class docstring ends with."""
    import inspect
    import json

    doc = inspect.getdoc(cls) or ""
    _, marker, example = doc.rpartition('``"gnmr"``::')
    assert marker, f'{cls.__name__}\'s docstring does not end with its "gnmr" block'
    return json.loads(example)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_docstring_ends_with_a_gnmr_block_that_parses(name):
    from gnmr_dist.backends.options import parse_options
    from gnmr_dist.integrations.config import GNMRBlock

    cls = backend_class(name)
    block = GNMRBlock.from_dict(_gnmr_example(cls))
    assert block.backend == name
    low = parse_options(cls.LowCost, block.low_cost, "gnmr.low_cost")
    rec = parse_options(cls.Recovery, block.recovery, "gnmr.recovery", cls.recovery_defaults)
    for parsed, given in ((low, block.low_cost), (rec, block.recovery)):
        assert given and {k: getattr(parsed, k) for k in given} == dict(given)  # read as given


def test_the_example_reader_refuses_a_docstring_without_one():
    class Bare(PrecisionBackend):
        """No example here."""

    with pytest.raises(AssertionError, match="does not end with its"):
        _gnmr_example(Bare)


def test_an_own_backends_options_are_checked_by_their_annotations():
    """Issue 33, item 3: ``"mantissa_bits": "2"`` crashed an own backend in its first forward
    (or its ``__post_init__`` with a ``TypeError``); every option is checked against its
    dataclass annotation when the backend is built, naming key, value and type."""
    import tests.backends.external  # noqa: F401  (registers test_rounded, a user's package)
    from gnmr_dist.backends.options import parse_options

    with pytest.raises(ValueError) as err:
        get_backend("test_rounded", low_cost={"mantissa_bits": "2"})
    assert str(err.value) == "gnmr.low_cost.mantissa_bits: '2' is str, expected int"

    @dataclasses.dataclass(frozen=True)
    class Plain:  # no __post_init__ at all
        bits: int = 4
        scale: float = 1.0
        mode: typing.Literal["a", "b"] = "a"
        seed: int | None = None
        shape: tuple[int, ...] = (1,)

    assert parse_options(Plain, {"bits": 3, "scale": 2, "seed": None, "shape": [2]}, "p").bits == 3
    for bad, message in [
        ({"bits": True}, "p.bits: True is bool, expected int"),
        ({"scale": "1"}, "p.scale: '1' is str, expected float"),
        ({"mode": "c"}, "p.mode: 'c' is str, expected one of 'a', 'b'"),
        ({"seed": 1.5}, "p.seed: 1.5 is float, expected int or None"),
        ({"shape": 3}, "p.shape: 3 is int, expected tuple"),
    ]:
        with pytest.raises(ValueError) as err:
            parse_options(Plain, bad, "p")
        assert str(err.value) == message
