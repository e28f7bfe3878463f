"""A restart whose GNMR state is missing or corrupt, with ``"fresh"`` chosen, loses no trace record
(issue 33, item 2): the earlier trace is set aside, the new one names it."""

from __future__ import annotations

import json
from pathlib import Path

from tests import multiproc
from tests.integrations.deepspeed import common as dsc


def _run_worker(rank: int, world: int, ckpt: str, trace: str, phase: str) -> int:
    """``first``: 6 steps and a checkpoint; ``missing`` / ``corrupt``: that checkpoint with its
    GNMR state removed or overwritten, resumed with the matching ``on_*_state: "fresh"``, 3
    steps. Returns the controller's step count after loading."""
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    block = {**dsc.gnmr_block(), "log": {"trace": trace}}
    block |= {"on_missing_state": "fresh", "on_corrupt_state": "fresh"}
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(1, "fp32", block))
    steps = range(1, 7)
    if phase != "first":
        state = Path(ckpt, "global_step6", "gnmr_state.pt")
        if phase == "missing":
            state.unlink()
        else:
            state.write_bytes(b"not a GNMR state")
        engine.load_checkpoint(ckpt)
        steps = range(7, 10)
    loaded = engine.gnmr.controller.step_count
    for step in steps:
        loss = engine(input_ids=dsc.batch(step, rank), labels=dsc.batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
    if phase == "first":
        engine.save_checkpoint(ckpt)
    return loaded


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()[1:]]


def test_missing_and_corrupt_state_restarts_keep_every_record(tmp_path):
    ckpt, trace = str(tmp_path / "ckpt"), tmp_path / "trace.jsonl"
    for phase in ("first", "missing", "corrupt"):
        loaded = multiproc.run(_run_worker, 1, ckpt, str(trace), phase)[0]
        assert loaded == 0  # a fresh controller every time (the restarts found no usable state)
    assert _steps(tmp_path / "trace.1.jsonl") == [1, 2, 3, 4, 5, 6]  # the first run, whole
    assert _steps(tmp_path / "trace.2.jsonl") == [1, 2, 3]  # the missing-state restart
    assert _steps(trace) == [1, 2, 3]  # the corrupt-state restart
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["meta"]["previous_trace"] == "trace.2.jsonl"
