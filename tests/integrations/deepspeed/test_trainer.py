"""The "gnmr" block under Hugging Face ``Trainer`` (turned on by ``GNMRCallback``) and a plain
``accelerate`` loop with DeepSpeed (turned on by ``gnmr_dist.deepspeed.enable()``): real
transformers, accelerate and DeepSpeed, 2 ranks over gloo on CPU."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from tests.requires import require

require("deepspeed")
require("accelerate")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

STEPS = 6
"""Optimizer steps of the accelerate loop."""
TRAINER_STEPS, LOGGING_STEPS, TRAINER_SPIKE = 10, 5, 6
"""The Trainer run logs every 5 steps; its spike comes between two logs."""
GNMR = {
    "backend": "act_quant",
    "max_active": 2,
    "lock_steps": 2,
    "warmup_steps": 2,
    "alpha": 1.05,
    "beta": 1.2,
    "check_consistency": True,
}
"""``check_consistency``: each decision is hash-compared across the ranks (fails if they differ)."""
SPIKED, SPIKE_STEP = "model.layers.1.mlp.down_proj", 4


def _spike(model, step: int, factor: float = 100.0) -> None:
    """Multiply the gradient of ``SPIKED``'s weight by ``factor`` in backward number ``step``
    (one backward per optimizer step here): a fault in one unit, on every rank."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return grad * factor if calls[0] == step else grad

    model.get_submodule(SPIKED).weight.register_hook(hook)


def _train(out_dir: str, name: str, stage: int, world: int, resume: str | None) -> dict:
    """One Trainer run with GNMRCallback (checkpoint and log every 5 steps)."""
    from transformers import Trainer

    from gnmr_dist import GNMRCallback

    config = dsc.ds_config(stage, gnmr={**GNMR, "log": {"trace": f"{out_dir}/{name}.jsonl"}})
    args = dsc.trainer_args(
        f"{out_dir}/{name}",
        config,
        TRAINER_STEPS,
        logging_steps=LOGGING_STEPS,
        save_strategy="steps",
        save_steps=LOGGING_STEPS,
    )
    model = dsc.llama()
    after = 0 if resume is None else LOGGING_STEPS  # the same optimizer step after a resume
    _spike(model, TRAINER_SPIKE - after)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dsc.Rows(TRAINER_STEPS * world),
        callbacks=[GNMRCallback()],
    )
    trainer.train(resume_from_checkpoint=resume)
    engine, history = trainer.model_wrapped, trainer.state.log_history
    return {
        "has_gnmr": hasattr(engine, "gnmr"),
        "decisions": int(engine.gnmr.controller.step_count),
        "logged": {e["step"]: e["grad_norm"] for e in history if "grad_norm" in e},
        "gnmr_logs": dsc.gnmr_logs(history),
        "recovered_at": {
            e["step"]: e["gnmr/recovered_at"] for e in history if "gnmr/recovered_at" in e
        },
    }


def _trainer_worker(rank, world, out_dir, stage):
    """The Trainer run, the same run resumed from its checkpoint-5, plain engines after."""
    import deepspeed

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    original = deepspeed.initialize
    full = _train(out_dir, "full", stage, world, None)
    with _console_lines() as lines:  # what a user with logging configured sees
        resumed = _train(out_dir, "resumed", stage, world, f"{out_dir}/full/checkpoint-5")
    resumed["console"] = [m for m in lines if "restored" in m]
    resumed["report"] = [m for m in lines if "unit-steps" in m or "non-finite" in m]
    restored = deepspeed.initialize is original  # the callback disabled what it enabled
    gds.enable()
    gds.enable()  # idempotent: still one wrapper, no recursion
    try:
        said = _warnings_of_plain_engines(twice=True)
    finally:
        gds.disable()
    return {"full": full, "resumed": resumed, "said": said, "restored": restored}


