"""Unit discovery and naming, on one process (the multi-process agreement is in test_monitor)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.distributed.units import (
    ModelMarks,
    _Search,
    check_selection,
    global_param_name,
    matches,
)
from tests.distributed.toy import Block, Toy


def test_operator_units_in_layer_order_and_rest_bucket():
    reg = UnitRegistry.from_model(Toy(layers=2))
    assert reg.names == ("layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2")
    slots = dict(zip(reg.param_names, reg.param_slots.tolist(), strict=True))
    assert slots["layers.1.fc2.bias"] == 3 and slots["layers.0.fc1.weight"] == 0
    rest = reg.num_units
    assert slots["embed.weight"] == slots["head.weight"] == slots["layers.0.norm.weight"] == rest


def test_layer_granularity_owns_norms_too():
    reg = UnitRegistry.from_model(Toy(layers=3), granularity="layer")
    assert reg.names == ("layers.0", "layers.1", "layers.2")
    assert len(reg.unit_params(1)) == 6  # norm w/b, fc1 w/b, fc2 w/b
    assert len(reg.unit_params(reg.num_units)) == 2  # embed, head


def test_include_exclude_patterns():
    model = Toy(layers=3)
    reg = UnitRegistry.from_model(model, exclude=["layers.0.*", "*.fc2"])
    assert reg.names == ("layers.1.fc1", "layers.2.fc1")
    reg = UnitRegistry.from_model(model, include=["head", "layers.2.*"])
    assert reg.names == ("layers.2.fc1", "layers.2.fc2", "head")  # layers first, then by name
    said = (
        r"no units selected with units='operator', include=\['nothing\*'\], exclude=\[\]; "
        r"the model's operator units are: layers\.0\.fc1, layers\.0\.fc2, "
        r"layers\.1\.fc1"
    )
    with pytest.raises(ValueError, match=said):
        UnitRegistry.from_model(model, include=["nothing*"])
    with pytest.raises(ValueError, match=said):  # the same, locally, before any collective
        check_selection(model, include=["nothing*"])
    with pytest.raises(ValueError, match="granularity must be one of"):
        UnitRegistry.from_model(model, granularity="block")


def test_a_pattern_means_the_same_part_at_either_granularity():
    """``"layers.0.*"`` (the README's exclude) drops layer 0 as operators and as a layer unit."""
    model = Toy(layers=3)
    ops = UnitRegistry.from_model(model, exclude=["layers.0.*"])
    layers = UnitRegistry.from_model(model, granularity="layer", exclude=["layers.0.*"])
    assert ops.names == ("layers.1.fc1", "layers.1.fc2", "layers.2.fc1", "layers.2.fc2")
    assert layers.names == ("layers.1", "layers.2")
    with pytest.raises(ValueError, match=r"the model's layer units are: layers\.0, layers\.1"):
        UnitRegistry.from_model(model, granularity="layer", include=["*.fc1"])  # part of a layer
    assert matches("model.layers.0", ["*.layers.0.*"])
    assert not matches("model.layers.10", ["*.layers.0.*"])


def test_pipeline_stage_names_layers_globally():
    stage = Toy(layers=2, embed=False)
    reg = UnitRegistry.from_model(stage, layer_offset=2)
    assert reg.names == ("layers.2.fc1", "layers.2.fc2", "layers.3.fc1", "layers.3.fc2")
    assert (
        global_param_name(stage, "layers.1.norm.weight", layer_offset=2) == "layers.3.norm.weight"
    )


class MegatronLikeLayer(Block):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number  # global, 1-based, as megatron-core sets it


class Wrapped(nn.Module):
    """DDP/Float16Module-style wrapping: ``module.module.decoder.layers.N``."""

    def __init__(self, first_layer_number: int) -> None:
        super().__init__()
        inner = nn.Module()
        inner.decoder = nn.Module()
        inner.decoder.layers = nn.ModuleList(
            MegatronLikeLayer(first_layer_number + i) for i in range(2)
        )
        self.module = nn.Module()
        self.module.module = inner


def test_megatron_layer_number_and_wrapper_prefixes():
    marks = ModelMarks(layer_number="layer_number")  # as the megatron integration names it
    reg = UnitRegistry.from_model(Wrapped(first_layer_number=5), marks=marks)
    assert reg.names[0] == "decoder.layers.4.fc1" and reg.names[-1] == "decoder.layers.5.fc2"
    assert reg.param_names[0] == "decoder.layers.4.norm.weight"
    plain = UnitRegistry.from_model(Wrapped(first_layer_number=5))  # no mark named: list index
    assert plain.names[0] == "decoder.layers.0.fc1" and plain.names[-1] == "decoder.layers.1.fc2"


def test_tp_replicas_shared_and_tied_parameters_are_counted_once():
    model = Toy(layers=1)
    model.head.weight = model.embed.weight  # tied: one tensor under two names
    model.layers[0].fc1.weight.tensor_model_parallel = True
    model.layers[0].fc2.weight.model_parallel = True  # another framework's mark
    model.layers[0].norm.weight.shared = True  # a tied copy held by another stage
    marks = ModelMarks(sharded=("tensor_model_parallel", "model_parallel"), shared=("shared",))
    counted = {id(p) for p in UnitRegistry.from_model(model, marks=marks).params}
    assert id(model.layers[0].norm.weight) not in counted
    assert len(counted) == len(UnitRegistry.from_model(model, marks=marks).params)  # no duplicate
    assert id(model.layers[0].norm.weight) in {id(p) for p in UnitRegistry.from_model(model).params}

    # on TP rank 1 only the sharded parameters count
    search = _Search("operator", 0, frozenset(), marks=marks)
    agreed = (["layers.0.fc1", "layers.0.fc2"], [True, True], [0, 0])
    reg = UnitRegistry._bind(model, agreed, [], tp_rank=1, search=search)
    held = {id(p) for p in reg.params}
    assert held == {id(model.layers[0].fc1.weight), id(model.layers[0].fc2.weight)}


def test_eligibility_function_and_runtime_wiring():
    reg = UnitRegistry.from_model(Toy(layers=2), eligible_fn=lambda name, m: "fc1" in name)
    assert reg.eligible.tolist() == [True, False, True, False]
    runtime = GNMRRuntime(reg)
    assert runtime.controller.eligible.tolist() == [True, False, True, False]
    assert runtime.plan.step == 1 and runtime.plan.active == frozenset()


def test_runtime_state_round_trip_and_unit_mismatch():
    model = Toy(layers=2)
    reg = UnitRegistry.from_model(model)
    a = GNMRRuntime(reg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(3):
        a.step()
    b = GNMRRuntime(UnitRegistry.from_model(model))
    b.load_state_dict(a.state_dict())
    assert b.plan == a.plan and b.controller.step_count == 3
    other = GNMRRuntime(UnitRegistry.from_model(Toy(layers=3)))
    with pytest.raises(ValueError, match="saved for 4 units, this model has 6"):
        other.load_state_dict(a.state_dict())
