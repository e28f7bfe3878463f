"""The monitor on a real megatron-core GPTModel: TP2, PP2 and TP2 x DP2 in gloo processes.

Each rank trains its stage of the same model as a single-process twin
(tests/integrations/megatron/gpt.py), and the per-unit norms the monitor computes from the shards
must equal the twin's, the global norm must equal megatron-core's own de-duplicated grad norm, and
counting TP replicas on every rank (the naive sum) must give a different answer, so the test can
fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.requires import require

require("megatron.core")

from tests import multiproc

pytestmark = pytest.mark.slow

OPERATORS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
SPIKE_UNIT = "decoder.layers.1.mlp.linear_fc1"


def reference_norms(full) -> dict[str, float]:
    """Per-unit norms of the full model straight from its parameters (no gnmr code)."""
    sq: dict[str, float] = {}
    for name, p in full.named_parameters():
        for layer in range(4):
            for op in OPERATORS:
                unit = f"decoder.layers.{layer}.{op}"
                if name.startswith(unit + "."):
                    sq[unit] = sq.get(unit, 0.0) + float(p.grad.double().square().sum())
    return {k: v**0.5 for k, v in sq.items()}


def _worker(rank, world, tp, pp, steps, spike_step):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gnmr_dist.distributed import GradNormMonitor, UnitRegistry
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS as MARKS
    from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS as OPS
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, ref_loss = gpt.full_reference(world // (tp * pp))
    model = gpt.parallel_model(tp, pp, full)
    loss = gpt.train_step(model)
    tp_group, mp_group = ps.get_tensor_model_parallel_group(), ps.get_model_parallel_group()
    reg = UnitRegistry.from_model(
        model,
        group=dist.group.WORLD,
        tp_group=tp_group,
        operator_types=OPS.all_types(),
        marks=MARKS,
    )
    monitor = GradNormMonitor(reg, group=mp_group)
    with multiproc.CollectiveSpy(p2p=True) as spy:
        norms = monitor.compute()
    naive = GradNormMonitor(
        UnitRegistry.from_model(
            model, group=dist.group.WORLD, operator_types=OPS.all_types(), marks=MARKS
        ),
        group=mp_group,
    ).compute()
    out = {
        "names": reg.names,
        "norms": norms,
        "naive": naive,
        "calls": spy.calls,
        "megatron_norm": gpt.megatron_grad_norm(model),
        "loss": loss,
        "ref_loss": ref_loss,
        "ref_norms": reference_norms(full),
        "ref_global": float(torch.stack([p.grad.norm() for p in full.parameters()]).norm()),
    }
    if steps:
        out["decisions"] = _train(model, reg, mp_group, steps, spike_step)
    return out


def _train(model, reg, mp_group, steps, spike_step):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gnmr_dist import GNMRConfig
    from gnmr_dist.distributed import GNMRRuntime
    from tests.integrations.megatron import gpt

    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=1.0), [model])
    runtime = GNMRRuntime(
        reg,
        GNMRConfig(max_active=2, warmup_steps=5),
        group=mp_group,
        check_group=dist.group.WORLD,
        check_consistency=True,
    )
    spiked = reg.local_modules.get(reg.index[SPIKE_UNIT])
    decisions = []
    for step in range(1, steps + 1):
        gpt.train_step(model, step)
        if step == spike_step and ps.get_tensor_model_parallel_rank() == 1:
            spiked.weight.main_grad.mul_(50.0)  # one TP shard of one unit
        d = runtime.step()
        decisions.append((d.active, d.candidates, d.risk.clone()))
        opt.step()
    return decisions


@pytest.mark.parametrize(
    "world, tp, pp, steps",
    [(2, 2, 1, 50), (2, 1, 2, 0), (4, 2, 1, 0)],
    ids=["tp2", "pp2", "tp2xdp2"],
)
def test_gpt_unit_norms_match_single_process(world, tp, pp, steps):
    results = multiproc.run(_worker, world, tp, pp, steps, 30)
    first = results[0]
    names = first["names"]
    assert set(names) == set(first["ref_norms"]) and len(names) == 16
    want = torch.tensor([first["ref_norms"][n] for n in names], dtype=torch.float64)
    # the ranks of the last pipeline stage have the loss (checked below), the others none
    assert sum(r["loss"] is not None for r in results) == world // pp
    for r in results:
        assert r["names"] == names
        assert torch.equal(r["norms"].norms, first["norms"].norms)  # identical on every rank
        assert torch.allclose(r["norms"].norms, want, rtol=1e-5, atol=0)
        assert r["norms"].global_norm == pytest.approx(r["megatron_norm"], rel=1e-5)
        assert r["norms"].global_norm == pytest.approx(r["ref_global"], rel=1e-5)
        # one all-reduce of U + 1 values, nothing else (no gradient gathered)
        assert r["calls"] == [("all_reduce", len(names) + 1)]
        if r["loss"] is not None:
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        if tp > 1:  # layernorms and row-parallel biases counted twice by the naive sum
            assert r["naive"].global_norm > r["norms"].global_norm * (1 + 1e-4)
    if steps:
        spiked = names.index(SPIKE_UNIT)
        decisions = first["decisions"]
        for r in results[1:]:
            for (a, c, risk), (a2, c2, risk2) in zip(decisions, r["decisions"], strict=True):
                assert (a, c) == (a2, c2) and torch.equal(risk, risk2)
        active, _, risk = decisions[29]
        assert spiked in active and int(risk.argmax()) == spiked