@contextlib.contextmanager
def _console_lines() -> Iterator[list[str]]:
    """The GNMR console lines logged inside the block (a handler on ``gnmr_dist.console``)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("gnmr_dist.console")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _warnings_of_plain_engines(twice: bool) -> list[str]:
    """Warnings logged while ``deepspeed.initialize`` builds engines without a "gnmr" block."""
    import logging

    import deepspeed

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("gnmr_dist.integrations.deepspeed")
    log.addHandler(handler)
    try:
        for _ in range(2 if twice else 1):
            deepspeed.initialize(model=dsc.llama(), config=dsc.ds_config(0))
    finally:
        log.removeHandler(handler)
    return [m for m in records if "no enabled" in m]


def _trace(path) -> tuple[list[str], list[dict]]:
    lines = path.read_text().splitlines()
    return json.loads(lines[0])["units"], [json.loads(x) for x in lines[1:]]


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_a_gnmr_block(tmp_path, stage):
    a, b = multiproc.run(_trainer_worker, 2, str(tmp_path), stage)
    full = a["full"]
    assert full["has_gnmr"] and b["full"]["has_gnmr"]
    assert len(a["said"]) == 1 and 'has no enabled "gnmr" block' in a["said"][0]  # once
    assert a["restored"]  # the callback put DeepSpeed's own function back
    assert full["decisions"] == b["full"]["decisions"] == TRAINER_STEPS  # one per step
    names, rows = _trace(tmp_path / "full.jsonl")
    spiked = names.index(SPIKED)
    assert spiked in rows[TRAINER_SPIKE - 1]["active"]  # selected (on both ranks)
    ours = [r["extra"]["global_norm"] for r in rows]
    assert len(ours) == TRAINER_STEPS and min(ours) > 0
    logged = full["logged"]  # Trainer's grad_norm, pre-clipping, at its logging steps
    assert sorted(logged) == [5, 10]
    assert [logged[5], logged[10]] == pytest.approx([ours[4], ours[9]], rel=1e-5)
    # GNMR's interval in Trainer's own logs, at Trainer's steps (the spike is at step 6)
    logs = full["gnmr_logs"]
    assert [e["step"] for e in logs] == [e["gnmr/step"] for e in logs] == [5, 10]
    assert [e["gnmr/steps"] for e in logs] == [5, 5]
    for entry, window in zip(logs, (rows[:5], rows[5:]), strict=True):
        tele = [r["telemetry"] for r in window]
        assert entry["gnmr/max_risk"] == max(t["max_risk"] for t in tele)
        assert entry["gnmr/num_exceed"] == sum(t["num_exceed"] for t in tele)
        norms = [r["extra"]["global_norm"] for r in window]
        assert entry["gnmr/global_grad_norm"] == pytest.approx(sum(norms) / 5, rel=1e-12)
    spike_risk = rows[TRAINER_SPIKE - 1]["telemetry"]["max_risk"]
    assert logs[1]["gnmr/max_risk"] >= spike_risk > logs[0]["gnmr/max_risk"]
    assert logs[1][f"gnmr/recovered/{SPIKED}"] >= 1  # the unit, in the interval's entry
    # the run's accounting in the same entries: totals, and the units whose count changed
    ran = [sum(len(r["active"]) for r in rows[: s - 1]) for s in (5, 10)]  # plans that ran
    total = "gnmr/accounting/recovered_unit_steps"
    assert [e[total] for e in logs] == ran and ran[1] > 0
    assert [e["gnmr/accounting/nonfinite_unit_steps"] for e in logs] == [0, 0]
    assert logs[1][f"gnmr/accounting/recovered/{SPIKED}"] >= 1
    assert not any(k.startswith("gnmr/accounting/nonfinite/") for e in logs for k in e)
    # ... continued by the resumed run (its log at step 10), and reported at its end
    again = a["resumed"]["gnmr_logs"][-1]
    assert again["step"] == 10
    assert again[total] == logs[1][total]
    assert again["gnmr/accounting/recovered_share"] == logs[1]["gnmr/accounting/recovered_share"]
    report = a["resumed"]["report"]
    assert report[0].startswith(f"gnmr: {TRAINER_STEPS} steps, 14 units: recovered {ran[1]} of")
    assert report[1] == "gnmr: no non-finite gradient norm in the run"
    assert not b["resumed"]["report"]  # rank 0 writes it
    recovered_at = full["recovered_at"][10][SPIKED]
    assert TRAINER_SPIKE + 1 in recovered_at  # decided at the spike, recovered the step after
    assert all(spiked in rows[s - 2]["active"] for s in recovered_at)  # the plan that ran
    # resume_from_checkpoint: the uninterrupted run's decisions from step 6 on
    assert a["resumed"]["decisions"] == b["resumed"]["decisions"] == TRAINER_STEPS
    (said,) = a["resumed"]["console"]  # rank 0 says it, once
    assert (
        said.startswith("gnmr: state restored at controller step 5 from ")
        and not b["resumed"]["console"]
    )
    assert said.endswith("checkpoint-5/global_step5/gnmr_state.pt")
    _, resumed = _trace(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == list(range(6, TRAINER_STEPS + 1))
    for want, got in zip(rows[5:], resumed, strict=True):
        assert got["active"] == want["active"]
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)


def _accelerate_worker(rank, world, out_dir):
    """A plain accelerate loop: accelerate's DeepSpeed wrapper steps the engine in backward()."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    config = dsc.ds_config(2, gnmr={**GNMR, "log": {"trace": f"{out_dir}/trace.jsonl"}})
    del config["optimizer"]  # the loop's own torch optimizer
    model = dsc.llama()
    _spike(model, SPIKE_STEP)
    with gds.enable():
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, optimizer = accelerator.prepare(model, optimizer)
        norms = []
        for step in range(1, STEPS + 1):
            batch = dsc.batch(step, rank)
            accelerator.backward(engine(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            norms.append(float(engine.get_global_grad_norm()))
    return {"decisions": int(engine.gnmr.controller.step_count), "ds_norms": norms}


def test_plain_accelerate_loop(tmp_path):
    a, b = multiproc.run(_accelerate_worker, 2, str(tmp_path))
    assert a["decisions"] == b["decisions"] == STEPS
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    rows, names = [json.loads(x) for x in lines[1:]], json.loads(lines[0])["units"]
    assert [r["extra"]["global_norm"] for r in rows] == pytest.approx(a["ds_norms"], rel=1e-5)
    assert names.index(SPIKED) in rows[SPIKE_STEP - 1]["active"]


def test_the_lora_example_runs_on_cpu(tmp_path):
    """``examples/trainer_lora_int8.py`` as its docstring runs it: 2 processes, a tiny local
    Llama, peft LoRA, the int8 backend, the block from ``examples/trainer_lora_int8.json``."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    script = str(root / "examples" / "trainer_lora_int8.py")
    args = shlex.split("--make-tiny tiny --model tiny --max-steps 4 --output-dir out")
    cmd = [*multiproc.torchrun(2), script, *args]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout + done.stderr
    assert "int8 backend wrapped 14 units" in out and "gnmr step 4 | samples 16 |" in out
    names, rows = _trace(tmp_path / "runs" / "trainer_lora_int8" / "trace.jsonl")
    assert len(names) == 14 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(".lora_" not in n for n in names)  # one unit per projection, adapters inside it


def test_the_callback_refuses_a_run_without_deepspeed(tmp_path):
    """A Trainer without a DeepSpeed config has no engine for GNMR: refused when the Trainer is
    made, and GNMR turned off again."""
    from transformers import Trainer, TrainingArguments

    from gnmr_dist import GNMRCallback
    from gnmr_dist.integrations.deepspeed import engine as gds

    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True
    )
    before = gds.is_enabled()
    callback = GNMRCallback()
    with pytest.raises(
        ValueError, match=r"^GNMRCallback: TrainingArguments.deepspeed is not set.*the callback$"
    ):  # at the end of Trainer.__init__, before any training set-up
        Trainer(model=dsc.llama(), args=args, train_dataset=dsc.Rows(2), callbacks=[callback])
    assert gds.is_enabled() == before  # as the callback found it


def test_the_callback_warns_once_when_the_deepspeed_config_has_no_gnmr_block(tmp_path, caplog):
    import logging

    from transformers import TrainingArguments

    from gnmr_dist import GNMRCallback
    from gnmr_dist.integrations.deepspeed import engine as gds

    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=dsc.ds_config(2), report_to=[])
    before = gds.is_enabled()
    callback = GNMRCallback()
    with caplog.at_level(logging.WARNING, logger="gnmr_dist"):
        callback.on_train_begin(args, None, None)
        callback.on_train_begin(args, None, None)
    callback.on_train_end(args, None, None)
    said = [r.getMessage() for r in caplog.records if 'no "gnmr" block' in r.getMessage()]
    assert len(said) == 1 and "GNMR is off for this run" in said[0]
    assert gds.is_enabled() == before


def test_enable_owns_both_patches_and_disable_puts_the_originals_back():
    """``deepspeed.initialize`` and ``Trainer.log`` are replaced by one ``enable()`` and are the
    original objects again after ``disable()``; ``is_enabled`` follows."""
    import deepspeed
    from transformers import Trainer

    import gnmr_dist.deepspeed as gds

    assert not gds.is_enabled()
    initialize, log = deepspeed.initialize, vars(Trainer)["log"]
    gds.enable()
    try:
        assert gds.is_enabled()
        assert deepspeed.initialize is not initialize and vars(Trainer)["log"] is not log
        assert Trainer.log.__wrapped__ is log  # functools.wraps: the one wrapper of the original
    finally:
        gds.disable()
    assert not gds.is_enabled()
    assert deepspeed.initialize is initialize and vars(Trainer)["log"] is log


def test_a_bad_block_is_refused_in_one_line_when_the_trainer_is_made(tmp_path):
    """Issue 33, item 4: a bad block surfaced only inside ``trainer.train()`` (accelerate ->
    ``deepspeed.initialize``), as a 14-frame traceback per rank, after model and data set-up."""
    from transformers import Trainer, TrainingArguments

    from gnmr_dist import GNMRCallback
    from gnmr_dist.integrations.deepspeed import engine as gds

    config = dsc.ds_config(0, gnmr={"backend": "act_quant", "max_activ": 2})
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=config, report_to=[])
    before = gds.is_enabled()
    with pytest.raises(ValueError) as err:
        Trainer(model=dsc.llama(), args=args, train_dataset=dsc.Rows(2), callbacks=[GNMRCallback()])
    assert str(err.value).startswith("GNMRCallback: unknown key gnmr.max_activ; ")
    assert "did you mean 'max_active'?" in str(err.value) and "\n" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert gds.is_enabled() == before


def one_step_trainer(out_dir: str, world: int, config: dict, callbacks: list):
    """One Trainer step on ``config`` (its batch size and learning rate set to ``"auto"``);
    returns the engine Trainer built."""
    from transformers import Trainer

    args = dsc.trainer_args(out_dir, config, 1, learning_rate=5e-5)  # Trainer's default
    trainer = Trainer(
        model=dsc.llama(), args=args, train_dataset=dsc.Rows(world), callbacks=callbacks
    )
    trainer.train()
    return trainer.model_wrapped


def _no_block_worker(rank: int, world: int, out_dir: str) -> list[str]:
    """A Trainer run with GNMRCallback and a DeepSpeed config without a block: the warnings."""
    import logging

    from gnmr_dist import GNMRCallback

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gnmr_dist").addHandler(handler)
    one_step_trainer(out_dir, world, dsc.ds_config(0), [GNMRCallback()])
    return [m for m in records if '"gnmr" block' in m]


def test_a_config_without_a_block_is_warned_of_once_not_twice(tmp_path):
    """Issue 33, item 4: the callback and the engine each warned; now only the callback does,
    when the Trainer is made."""
    said = multiproc.run(_no_block_worker, 1, str(tmp_path))[0]
    assert len(said) == 1 and said[0].startswith("gnmr: GNMRCallback is on, but the DeepSpeed")
