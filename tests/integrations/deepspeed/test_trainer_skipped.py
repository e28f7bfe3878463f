"""Issue 41, item 6, under Hugging Face Trainer: the attempts DeepSpeed skips (a non-finite
gradient) are in Trainer's per-interval ``gnmr/*`` entries, as the trace and the summary count
them. Before, ``gnmr/num_nonfinite`` summed the decisions only, so a skipped attempt's
non-finite unit was missing, and an interval of skipped attempts only had no entry at all.

Real transformers, accelerate and DeepSpeed (ZeRO-2 fp32, which skips a step whose gradient norm
is not finite), 2 ranks over gloo, ``GNMRCallback``; a log every 2 of 6 steps:

* attempt 2: a NaN in one unit's gradient (skipped): the interval 1-2 has 1 decision and 1
  skipped attempt with 1 non-finite unit;
* attempts 3-4: 2 decisions;
* attempts 5-6: an inf in the embedding's gradient (no unit) twice: 0 decisions, 2 skipped
  attempts, no non-finite unit.

Trainer's ``step`` counts attempts, GNMR's ``gnmr/step`` the applied steps (docs/trainer.md):
``step == gnmr/step + sum of gnmr/skipped_steps`` in every entry.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.requires import require

require("deepspeed")
require("accelerate")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

STEPS, LOGGING = 6, 2
POISONED = "model.layers.0.self_attn.v_proj"
NAN_IN_UNIT, INF_OUTSIDE = {2}, {5, 6}


def _poison(model) -> None:
    """NaN in ``POISONED``'s gradient at backward 2, inf in the embedding's at 5 and 6 (one
    backward per optimizer step)."""

    def at(attempts: set[int], value: float):
        calls = [0]

        def hook(grad):
            calls[0] += 1
            return grad * value if calls[0] in attempts else grad

        return hook

    model.get_submodule(POISONED).weight.register_hook(at(NAN_IN_UNIT, math.nan))
    model.model.embed_tokens.weight.register_hook(at(INF_OUTSIDE, math.inf))


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from transformers import Trainer

    from gnmr_dist import GNMRCallback

    dsc.no_shm_build()
    block = dsc.gnmr_block(log={"trace": f"{out_dir}/trace.jsonl", "console": False})
    config = dsc.ds_config(2, gnmr=block)
    args = dsc.trainer_args(f"{out_dir}/run", config, STEPS, logging_steps=LOGGING)
    model = dsc.llama()
    _poison(model)
    trainer = Trainer(
        model=model, args=args, train_dataset=dsc.Rows(STEPS * world), callbacks=[GNMRCallback()]
    )
    trainer.train()
    engine = trainer.model_wrapped
    logs = dsc.gnmr_logs(trainer.state.log_history)
    return {"logs": logs, "skipped": engine.skipped_steps, "summary": engine.gnmr.summary()}


def test_trainer_logs_count_the_attempts_deepspeed_skipped(tmp_path):
    results = multiproc.run(_worker, 2, str(tmp_path))
    logs = results[0]["logs"]
    assert results[1]["logs"] == logs  # the same entries on both ranks
    # the premise: DeepSpeed skipped attempts 2, 5 and 6
    assert [r["skipped"] for r in results] == [3, 3]
    assert [e["step"] for e in logs] == [2, 4, 6]
    assert [e["gnmr/steps"] for e in logs] == [1, 2, 0]
    assert [e["gnmr/skipped_steps"] for e in logs] == [1, 0, 2]
    assert [e["gnmr/num_nonfinite"] for e in logs] == [1, 0, 0]
    assert [e["gnmr/step"] for e in logs] == [1, 3, 3]
    for i, entry in enumerate(logs):  # Trainer's step: GNMR's plus the attempts skipped so far
        skipped = sum(e["gnmr/skipped_steps"] for e in logs[: i + 1])
        assert entry["step"] == entry["gnmr/step"] + skipped
    # an interval without a decision has no risk and no gradient norm to report
    assert "gnmr/max_risk" in logs[1] and "gnmr/max_risk" not in logs[2]
    assert "gnmr/global_grad_norm" not in logs[2]
    # the entries agree with the run's accounting and with the trace
    summary = results[0]["summary"]
    assert summary.nonfinite_unit_steps == sum(e["gnmr/num_nonfinite"] for e in logs) == 1
    assert [e["gnmr/accounting/nonfinite_unit_steps"] for e in logs] == [1, 1, 1]
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    names, records = json.loads(lines[0])["units"], [json.loads(x) for x in lines[1:]]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r.get("skipped_steps", 0) for r in records] == [0, 1, 0]  # 5 and 6: no step after
    assert records[1]["skipped_nonfinite"] == [names.index(POISONED)]
