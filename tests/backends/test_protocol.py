"""The backend protocol: one plan for the whole step, recomputation included; clean unwrap."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnmr_dist.backends import LOW_COST, RECOVERY, get_backend
from gnmr_dist.backends.base import operators_of


def model_and_units():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return model, {0: model[0], 1: model[2]}


@pytest.mark.parametrize("name", ["act_quant", "fp8_emulated", "int8"])
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


def test_apply_resets_the_report_and_unknown_units_are_harmless():
    model, units = model_and_units()
    backend = get_backend("act_quant")
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
