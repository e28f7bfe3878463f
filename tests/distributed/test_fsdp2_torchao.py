"""``torchao_fp8`` under FSDP2 (``fully_shard``, BF16 mixed precision, 2 gloo ranks on CPU).

The loop is docs/backends.md#torchao_fp8's: the backend wraps the plain model, ``fully_shard``
shards it, a :class:`~gnmr_dist.distributed.GNMRRuntime` over the world reads each rank's
gradient shard (``DTensor.to_local``) and the backend's error sums, and one all-reduce a step
gives every rank the same plan. Until the controller first recovers a unit the run is bit for
bit torchao's own FSDP2 recipe (``convert_to_float8_training`` then ``fully_shard``), with and
without torchao's FP8 all-gather of the weights; a gradient spike in one projection then moves
it to BF16 on both ranks.
"""

from __future__ import annotations

import pytest

from tests.requires import require

require("torchao")
require("transformers")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

STEPS, SPIKE = 7, 5
SPIKED = "model.layers.1.mlp.down_proj"
POLICY = {"max_active": 2, "lock_steps": 2, "warmup_steps": 3, "alpha": 1.5, "beta": 2.0}


def _shard(model):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, optimizer, rank, step):
    tokens = dsc.batch(step, rank)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss


def _reference(rank, all_gather):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(dsc.unit_names())
    model = dsc.llama()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, n: n in names)
    optimizer = _shard(model)
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(_step(model, optimizer, rank, step).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _gnmr(rank, world, all_gather):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from gnmr_dist import GNMRConfig
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

    model = dsc.llama()
    forwards = [0]

    def spike(module, args):  # FSDP2's unsharded weight is the autograd leaf of this forward
        forwards[0] += 1
        if forwards[0] == SPIKE:
            handle = module.weight.register_hook(lambda g: (handle.remove(), g * 100)[1])

    backend = get_backend("torchao_fp8", low_cost={"fsdp_float8_all_gather": all_gather})
    backend.wrap(UnitRegistry.from_model(model).local_modules)  # before fully_shard, as torchao
    backend.track_errors(len(dsc.unit_names()))
    optimizer = _shard(model)
    model.get_submodule(SPIKED).register_forward_pre_hook(spike)
    registry = UnitRegistry.from_model(model)  # the sharded parameters

    def local(p):
        return (
            None if p.grad is None else p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        )

    runtime = GNMRRuntime(
        registry,
        GNMRConfig(gamma=0.5, **POLICY),
        group=dist.group.WORLD,
        grad_fn=local,
        error_fn=backend.error_sums,
        error_scale=1.0 / world,  # each rank's B(u) is of its own loss; the gradient averages
    )
    losses, ran, calls, errors = [], [], [], []
    for step in range(1, STEPS + 1):
        backend.apply(runtime.plan.active, step)
        losses.append(_step(model, optimizer, rank, step).item())
        ran.append(sorted(backend.report().recovered))
        with multiproc.CollectiveSpy() as spy:
            decision = runtime.step(lr=1e-3)
        calls.append(spy.calls)
        errors.append(decision.error.tolist())
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "ran": ran,
        "calls": calls,
        "errors": errors,
        "names": registry.names,
        "weight": type(model.model.layers[0].mlp.up_proj.weight._local_tensor).__name__,
    }


def _worker(rank, world, all_gather):
    return {"ref": _reference(rank, all_gather), "gnmr": _gnmr(rank, world, all_gather)}


@pytest.mark.parametrize("all_gather", [False, True], ids=["bf16_all_gather", "fp8_all_gather"])
def test_fsdp2_runs_torchaos_recipe_until_gnmr_recovers_a_unit(all_gather):
    a, b = multiproc.run(_worker, 2, all_gather)
    g = a["gnmr"]
    wrapped = "WeightWithDynamicFloat8CastTensor" if all_gather else "Tensor"
    assert g["weight"] == wrapped
    assert g["ran"] == b["gnmr"]["ran"] and g["errors"] == b["gnmr"]["errors"]  # rank-identical
    u = len(dsc.unit_names())
    assert g["calls"] == [[("all_reduce", 2 * u + 1)]] * STEPS, g["calls"]  # one, with B(u)
    first = next(i for i, r in enumerate(g["ran"]) if r)
    assert first >= SPIKE and g["names"].index(SPIKED) in g["ran"][first]
    for r in (a, b):  # before the first recovery: torchao's own FSDP2 recipe, bit for bit
        assert r["gnmr"]["losses"][:first] == r["ref"][:first]
    for e in g["errors"][1:]:
        assert all(0 < v < 1 for v in e)
