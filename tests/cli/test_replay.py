"""Trace round trip and gnmr-replay: exact reproduction and the reported fractions."""

from __future__ import annotations

import json

import pytest
import torch

from gnmr_dist import GNMRController
from gnmr_dist.cli.replay import main
from gnmr_dist.telemetry import TraceWriter, read_errors, read_trace
from tests.cli.traces import ELIGIBLE, GAMMA_CFG, record_trace

UNITS = [f"layers.{i // 2}.{'qkv' if i % 2 == 0 else 'fc'}" for i in range(6)]


def record(path, steps=60):
    return record_trace(path, UNITS, steps=steps, meta={"run": "t"})


def test_trace_round_trip_is_exact(tmp_path):
    path = tmp_path / "trace.jsonl"
    cfg, decisions = record(path)
    header, norms, records = read_trace(path)
    assert header.units == tuple(UNITS) and header.config == cfg and header.meta == {"run": "t"}
    assert norms.shape == (60, 6) and torch.isnan(norms[30, 2])
    assert [tuple(r["active"]) for r in records] == [d.active for d in decisions]
    assert records[3]["extra"]["loss"] == 0.25


def test_replay_with_recorded_policy_reproduces_every_decision(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    _, decisions = record(path)
    assert main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["matches_recorded"] == 60
    scored = [d for d in decisions if d.step > 5]
    want_exceed = sum(d.telemetry.num_exceed_eligible for d in scored) / (len(scored) * 5)
    want_active = sum(len(d.active) for d in scored) / (len(scored) * 5)
    assert out["exceedance_rate"] == pytest.approx(want_exceed)
    assert out["recovery_rate"] == pytest.approx(want_active)
    assert out["nonfinite_steps"] == 1 and want_active > 0


def test_replay_with_other_settings(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    record(path)
    assert main([str(path), "--max-active", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recovery_rate"] == 0.0
    sched = '{"schedule": "linear", "start": 50, "end": 40, "steps": 10}'
    assert main([str(path), "--alpha", sched, "--beta", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # only the NaN step can exceed thresholds this loose
    assert out["exceedance_rate"] == pytest.approx(1 / (55 * 5))
    assert main([str(path)]) == 0
    assert "decisions equal to the recorded ones: 60/60" in capsys.readouterr().out


def test_replay_errors_are_clear(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    record(path, steps=3)
    assert main([str(path), "--window", "0"]) == 2
    assert "gnmr.window must be an integer >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    assert main([str(bad)]) == 2
    assert "is this a gnmr trace" in capsys.readouterr().err
    with path.open("a") as fh:
        fh.write('{"step": 4, "norms": [1.0, 2\n')
    assert main([str(path)]) == 2
    assert "truncated or corrupted record" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2


def test_resumed_trace_drops_records_after_the_checkpoint(tmp_path):
    path = tmp_path / "trace.jsonl"
    cfg, decisions = record(path, steps=30)  # the "interrupted" run got to step 30
    header, norms, _ = read_trace(path)
    # resume from a checkpoint taken at step 20: steps 21.. are decided again
    ctrl = GNMRController(6, cfg, eligible=ELIGIBLE)
    for row in norms[:20]:
        ctrl.step(row)
    with TraceWriter(path, header, resume_after=20) as w:
        for row in norms[20:]:
            w.write(row, ctrl.step(row))
    _, again, records = read_trace(path)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert torch.allclose(again, norms, equal_nan=True)
    assert [tuple(r["active"]) for r in records] == [d.active for d in decisions]


def test_trace_with_a_repeated_step_is_refused(tmp_path):
    path = tmp_path / "trace.jsonl"
    record(path, steps=5)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[-1]]) + "\n")
    with pytest.raises(ValueError, match="a step is missing or repeated"):
        read_trace(path)


def test_error_scores_are_traced_and_replayed(tmp_path, capsys):
    """docs/algorithm.md#damage-term: the scored e_t rides the trace and the replay passes it
    back."""
    path = tmp_path / "trace.jsonl"
    cfg, decisions = record_trace(path, UNITS, steps=40, cfg=GAMMA_CFG)
    header, _, records = read_trace(path)
    assert header.config == cfg and cfg.gamma == 0.5
    errors = read_errors(path, records, 6)
    assert torch.equal(errors, torch.stack([d.error for d in decisions]))
    assert errors[35, 1] == float("inf")
    assert any(3 in d.active for d in decisions[10:25])  # selected on its error alone
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["matches_recorded"] == 40
    assert main([str(path), "--gamma", "100", "--json"]) == 0  # a looser error threshold
    loose = json.loads(capsys.readouterr().out)
    assert loose["config"]["gamma"] == 100.0 and loose["matches_recorded"] is None

    plain = tmp_path / "plain.jsonl"
    record(plain, steps=5)
    assert read_errors(plain, read_trace(plain)[2], 6) is None
    assert main([str(plain), "--gamma", "0.5"]) == 2
    assert "plain.jsonl holds no error scores" in capsys.readouterr().err
    lines = path.read_text().splitlines()
    first = json.loads(lines[1])
    del first["errors"]
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:]]) + "\n")
    assert main([str(path)]) == 2
    assert "steps [1] have no error scores while others do" in capsys.readouterr().err
