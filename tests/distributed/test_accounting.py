"""Issue 34 in the runtime: unit costs from global shapes (agreed by every rank), the pinned mask,
the learning rate, and the accounting (per GEMM, skipped steps, the first non-finite unit,
resume)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.backends.gemms import GEMMS
from gnmr_dist.core import GNMRConfig, GNMRController
from gnmr_dist.distributed import GNMRRuntime, UnitNorms, UnitRegistry, operator_shapes
from gnmr_dist.distributed.accounting import GEMM_ORDER, AccountingSummary
from gnmr_dist.state import seal, unseal
from tests import multiproc
from tests.distributed.toy import FFN, HIDDEN, Toy

U = 2 * 2  # Toy(layers=2): fc1, fc2 per layer


def norms(values) -> UnitNorms:
    n = torch.tensor(values, dtype=torch.float64)
    return UnitNorms(n, 1.0, 2.0)


# ------------------------------------------------------------------ costs


class _Stand(nn.Module):
    """A module carrying only the attributes a framework's linear carries (no parameters)."""

    def __init__(self, **attrs) -> None:
        super().__init__()
        for k, v in attrs.items():
            setattr(self, k, v)


class _Lora(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer, self.lora_A = base, nn.ModuleDict()


def test_operator_shapes_read_global_shapes_of_each_framework():
    assert operator_shapes(nn.Linear(3, 5)) == [(3, 5)]
    assert operator_shapes(_Lora(nn.Linear(3, 5))) == [(3, 5)]
    # megatron-core's Column/RowParallelLinear: input_size / output_size are the global sizes
    assert operator_shapes(_Stand(input_size=64, output_size=256, tp_size=4)) == [(64, 256)]
    # TE: out_features (column) or in_features (row) was divided by tp_size
    col = _Stand(in_features=64, out_features=64, parallel_mode="column", tp_size=4)
    row = _Stand(in_features=64, out_features=64, parallel_mode="row", tp_size=4)
    assert operator_shapes(col) == [(64, 256)] and operator_shapes(row) == [(256, 64)]
    plain = _Stand(in_features=64, out_features=64, parallel_mode=None, tp_size=1)
    assert operator_shapes(plain) == [(64, 64)]
    # TE's LayerNormMLP: gated fc1 (2 x ffn / tp rows) and fc2, both global
    mlp = _Stand(hidden_size=32, size_per_partition=48, tp_size=2)
    mlp.fc1_weight = nn.Parameter(torch.empty(2 * 48, 32))
    assert operator_shapes(mlp) == [(32, 2 * 96), (96, 32)]
    assert operator_shapes(_Stand(weight=1)) is None


def test_registry_sizes_and_costs_at_both_granularities():
    ops = UnitRegistry.from_model(Toy(layers=2))
    assert ops.sizes == (HIDDEN * FFN,) * U
    assert ops.costs(3) == ([3 * HIDDEN * FFN] * U, 3 * U * HIDDEN * FFN)
    assert ops.costs(1) == ([HIDDEN * FFN] * U, 3 * U * HIDDEN * FFN)  # W counts all three
    layers = UnitRegistry.from_model(Toy(layers=2), granularity="layer")
    assert layers.sizes == (2 * HIDDEN * FFN,) * 2
    head = UnitRegistry.from_model(Toy(layers=1), include=["head", "layers.0.fc1"])
    assert head.sizes == (HIDDEN * FFN, HIDDEN * 32)  # the head's vocab is 32


def test_max_share_needs_readable_shapes_and_names_the_units():
    class Odd(nn.Module):  # an operator class the caller names, with no shape attributes
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, 2))

    model = Toy(layers=1)
    model.layers[0].fc2 = Odd()
    reg = UnitRegistry.from_model(model, operator_types={"Odd"})
    assert reg.unsized() == ["layers.0.fc2"] and reg.costs() is None
    GNMRRuntime(reg, GNMRConfig())  # without max_share: no costs, nothing refused
    with pytest.raises(ValueError, match=r"gnmr.max_share needs .* \['layers.0.fc2'\]"):
        GNMRRuntime(reg, GNMRConfig(max_share=0.5))


def _agreement_worker(rank, world):
    model = Toy(layers=2, ffn=FFN if rank == 0 else 2 * FFN)
    with pytest.raises(RuntimeError) as err:  # on every rank
        UnitRegistry.from_model(model, group=dist.group.WORLD)
    return str(err.value)


def test_ranks_that_read_other_shapes_are_refused_by_name():
    for msg in multiproc.run(_agreement_worker, 2):
        assert "unit 'layers.0.fc1'" in msg
        assert f"as {2 * HIDDEN * FFN} multiply-accumulates" in msg
        assert f"another rank as {HIDDEN * FFN}" in msg
        assert "costs must be the same on every rank" in msg


