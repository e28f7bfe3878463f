"""The distributed monitor in real gloo processes: exact norms, one all-reduce, same decisions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gnmr_dist import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, GradNormMonitor, UnitNorms, UnitRegistry
from tests import multiproc
from tests.distributed.toy import MARKS, Toy, full_model_with_grads, reference_unit_norms, shard

pytestmark = pytest.mark.slow


def layout_groups(world: int, tp: int):
    """(tp_group, this rank's tp rank, pp rank) with TP ranks adjacent, as megatron lays them."""
    rank = dist.get_rank()
    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    tp_group = tp_groups[rank // tp] if tp > 1 else None
    return tp_group, rank % tp, rank // tp


def _norms_worker(rank, world, tp, pp):
    tp_group, tp_rank, pp_rank = layout_groups(world, tp)
    full = full_model_with_grads()
    local = shard(full, tp, tp_rank, pp, pp_rank)
    reg = UnitRegistry.from_model(
        local,
        group=dist.group.WORLD,
        tp_group=tp_group,
        layer_offset=pp_rank * (4 // pp),
        marks=MARKS,
    )
    norms = GradNormMonitor(reg, group=dist.group.WORLD).compute()
    # the naive sum: every rank counts every parameter it holds, replicas included
    naive = UnitRegistry.from_model(
        local, group=dist.group.WORLD, tp_group=None, layer_offset=pp_rank * (4 // pp)
    )
    naive_norms = GradNormMonitor(naive, group=dist.group.WORLD).compute()
    return reg.names, norms, naive_norms


@pytest.mark.parametrize("world, tp, pp", [(2, 2, 1), (2, 1, 2), (4, 2, 2)])
def test_sharded_norms_equal_single_process_norms(world, tp, pp):
    full = full_model_with_grads()
    single = UnitRegistry.from_model(full)
    want, want_global = reference_unit_norms(full, list(single.names))
    results = multiproc.run(_norms_worker, world, tp, pp)
    for names, got, _ in results:
        assert names == single.names  # same ids at every layout
        assert torch.allclose(got.norms, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
        assert got.global_norm == pytest.approx(want_global, rel=1e-6)
        assert torch.equal(got.norms, results[0][1].norms)  # bit-identical on every rank
    if tp > 1:
        naive = results[0][2]
        # replicated norms/biases counted tp times: the rest bucket and fc2 (replicated bias) grow
        assert naive.global_norm > want_global * (1 + 1e-3)


def _count_worker(rank, world, steps):
    tp_group, tp_rank, _ = layout_groups(world, world)
    local = shard(full_model_with_grads(), world, tp_rank, 1, 0)
    reg = UnitRegistry.from_model(local, group=dist.group.WORLD, tp_group=tp_group, marks=MARKS)
    runtime = GNMRRuntime(reg, GNMRConfig(warmup_steps=0), group=dist.group.WORLD)
    per_step = []
    for _ in range(steps):
        with multiproc.CollectiveSpy(p2p=True) as spy:
            runtime.step()
        per_step.append(spy.calls)
    return reg.num_units, per_step


def test_exactly_one_small_all_reduce_per_step():
    for units, per_step in multiproc.run(_count_worker, 2, 5):
        assert per_step == [[("all_reduce", units + 1)]] * 5


def _spike_worker(rank, world, steps, spike_step):
    tp_group, tp_rank, _ = layout_groups(world, world)
    full = full_model_with_grads()
    local = shard(full, world, tp_rank, 1, 0)
    reg = UnitRegistry.from_model(local, group=dist.group.WORLD, tp_group=tp_group, marks=MARKS)
    runtime = GNMRRuntime(
        reg,
        GNMRConfig(max_active=2, warmup_steps=5),
        group=dist.group.WORLD,
        check_consistency=True,
    )
    base = {n: p.grad.clone() for n, p in local.named_parameters()}
    out = []
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(t)  # same "training noise" on every rank
        for n, p in local.named_parameters():
            p.grad.copy_(base[n] * (1 + 0.1 * torch.rand((), generator=g)))
        if t == spike_step and tp_rank == 1:  # one TP shard of one unit spikes
            local.get_parameter("layers.2.fc1.weight").grad.mul_(40.0)
        d = runtime.step()
        out.append((d.active, d.candidates, d.risk.clone()))
    return reg.names, out


def test_all_ranks_decide_the_same_and_select_the_spiked_unit():
    results = multiproc.run(_spike_worker, 2, 50, 30)
    names, decisions = results[0]
    for other_names, other in results[1:]:
        assert other_names == names
        for (a, c, r), (a2, c2, r2) in zip(decisions, other, strict=True):
            assert (a, c) == (a2, c2) and torch.equal(r, r2)
    spiked = names.index("layers.2.fc1")
    active_at = decisions[29][0]
    assert spiked in active_at and decisions[29][2][spiked] == decisions[29][2].max()
    assert all(spiked not in d[0] for d in decisions[:29])


def _mismatch_worker(rank, world):
    reg = UnitRegistry.from_model(Toy(), group=dist.group.WORLD)
    runtime = GNMRRuntime(
        reg,
        GNMRConfig(warmup_steps=0),
        group=None,
        check_group=dist.group.WORLD,
        check_consistency=True,
    )
    norms = torch.ones(reg.num_units, dtype=torch.float64)
    runtime.observe(UnitNorms(norms, 1.0, 1.0))
    if rank == 1:
        norms[3] = 50.0
    with pytest.raises(RuntimeError) as err:  # on every rank
        runtime.observe(UnitNorms(norms, 1.0, 1.0))
    return str(err.value)


def test_mismatch_check_names_the_ranks():
    for msg in multiproc.run(_mismatch_worker, 2):
        assert "differ across ranks at step 2" in msg
        assert "ranks [0] chose active=()" in msg and "ranks [1] chose active=(3,)" in msg


def test_single_process_is_the_degenerate_case():
    full = full_model_with_grads(spike={"layers.1.fc2.weight": 3.0})
    reg = UnitRegistry.from_model(full)
    got = GradNormMonitor(reg).compute()
    want, want_global = reference_unit_norms(full, list(reg.names))
    assert got.norms.tolist() == pytest.approx(want, rel=1e-6)
    assert got.global_norm == pytest.approx(want_global, rel=1e-6)
    clip = torch.nn.utils.clip_grad_norm_(full.parameters(), max_norm=math.inf)
    assert got.global_norm == pytest.approx(float(clip), rel=1e-6)
