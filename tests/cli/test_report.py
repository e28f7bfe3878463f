"""gnmr-report: the PNG is drawn and its summary numbers equal the recorded decisions'."""

from __future__ import annotations

import pytest
import torch

from tests.requires import require

require("matplotlib")
from matplotlib.image import imread

from gnmr_dist.cli.report import main
from gnmr_dist.telemetry.report import draw_report, short_names
from tests.cli.traces import CFG, GAMMA_CFG, record_trace

UNITS = [f"model.layers.{i // 2}.{'qkv' if i % 2 == 0 else 'fc'}" for i in range(6)]


def record(path, steps=60, loss=True):
    """A real controller's trace with spikes at steps 21 and 41 and a NaN norm at step 31."""
    return record_trace(path, UNITS, steps=steps, loss=loss)[1]


def check_png(path):
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] >= 400 and img.shape[1] >= 800
    assert img[..., :3].var() > 0.001  # drawn, not blank


def test_report_numbers_equal_the_recorded_decisions(tmp_path, capsys):
    run = tmp_path / "run"
    decisions = record(run / "trace.jsonl")
    assert main([str(run), "--title", "test run"]) == 0
    assert "report.png" in capsys.readouterr().out
    check_png(run / "report.png")

    s = draw_report(run / "trace.jsonl", tmp_path / "again.png")
    scored = [d for d in decisions if d.step > CFG.warmup_steps]
    assert s["steps"] == 60 and s["units"] == 6 and s["eligible_units"] == 5
    assert s["scored_steps"] == 55 and s["nonfinite_steps"] == 1 and s["max_active"] == 2
    want_exceed = sum(d.telemetry.num_exceed_eligible for d in scored) / (55 * 5)
    want_active = sum(len(d.active) for d in scored) / (55 * 5)
    assert want_exceed > 0 and want_active > 0
    assert s["exceedance_rate"] == pytest.approx(want_exceed)
    assert s["recovery_rate"] == pytest.approx(want_active)
    assert s["config"] == CFG.to_dict()


def test_report_without_loss_one_step_and_explicit_out(tmp_path, capsys):
    """Issue 41, item 10: a run that never left its warm-up has no rates (it printed 0.000%)."""
    trace = tmp_path / "t.jsonl"
    record(trace, steps=1, loss=False)
    out = tmp_path / "figs" / "one.png"
    assert main([str(trace), "--out", str(out)]) == 0
    assert "exceedance n/a (every step is in the warm-up)" in capsys.readouterr().out
    check_png(out)
    s = draw_report(trace, out)
    assert s["steps"] == 1 and s["scored_steps"] == 0
    assert s["exceedance_rate"] is None and s["recovery_rate"] is None


def test_short_names_drop_the_common_prefix():
    assert short_names(UNITS)[:2] == ["0.qkv", "0.fc"]
    assert short_names(["a.b"]) == ["a.b"]
    assert len(short_names(["x." + "y" * 60, "x.z"])[0]) <= 28


def test_report_errors_are_clear(tmp_path, capsys):
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such trace file or run directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "without trace.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    assert main([str(bad)]) == 2
    assert "is this a gnmr trace" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    record(empty, steps=0)
    assert main([str(empty)]) == 2
    assert "no step records" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


def test_report_of_a_trace_with_error_scores(tmp_path):
    trace = tmp_path / "t.jsonl"
    _, decisions = record_trace(trace, UNITS, steps=30, cfg=GAMMA_CFG)
    s = draw_report(trace, tmp_path / "r.png")
    scored = [d for d in decisions if d.step > CFG.warmup_steps]
    want = sum(d.telemetry.num_exceed_eligible for d in scored) / (len(scored) * 5)
    assert s["exceedance_rate"] == pytest.approx(want) and s["config"]["gamma"] == 0.5


def test_the_heatmap_circles_a_unit_at_the_step_it_ran_recovery(tmp_path):
    """Issue 33, item 6: the circle was drawn at the step a unit was chosen, one step before it
    ran the recovery path; decision A_t is the plan of step t + 1."""
    from gnmr_dist.telemetry.replay import Recording
    from gnmr_dist.telemetry.report import summarise

    trace = tmp_path / "trace.jsonl"
    chosen = record(trace)
    rec = Recording.read(trace)
    risk = torch.stack([d.risk for d in rec.decisions()])
    s = summarise(rec.header, rec.norms, rec.records, risk)
    first = next(t for t, d in enumerate(chosen) if d.active)  # 0-based row of the decision
    assert s["_active"][first].any() and not s["_ran"][first].any()
    for t, d in enumerate(chosen[:-1]):
        assert s["_ran"][t + 1].nonzero().flatten().tolist() == list(d.active)
    assert not s["_ran"][0].any()  # the first step ran the empty initial plan
