"""Issue 41, items 6 and 10: how a step DeepSpeed skips, and a restart whose GNMR state started
fresh, appear in the trace (real DeepSpeed 0.19, ZeRO-2 fp32, CPU, gloo).

GNMR's step ``t`` is the ``t``-th step the engine *applied* (the clock of DeepSpeed's own
``lr_scheduler``), ``engine.global_steps`` counts every attempt, so for every record

    step == (extra.engine_step - extra.engine_skipped_steps)
            - (meta.engine_step_at_start - meta.engine_skipped_at_start)

and the record of the step retried after skipped attempts says how many there were
(``skipped_steps``) and their non-finite units (``skipped_nonfinite``), also when the
non-finite gradient is outside every unit (the embedding here) and when the checkpoint was
saved right after the skipped attempt (the attempts not yet reported travel in the GNMR state).
Before: no ``engine_skipped_steps``, no ``skipped_steps``, a skip outside the units left no
trace at all, a skip just before a checkpoint was lost by the resumed run, and a fresh restart's
header did not say at which engine step GNMR started.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requires import require

require("deepspeed")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

IN_UNIT, OUTSIDE, SAVE_AT, LAST = 3, 5, 5, 9
"""Attempt 3: a NaN gradient in a unit; attempt 5: in the embedding (no unit); a checkpoint
right after attempt 5 (skipped); attempts up to 9. The resumed runs go on from attempt 6."""
POISONED = "model.layers.1.mlp.down_proj"


def _poison(engine, attempt: int):
    """The hook that makes this attempt's gradient non-finite (``None``: a clean attempt)."""
    model = engine.module.model
    if attempt == IN_UNIT:
        return model.layers[1].mlp.down_proj.weight.register_hook(lambda g: g * math.nan)
    if attempt == OUTSIDE:
        return model.embed_tokens.weight.register_hook(lambda g: g * math.inf)
    return None


def _worker(rank: int, world: int, tmp: str, phase: str) -> dict:
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gnmr_dist.console").addHandler(handler)
    logging.getLogger("gnmr_dist.console").setLevel(logging.INFO)
    block = dsc.gnmr_block(log={"trace": f"{tmp}/trace.jsonl", "console": False})
    block |= {"on_missing_state": "fresh"}
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(2, "fp32", block))
    first = 1
    if phase != "whole":
        if phase == "fresh":
            Path(tmp, "ckpt", f"global_step{SAVE_AT}", "gnmr_state.pt").unlink()
        engine.load_checkpoint(f"{tmp}/ckpt")
        first = SAVE_AT + 1
    pending = engine.gnmr.state_dict().get("skipped_pending")
    for attempt in range(first, LAST + 1):
        hook = _poison(engine, attempt)
        tokens = dsc.batch(attempt, rank)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        if hook is not None:
            hook.remove()
        if attempt == SAVE_AT and phase == "whole":
            pending = engine.gnmr.state_dict().get("skipped_pending")
            engine.save_checkpoint(f"{tmp}/ckpt")
    return {
        "pending": pending,
        "skipped": (engine.skipped_steps, engine.gnmr.skipped),
        "decisions": engine.gnmr.controller.step_count,
        "fresh": [x for x in lines if "starts fresh" in x],
    }


def _read(path: Path) -> tuple[dict, list[dict]]:
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def _applied(header: dict, record: dict) -> int:
    """The engine's applied steps since GNMR started, from the record and the header."""
    meta, extra = header["meta"], record["extra"]
    at_start = meta["engine_step_at_start"] - meta["engine_skipped_at_start"]
    return extra["engine_step"] - extra["engine_skipped_steps"] - at_start