def test_the_runtime_passes_costs_pinned_mask_and_gemms_to_its_controller():
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=0, max_active=0, pinned={"units": {"last_layers": 1}})
    runtime = GNMRRuntime(reg, cfg, gemms=("fprop", "wgrad"))
    d = runtime.observe(norms([1.0] * U))
    assert d.pinned == (2, 3) and d.active == (2, 3)  # layers.1.*, resolved from the names
    size = HIDDEN * FFN
    assert d.telemetry.plan_share == pytest.approx(2 * 2 * size / (3 * U * size))
    assert GEMM_ORDER == GEMMS  # the runtime's copy of the backends' order


def test_lr_reaches_the_controller():
    reg = UnitRegistry.from_model(Toy(layers=2))
    sched = {"schedule": "step", "start": 0, "end": 1, "clock": "lr_decay", "to": 0.5}
    runtime = GNMRRuntime(reg, GNMRConfig(warmup_steps=0, max_active=sched, lock_steps=0))
    with pytest.raises(ValueError, match=r"gnmr\.max_active runs on the lr_decay clock"):
        runtime.observe(norms([1.0] * U))
    spike = [1.0, 1.0, 50.0, 1.0]
    assert runtime.observe(norms([1.0] * U), lr=1.0).active == ()
    assert runtime.observe(norms(spike), lr=0.6).active == ()  # d = 0.4 < 0.5: k = 0
    assert runtime.observe(norms(spike), lr=0.4).active == (2,)  # d = 0.6: k = 1


# ------------------------------------------------------------------ accounting


def _run(runtime: GNMRRuntime, rows, skips=()) -> list[tuple[int, ...]]:
    """Feed ``rows`` of norms; before the rows whose index is in ``skips``, a skipped attempt
    whose unit 1 is +inf. Returns the plans decided."""
    plans = []
    for i, row in enumerate(rows):
        if i in skips:
            assert runtime.skip(norms([1.0, math.inf, 1.0, 1.0])) == (1,)
        plans.append(runtime.observe(norms(row)).active)
    return plans


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


ROWS = [[1.0] * U] * 3 + [[1.0, 1.0, 40.0, 1.0]] + [[1.0, math.nan, 1.0, 1.0]] + [[1.0] * U] * 3


def test_the_first_non_finite_unit_is_named_once_and_counted(caplog):
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=2, max_active=1, lock_steps=2)
    runtime = GNMRRuntime(reg, cfg, gemms=("fprop",))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist"):
        plans = _run(runtime, ROWS, skips=(6,))
    assert _warnings(caplog) == [
        "gnmr: first non-finite gradient norm of the run at step 5: unit 1 layers.0.fc2 "
        "(nan; 1 of 4 units non-finite)"
    ]
    s = runtime.summary()
    assert s.steps == 8 and s.nonfinite.tolist() == [0, 2, 0, 0]  # step 5 and the skipped one
    assert s.skipped_nonfinite.tolist() == [0, 1, 0, 0]
    # each plan runs the next step (the last plan has not run yet); unit 2 spiked at step 4,
    # NaN unit 1 (risk +inf) took the one place at step 5
    ran = [sum(u in plan for plan in plans[:-1]) for u in range(U)]
    assert ran[1] >= 1 and ran[2] >= 1
    recovered = runtime.controller.recovered
    assert s.recovered.tolist() == recovered.tolist() == ran
    assert s.recovered_gemms[:, 0].tolist() == ran  # fprop only
    assert s.recovered_gemms[:, 1:].sum() == 0
    assert s.recovered_share == int(recovered.sum()) / (U * 8)
    assert s.recovered_flops_share == pytest.approx(int(recovered.sum()) / (3 * U * 8))
    first = s.first_nonfinite
    assert (first.step, first.unit, first.name, first.skipped) == (5, 1, "layers.0.fc2", False)


def test_a_skipped_step_first_is_named_with_the_step_number_it_retried(caplog):
    reg = UnitRegistry.from_model(Toy(layers=2))
    runtime = GNMRRuntime(reg, GNMRConfig(warmup_steps=0, max_active=1))
    with caplog.at_level(logging.WARNING, logger="gnmr_dist"):
        _run(runtime, ROWS, skips=(2,))
    assert _warnings(caplog) == [
        "gnmr: first non-finite gradient norm of the run at step 3: unit 1 layers.0.fc2 (inf; 1 "
        "of 4 units non-finite), a step the framework skipped"
    ]
    s = runtime.summary()
    assert s.nonfinite.tolist() == [0, 2, 0, 0] and s.first_nonfinite.skipped
    assert runtime.controller.first_nonfinite == (5, 1)  # the controller saw only step 5's


