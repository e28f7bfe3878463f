"""``torchao_fp8`` under real DeepSpeed ZeRO-2 (BF16, 2 gloo ranks, CPU) and Hugging Face Trainer.

Until the controller first recovers a unit, the GNMR run is bit for bit plain DeepSpeed training
the model torchao's ``convert_to_float8_training`` converted (the same losses, step by step, on
both ranks); a gradient spike in one projection then moves it to BF16, every rank runs the same
plan, and the damage term (``gamma``) reaches the controller from torchao's casts. The Trainer
run (``GNMRCallback``) switches the same backend through accelerate's DeepSpeed engine.
"""

from __future__ import annotations

import pytest

from tests.requires import require

require("deepspeed")
require("torchao")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

STEPS, SPIKE = 7, 5
SPIKED = "model.layers.1.mlp.down_proj"
BLOCK = dsc.gnmr_block(
    backend="torchao_fp8",
    low_cost={"recipe": "tensorwise"},
    recovery={"recipe": "bf16"},
    gamma=0.5,
    alpha=1.5,
)


def _spike(model, step: int) -> None:
    """``SPIKED``'s weight gradient x100 in backward number ``step``, on every rank."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return grad * 100 if calls[0] == step else grad

    model.get_submodule(SPIKED).weight.register_hook(hook)


def _step(engine, rank, step, ran=None):
    tokens = dsc.batch(step, rank)
    loss = engine(input_ids=tokens, labels=tokens).loss
    if ran is not None:  # what this step's forward ran (the next apply resets the report)
        ran.append(sorted(engine.gnmr.backend.report().recovered))
    engine.backward(loss)
    engine.step()
    return loss.detach().float().item()


def _worker(rank, world):
    import deepspeed
    from torchao.float8 import convert_to_float8_training

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    names = set(dsc.unit_names())
    plain = dsc.llama()
    convert_to_float8_training(plain, module_filter_fn=lambda _, fqn: fqn in names)
    engine, *_ = deepspeed.initialize(model=plain, config=dsc.ds_config(2, "bf16"))
    reference = [_step(engine, rank, step) for step in range(1, STEPS + 1)]

    model = dsc.llama()
    _spike(model, SPIKE)
    engine, *_ = gds.initialize(model=model, config=dsc.ds_config(2, "bf16", BLOCK))
    losses, plans, errors = [], [], []
    for step in range(1, STEPS + 1):
        losses.append(_step(engine, rank, step, plans))
        errors.append(engine.gnmr.last_decision.error.tolist())
    return {
        "reference": reference,
        "losses": losses,
        "plans": plans,
        "errors": errors,
        "names": engine.gnmr.registry.names,
        "dtype": str(next(engine.module.parameters()).dtype),
    }


def test_zero2_bf16_runs_torchaos_fp8_until_gnmr_recovers_a_unit():
    a, b = multiproc.run(_worker, 2)
    assert a["dtype"] == "torch.bfloat16" and a["names"] == tuple(dsc.unit_names())
    assert a["plans"] == b["plans"] and a["errors"] == b["errors"]  # rank-identical
    first = next(i for i, p in enumerate(a["plans"]) if p)
    assert first >= SPIKE  # nothing recovered before the spike's step has been scored
    unit = a["names"].index(SPIKED)
    assert unit in a["plans"][first]
    for r in (a, b):  # before the first recovery: plain DeepSpeed on torchao's Float8Linear
        assert r["losses"][:first] == r["reference"][:first]
        assert r["losses"][first:] != r["reference"][first:]
    for e in a["errors"][1:]:  # B(u) / G of every projection, from torchao's casts
        assert len(e) == 14 and all(0 < v < 1 for v in e)


# ---------------------------------------------------------------------- Hugging Face Trainer

TRAINER_STEPS, TRAINER_SPIKE = 7, 5


def _trainer(out_dir, world, gnmr: bool) -> dict:
    from torchao.float8 import convert_to_float8_training
    from transformers import Trainer

    from gnmr_dist import GNMRCallback

    block = {**BLOCK, "log": {"trace": f"{out_dir}/trace.jsonl"}} if gnmr else None
    config = dsc.ds_config(2, "fp32", block)  # Trainer refuses bf16 on a CPU
    output_dir = f"{out_dir}/{'gnmr' if gnmr else 'plain'}"
    args = dsc.trainer_args(output_dir, config, TRAINER_STEPS, logging_steps=1)
    model = dsc.llama()
    if gnmr:
        _spike(model, TRAINER_SPIKE)
    else:
        names = set(dsc.unit_names())
        convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in names)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dsc.Rows(TRAINER_STEPS * world),
        callbacks=[GNMRCallback()] if gnmr else [],
    )
    trainer.train()
    engine = trainer.model_wrapped
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "backend": type(engine.gnmr.backend).__name__ if gnmr else None,
    }


def _trainer_worker(rank, world, out_dir):
    dsc.no_shm_build()
    return {"gnmr": _trainer(out_dir, world, True), "plain": _trainer(out_dir, world, False)}


def test_trainer_switches_torchaos_fp8_through_the_engine(tmp_path):
    import json

    a, b = multiproc.run(_trainer_worker, 2, str(tmp_path))
    assert a["gnmr"]["backend"] == "TorchaoFp8Backend"
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    names, rows = json.loads(lines[0])["units"], [json.loads(x) for x in lines[1:]]
    assert len(rows) == TRAINER_STEPS
    spiked = names.index(SPIKED)
    first = next(i for i, r in enumerate(rows) if r["active"])
    assert first == TRAINER_SPIKE - 1 and spiked in rows[first]["active"]
    # the steps before the first recovered one: the plain Trainer on torchao's Float8Linear
    for r in (a, b):
        assert r["gnmr"]["losses"][: first + 1] == r["plain"]["losses"][: first + 1]
