"""The torchtitan 0.3 converter against torchtitan's real classes, on the CPU.

torchtitan is not a dependency of this project: its 0.3.0 models import ``triton`` (a 285 MB
wheel), so ``make test`` installs both in their own folder (``.venv/torchtitan``), which this
module appends to ``sys.path``; elsewhere the tests are skipped (under ``CI=true``, failed).
What runs is torchtitan's own: ``model_registry`` with the converters list, its Llama 3 debug
model (one layer, its attention switched to torchtitan's SDPA module: flex attention has no CPU
backward), the meta-device build, ``init_weights``, its ``OptimizersContainer`` and
``clip_grad_norm_``, in the order of ``Trainer.train_step``. The reference is torchtitan's own
``Float8LinearConverter``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.requires import require

TITAN = Path(sys.prefix) / "torchtitan"  # `make test` installs it there (the Makefile)
if TITAN.is_dir() and str(TITAN) not in sys.path:
    sys.path.append(str(TITAN))  # after the venv's own packages: it only adds torchtitan's
require("torchtitan.protocols.model")
require("torchtitan.models.llama3")
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

from gnmr_dist.integrations.torchtitan import GNMRConverter, check_parallelism, session_of

pytestmark = pytest.mark.slow
EMULATED = {"recipe": "tensorwise", "emulate": True}
ACTS = {"warmup_steps": 0, "alpha": 1.0, "beta": 1.0, "lock_steps": 1, "gamma": 1e-6}


def build(converters: list) -> torch.nn.Module:
    """torchtitan's Llama 3 debug model, one layer, built as ``Trainer`` builds it."""
    cfg = model_registry("debugmodel", attn_backend="flex", converters=converters).model
    cfg.layers = cfg.layers[:1]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # a CPU backward
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def train(model: torch.nn.Module, steps: int, micro: int = 1, seen: list | None = None) -> list:
    """``Trainer.train_step``'s order: zero_grad, forward/backward per micro-batch, torchtitan's
    clip, the container's step. ``seen``: the backend's report after each step."""
    optimizers = default_adamw(lr=1e-3, foreach=True).build(model_parts=[model])
    losses = []
    for s in range(steps):
        optimizers.zero_grad()
        for m in range(micro):
            gen = torch.Generator().manual_seed(100 * s + m)
            tok = torch.randint(0, 2048, (2, 17), generator=gen)
            pred = model(tok[:, :-1])
            loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), tok[:, 1:].flatten())
            loss.backward()
            losses.append(float(loss.detach()))
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        session = session_of(model)
        report = None if session is None else session.backend.report()
        optimizers.step()
        if seen is not None:  # what ran this step, and the plan decided for the next
            seen.append((report, frozenset(session.runtime.plan.active)))
    return losses


def test_one_name_is_torchtitans_float8_converter_until_the_first_recovery():
    """With nothing recovered, the model GNMR's converter builds trains bit for bit as the one
    torchtitan's ``Float8LinearConverter`` builds (emulated: its only CPU mode), the output
    projection left out by both; without either, it trains otherwise."""
    gnmr = GNMRConverter.Config(gnmr={"backend": "torchao_fp8", "low_cost": EMULATED})
    ours = build([gnmr])
    theirs = build([Float8LinearConverter.Config(emulate=True, filter_fqns=["lm_head"])])
    plain = build([])
    theirs.load_state_dict(ours.state_dict())
    plain.load_state_dict(ours.state_dict())
    assert type(theirs.layers["0"].feed_forward.w1).__name__ == "Float8Linear"
    assert type(ours.layers["0"].feed_forward.w1).__name__ == "Linear"  # no module swapped
    got, want = train(ours, 2), train(theirs, 2)
    assert got == want and got != train(plain, 2)
    pairs = zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    s = session_of(ours)
    assert (s.step, s.decisions, s.runtime.registry.num_units) == (2, 2, 5)  # layers.0's linears


def test_the_plan_before_each_forward_one_decision_per_step():
    """Real ``torch._scaled_mm`` casts, two micro-batches a step: the plan is applied once, at
    the step's first forward, and is the decision the previous step's optimizer hook took;
    one decision per step although torchtitan's container and its AdamW both step."""
    block = {"backend": "torchao_fp8", "max_active": 2, **ACTS}
    model = build([GNMRConverter.Config(gnmr=block)])
    s = session_of(model)
    seen: list = []
    train(model, 4, micro=2, seen=seen)
    reports, decided = zip(*seen, strict=True)
    assert s.decisions == 4 and s.step == 4
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert [r.planned for r in reports] == [frozenset(), *decided[:3]]
    assert any(r.recovered for r in reports) and all(len(r.recovered) <= 2 for r in reports)
    s.disable()
    assert session_of(model) is None


def test_refused_by_name():
    with pytest.raises(ValueError, match="remove Float8LinearConverter"):
        model_registry(
            "debugmodel",
            converters=[Float8LinearConverter.Config(emulate=True), GNMRConverter.Config()],
        )
    with pytest.raises(ValueError, match=r"gnmr\.probe is not run"):
        GNMRConverter.Config(gnmr={"backend": "torchao_fp8", "probe": {"every": 10}}).build()

    class Parallelism:
        tensor_parallel_degree = 2

    with pytest.raises(ValueError, match=r"parallelism\.tensor_parallel_degree=2"):
        check_parallelism(Parallelism())


def _fsdp_rank(rank: int, init: str, out: str) -> None:
    """One of 2 gloo ranks: the converted model built on the meta device, ``fully_shard`` per
    layer and at the root with torchtitan's summed gradients, then ``to_empty`` and
    ``init_weights``, as torchtitan's FSDP path does; 4 steps on this rank's own batches."""
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    block = {"backend": "torchao_fp8", "max_active": 2, "check_consistency": True, **ACTS}
    cfg = model_registry("debugmodel", converters=[GNMRConverter.Config(gnmr=block)]).model
    cfg.layers = cfg.layers[:1]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        model = cfg.build()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    disable_fsdp_gradient_division(model)  # torchtitan sums the ranks' gradients
    for m in model.modules():  # as a plain SUM: gloo has no PREMUL_SUM
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    seen: list = []
    torch.manual_seed(rank)  # this rank's batches
    train(model, 4, seen=seen)
    plans = [sorted(r.planned) for r, _ in seen]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"plans": plans, "decisions": session_of(model).decisions}, f)
    dist.destroy_process_group()


def test_fsdp2_on_two_ranks_takes_the_same_decisions(tmp_path):
    """FSDP2 over 2 gloo ranks: each rank scores its gradient shard and its own ``B(u)``, one
    all-reduce, and both run the same plans (``check_consistency`` compares them every step)."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "plans")
    init = f"file://{tmp_path / 'init'}"
    mp.spawn(_fsdp_rank, args=(init, out), nprocs=2, join=True)
    a, b = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert a == b and a["decisions"] == 4
    assert any(a["plans"][1:])  # something was recovered