def test_the_counts_survive_a_resume_and_old_states_load():
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=2, max_active=1, lock_steps=2)
    whole = GNMRRuntime(reg, cfg, gemms=("dgrad", "wgrad"))
    _run(whole, ROWS, skips=(2, 6))
    first = GNMRRuntime(reg, cfg, gemms=("dgrad", "wgrad"))
    _run(first, ROWS[:5], skips=(2,))
    second = GNMRRuntime(reg, cfg, gemms=("dgrad", "wgrad"))
    second.load_state_dict(first.state_dict())
    _run(second, ROWS[5:], skips=(1,))
    a, b = whole.summary(), second.summary()
    assert a.as_dict(reg.names) == b.as_dict(reg.names)
    assert b.first_nonfinite.step == 3 and b.first_nonfinite.skipped
    # a state from before the runtime's accounting: every GEMM of gnmr.gemms ran the
    # controller's recovered steps, no skipped step was non-finite
    body, _ = unseal(first.state_dict(), "state")
    del body["accounting"]
    old = GNMRRuntime(reg, cfg, gemms=("dgrad", "wgrad"))
    old.load_state_dict(seal(body))
    rec = first.controller.recovered
    assert old.summary().recovered_gemms.tolist() == [[0, int(r), int(r)] for r in rec]
    assert old.summary().skipped_nonfinite.sum() == 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda a: a.update(gemm_steps=a["gemm_steps"] + 99), r"gemm_steps holds a count outside"),
        (lambda a: a.update(gemm_steps=a["gemm_steps"][:2]), r"gemm_steps has shape \[2, 3\]"),
        (lambda a: a.update(skipped_first=torch.tensor([3, 0])), r"skipped_first=\[3, 0\]"),
        (lambda a: a.pop("skipped_nonfinite"), r"accounting lacks \['skipped_nonfinite'\]"),
    ],
)
def test_a_bad_accounting_is_refused_and_restores_nothing(edit, match):
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=2, max_active=1)
    saved = GNMRRuntime(reg, cfg)
    _run(saved, ROWS, skips=(2,))
    body, _ = unseal(saved.state_dict(), "state")
    edit(body["accounting"])
    fresh = GNMRRuntime(reg, cfg)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(seal(body))
    assert fresh.controller.step_count == 0 and fresh.summary().nonfinite.sum() == 0


def test_a_resume_under_a_budget_schedule_conforms_the_plan():
    """The plan saved under max_active 3 resumes under a schedule whose k at the saved step is
    1: the lock holder stays, the pinned unit stays outside the budget."""
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=0, max_active=3, lock_steps=10)
    saved = GNMRRuntime(reg, cfg)
    _run(saved, [[1.0] * U] * 3 + [[40.0, 30.0, 20.0, 1.0]])
    assert saved.plan.active == {0, 1, 2}
    tight = GNMRConfig(
        warmup_steps=0,
        lock_steps=10,
        max_active={"schedule": "step", "start": 1, "end": 3, "steps": 100},
        pinned={"units": ["layers.1.fc1"]},
    )
    resumed = GNMRRuntime(reg, tight)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.plan.active == {0, 2}  # unit 0 keeps the one lock; unit 2 is pinned
    again = GNMRRuntime(reg, tight)
    again.load_state_dict(resumed.state_dict())
    assert again.plan.active == {0, 2}


def test_an_offline_controller_with_the_registry_costs_decides_the_same():
    """The runtime's controller is GNMRController(U, cfg, eligible, costs, W, pinned mask)."""
    reg = UnitRegistry.from_model(Toy(layers=2))
    cfg = GNMRConfig(warmup_steps=1, max_active=3, max_share=0.5, lock_steps=1)
    runtime = GNMRRuntime(reg, cfg, gemms=("fprop", "dgrad"))
    w, total = reg.costs(2)
    offline = GNMRController(U, cfg, reg.eligible, costs=w, total_cost=total)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = (torch.rand(U, generator=g, dtype=torch.float64) * 10).tolist()
        assert runtime.observe(norms(row)).active == offline.step(row).active


def test_the_summary_json_holds_the_accounting():
    """The accounting's JSON form is plain JSON (a run's summary.json)."""
    s = AccountingSummary(
        steps=2,
        num_units=2,
        recovered=torch.tensor([1, 0]),
        recovered_gemms=torch.tensor([[0, 1, 1], [0, 0, 0]]),
        nonfinite=torch.tensor([0, 1]),
        skipped_nonfinite=torch.tensor([0, 1]),
        recovered_share=0.25,
        recovered_flops_share=1 / 6,
        first_nonfinite=None,
    )
    text = json.dumps(s.as_dict(["a", "b"]))
    back = json.loads(text)
    assert back["per_unit"] == {
        "a": {"recovered": 1, "fprop": 0, "dgrad": 1, "wgrad": 1, "nonfinite": 0},
        "b": {"recovered": 0, "fprop": 0, "dgrad": 0, "wgrad": 0, "nonfinite": 1},
    }
    assert back["recovered_gemm_steps"] == {"fprop": 0, "dgrad": 1, "wgrad": 1}