def test_skipped_attempts_in_the_trace_through_a_resume_and_a_fresh_restart(tmp_path):
    trace = tmp_path / "trace.jsonl"
    (whole,) = multiproc.run(_worker, 1, str(tmp_path), "whole")
    shutil.copy(trace, tmp_path / "whole.jsonl")
    (resumed,) = multiproc.run(_worker, 1, str(tmp_path), "resumed")
    shutil.copy(trace, tmp_path / "resumed.jsonl")
    (fresh,) = multiproc.run(_worker, 1, str(tmp_path), "fresh")

    # the premise: DeepSpeed skipped attempts 3 and 5, GNMR decided the 7 others
    assert whole["skipped"] == resumed["skipped"] == (2, 2) and whole["decisions"] == LAST - 2
    header, records = _read(tmp_path / "whole.jsonl")
    assert header["meta"]["engine_step_at_start"] == header["meta"]["engine_skipped_at_start"] == 0
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["extra"]["engine_step"] for r in records] == [1, 2, 4, 6, 7, 8, 9]
    assert [r["extra"]["engine_skipped_steps"] for r in records] == [0, 0, 1, 2, 2, 2, 2]
    assert [_applied(header, r) for r in records] == [r["step"] for r in records]
    # each skipped attempt on the record of the step retried after it, with its units
    unit = dsc.unit_names().index(POISONED)
    assert [r.get("skipped_steps", 0) for r in records] == [0, 0, 1, 1, 0, 0, 0]
    assert records[2]["skipped_nonfinite"] == [unit]
    assert "skipped_nonfinite" not in records[3]  # the embedding is no unit: counted, not named
    assert sum(r.get("skipped_steps", 0) for r in records) == whole["skipped"][0]
    _tools_count_the_skipped_attempts(tmp_path / "whole.jsonl", unit)

    # the checkpoint was saved after attempt 5 was skipped and before its record: the state
    # carries it, and the resumed run writes exactly the uninterrupted run's records
    assert whole["pending"] == {"attempts": 1, "nonfinite": []}
    assert resumed["pending"] == whole["pending"]
    header_r, records_r = _read(tmp_path / "resumed.jsonl")
    assert header_r == header
    keys = ("step", "active", "skipped_steps", "skipped_nonfinite", "nonfinite")
    for got, want in zip(records_r, records, strict=True):
        assert {k: got.get(k) for k in keys} == {k: want.get(k) for k in keys}
        assert {k: got["extra"][k] for k in ("engine_step", "engine_skipped_steps")} == {
            k: want["extra"][k] for k in ("engine_step", "engine_skipped_steps")
        }
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-6)

    # the GNMR state removed: the controller starts fresh at engine step 5 (2 of its 5 skipped)
    assert fresh["decisions"] == LAST - SAVE_AT and fresh["skipped"] == (2, 0)
    assert fresh["pending"] is None
    header_f, records_f = _read(trace)
    assert header_f["meta"]["previous_trace"] == "trace.1.jsonl"
    assert header_f["meta"]["engine_step_at_start"] == SAVE_AT
    assert header_f["meta"]["engine_skipped_at_start"] == 2
    assert [r["step"] for r in records_f] == [1, 2, 3, 4]
    assert [r["extra"]["engine_step"] for r in records_f] == [6, 7, 8, 9]
    assert [_applied(header_f, r) for r in records_f] == [1, 2, 3, 4]
    assert not any("skipped_steps" in r for r in records_f)
    assert fresh["fresh"] == [
        f"gnmr: the controller starts fresh at engine step {SAVE_AT} and counts its steps from "
        "1 again (the trace: extra.engine_step in each record, meta.engine_step_at_start)"
    ]


def _tools_count_the_skipped_attempts(trace: Path, unit: int) -> None:
    """Issue 41, item 6: gnmr-replay and gnmr-report left the skipped attempts out; they count
    both (one in a unit, one in the embedding), and the replay still reproduces every decision."""
    from gnmr_dist.telemetry.report import draw_report

    summary = draw_report(trace, trace.with_suffix(".png"))
    assert summary["skipped_attempts"] == 2 and summary["nonfinite_steps"] == 0
    out = subprocess.run(
        [sys.executable, "-m", "gnmr_dist.cli.replay", str(trace)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "attempts the framework skipped (non-finite gradients): 2" in out.stdout
    assert f"decisions equal to the recorded ones: {LAST - 2}/{LAST - 2}" in out.stdout
