"""Probe records: the trace's "probe" object, its reader, the selection figures and gnmr-report's
"selection quality" section, against brute force and hand-computed means (one process)."""

from __future__ import annotations

import itertools
import json
import math
import operator
import statistics

import pytest
import torch

from gnmr_dist import GNMRController
from gnmr_dist.telemetry import TraceHeader, TraceWriter, read_trace
from gnmr_dist.telemetry.selection import (
    first_last_units,
    gap_share,
    layer_number,
    probe_figures,
    random_figures,
    set_precision,
)
from gnmr_dist.telemetry.trace import ProbeRecord, read_probes
from tests.cli.traces import CFG, ELIGIBLE, GAMMA_CFG, errors_at
from tests.requires import require

UNITS = [f"model.layers.{i // 2}.{'qkv' if i % 2 == 0 else 'fc'}" for i in range(6)]
K, EVERY, STEPS = 2, 3, 30


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def record(path, cfg=CFG, update=True, step_ms=False, every=EVERY):
    """A real controller's trace with a probe record every ``every`` steps (synthetic gaps).

    Returns the decisions and the probe records written.
    """
    ctrl = GNMRController(6, cfg, eligible=ELIGIBLE)
    g, ge = torch.Generator().manual_seed(3), torch.Generator().manual_seed(2)
    decisions, probes, ran = [], [], frozenset()
    with TraceWriter(path, TraceHeader(tuple(UNITS), tuple(ELIGIBLE), cfg)) as w:
        for step in range(1, STEPS + 1):
            norms = torch.rand(6, generator=g, dtype=torch.float64) + 1
            norms[step % 5] *= 1 + 4 * (step % 7 == 0)
            errors = errors_at(step, ge) if cfg.gamma is not None else None
            d = ctrl.step(norms, errors=errors)
            probe = None
            if step % every == 0:
                gap = torch.rand(6, generator=g, dtype=torch.float64)
                probe = ProbeRecord(
                    step=step,
                    k=K,
                    grad_gap=gap,
                    update_gap=gap.flip(0) * 10 if update else None,
                    grad_low_norm=norms,
                    grad_high_norm=norms + gap,
                    loss_low=2.0 + step,
                    loss_high=2.0,
                    probe_ms=40.0 + step,
                    sets={
                        "risk_topk": _top(d.risk, K),
                        "active": ran,
                        "decided": frozenset(d.active),
                    },
                )
                probes.append(probe)
            extra = {"loss": 1.0 / step, **({"step_ms": 10.0 + step % 4} if step_ms else {})}
            w.write(norms, d, extra, probe=probe)
            decisions.append(d)
            ran = frozenset(d.active)
    return decisions, probes


def _top(values, k):
    """Independent top-k: sort (value descending, id ascending) in plain Python."""
    order = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))
    return frozenset(order[:k])


def test_probe_records_round_trip_and_old_records_read_as_before(tmp_path):
    path = tmp_path / "t.jsonl"
    _, probes = record(path)
    _, _, records = read_trace(path)
    assert [r["step"] for r in records if "probe" in r] == list(range(EVERY, STEPS + 1, EVERY))
    plain = [r for r in records if "probe" not in r]
    assert set(plain[0]) == {"step", "norms", "active", "telemetry", "extra"}  # as before
    got = read_probes(path, records, len(UNITS))
    assert [p.step for p in got] == [p.step for p in probes]
    scalars = operator.attrgetter("k", "loss_low", "loss_high", "probe_ms")
    for a, b in zip(got, probes, strict=True):
        assert torch.equal(a.grad_gap, b.grad_gap) and torch.equal(a.update_gap, b.update_gap)
        assert torch.equal(a.grad_high_norm, b.grad_high_norm) and a.sets == b.sets
        assert scalars(a) == scalars(b)
    stored = next(r for r in records if "probe" in r)["probe"]
    figures = got[0].figures()
    assert list(stored["figures"]) == list(figures) == ["risk_topk", "active", "decided"]
    for name, fig in figures.items():
        assert stored["figures"][name] == pytest.approx(fig, nan_ok=True)
    assert read_probes(path, plain, len(UNITS)) == []  # a trace without probes: none

    no_update = tmp_path / "n.jsonl"
    record(no_update, update=False)
    _, _, recs = read_trace(no_update)
    assert all(r["probe"]["update_gap"] is None for r in recs if "probe" in r)
    assert read_probes(no_update, recs, len(UNITS))[0].update_gap is None


def test_probe_writer_and_reader_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    decisions, probes = record(path)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[EVERY])
    rec["probe"]["grad_gap"] = rec["probe"]["grad_gap"][:5]
    with pytest.raises(ValueError, match=rf"step {EVERY}: probe grad_gap has shape \(5,\)"):
        read_probes(path, [rec], len(UNITS))
    del rec["probe"]["sets"]
    with pytest.raises(ValueError, match=rf"step {EVERY}: the probe record lacks \['sets'\]"):
        read_probes(path, [rec], len(UNITS))
    header = TraceHeader(tuple(UNITS), tuple(ELIGIBLE), CFG)
    with (
        TraceWriter(tmp_path / "w.jsonl", header) as w,
        pytest.raises(ValueError, match="probe of step 3 written with the decision of 1"),
    ):
        w.write(torch.ones(6), decisions[0], probe=probes[0])


def test_random_figures_are_the_exact_expectation_over_every_k_subset():
    gap, upd = t(0.5, 3.0, 1.0, 2.5, 0.1, 4.0), t(1, 2, 3, 4, 5, 6)
    for k in (1, 2, 3, 5, 7):
        eligible_ids = [i for i, e in enumerate(ELIGIBLE) if e]
        m = min(k, len(eligible_ids))
        subsets = list(itertools.combinations(eligible_ids, m))
        want = {
            "precision_grad": statistics.fmean(set_precision(s, gap) for s in subsets),
            "share_grad": statistics.fmean(gap_share(s, gap) for s in subsets),
            "precision_update": statistics.fmean(set_precision(s, upd) for s in subsets),
            "share_update": statistics.fmean(gap_share(s, upd) for s in subsets),
        }
        assert random_figures(gap, upd, ELIGIBLE, k) == pytest.approx(want, rel=1e-12), k
    # the top gap (unit 5) is not eligible: expected precision < k / E
    assert random_figures(gap, None, ELIGIBLE, 1)["precision_grad"] == 0.0
    assert math.isnan(random_figures(gap, None, ELIGIBLE, 2)["share_update"])
    assert all(math.isnan(v) for v in random_figures(gap, upd, [False] * 6, 2).values())


def test_probe_figures_rows_oracle_and_first_last():
    gap, upd = t(0.5, 3.0, 1.0, 2.5, 0.1, 4.0), t(6, 5, 4, 3, 2, 1)
    risk, errors = t(1, 9, 2, 8, 3, 0), t(5, 0, 0, 0, 4, 0)
    fig = probe_figures(
        gap, upd, risk, {"active": {1}, "decided": set()}, 2, errors=errors, eligible=ELIGIBLE
    )
    assert list(fig) == ["risk_topk", "active", "decided", "error_topk", "random", "oracle"]
    # risk top-2 = {1, 3}; gap top-2 = {5, 1}; update top-2 = {0, 1}
    assert fig["risk_topk"]["precision_grad"] == 0.5 and fig["risk_topk"]["precision_update"] == 0.5
    total = float((gap**2).sum())
    assert fig["risk_topk"]["share_grad"] == pytest.approx((9 + 6.25) / total)
    assert fig["active"]["precision_grad"] == 0.0  # k = |{1}| = 1: the top-1 gap is unit 5
    assert fig["active"]["precision_update"] == 0.0  # the top-1 update gap is unit 0
    assert math.isnan(fig["decided"]["precision_grad"])  # an empty set: undefined
    assert fig["error_topk"]["precision_update"] == 0.5  # {0, 4} against {0, 1}
    assert fig["oracle"]["precision_grad"] == 1.0
    best = max(gap_share(s, gap) for s in itertools.combinations(range(6), 2))
    assert fig["oracle"]["share_grad"] == pytest.approx(best)
    none = probe_figures(gap, None, risk, {}, 2)
    assert list(none) == ["risk_topk", "oracle"] and math.isnan(none["oracle"]["share_update"])
    assert layer_number("model.layers.12.mlp.up_proj") == 12 and layer_number("lm_head") is None
    assert first_last_units(UNITS) == {0, 1, 4, 5}
    assert first_last_units(["decoder.layers.0", "decoder.layers.7", "x.3"]) == {0, 1}
    assert first_last_units(["a", "b"]) == frozenset()


def _want_means(probes, decisions, errors=None):
    """Hand-computed means of the risk top-k and active rows' grad precision over the probes."""
    risk_p = [len(_top(decisions[p.step - 1].risk, K) & _top(p.grad_gap, K)) / K for p in probes]
    active = [
        len(p.sets["active"] & _top(p.grad_gap, len(p.sets["active"]))) / len(p.sets["active"])
        for p in probes
        if p.sets["active"]
    ]
    return statistics.fmean(risk_p), (statistics.fmean(active) if active else math.nan), active


def test_report_prints_selection_quality(tmp_path, capsys):
    require("matplotlib")
    from gnmr_dist.cli.report import main
    from gnmr_dist.telemetry.report import draw_report

    run = tmp_path / "run"
    decisions, probes = record(run / "trace.jsonl", step_ms=True)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert f"selection quality ({len(probes)} probe steps, k = {K};" in out
    for label in ("risk top-k", "active (ran the step)", "decided (next step)",
                  "first+last layers", "random k (expected)", "oracle (upper bound)"):  # fmt: skip
        assert label in out, label
    assert "error-score top-k" not in out  # the trace has no error scores
    q = draw_report(run / "trace.jsonl", tmp_path / "r.png")["selection_quality"]
    risk_mean, active_mean, active = _want_means(probes, decisions)
    assert q["rows"]["risk_topk"]["precision_grad"] == (pytest.approx(risk_mean), len(probes))
    assert q["rows"]["active"]["precision_grad"] == (pytest.approx(active_mean), len(active))
    assert 0 < len(active) < len(probes)  # the active row counts the defined steps only
    assert f"{risk_mean:.3f} [{len(probes)}]" in out
    assert q["rows"]["oracle"]["precision_update"] == (1.0, len(probes))
    share = statistics.fmean(
        float(p.grad_gap[sorted(_top(p.grad_gap, K))].square().sum() / p.grad_gap.square().sum())
        for p in probes
    )
    assert q["rows"]["oracle"]["share_grad"][0] == pytest.approx(share)
    assert q["rows"]["random"]["precision_grad"][0] == pytest.approx(
        statistics.fmean(len(_top(p.grad_gap, K) & {0, 1, 2, 3, 4}) / 5 for p in probes)
    )
    assert q["probe_ms"] == statistics.median(p.probe_ms for p in probes)
    assert q["step_ms"] == 11.5 and "step time median 11.5 ms" in out


def test_report_without_update_gap_and_with_error_scores(tmp_path, capsys):
    require("matplotlib")
    from gnmr_dist.cli.report import main

    trace = tmp_path / "t.jsonl"
    record(trace, cfg=GAMMA_CFG, update=False)
    assert main([str(trace), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "error-score top-k" in out and "update gap: n/a" in out
    row = next(line for line in out.splitlines() if "risk top-k" in line)
    assert row.split()[-2:] == ["n/a", "n/a"]
    assert "probe time: median" in out and "step time" not in out

    plain = tmp_path / "p.jsonl"
    record(plain, every=STEPS + 1)  # no probe step
    assert main([str(plain), "--out", str(tmp_path / "p.png")]) == 0
    assert "selection quality" not in capsys.readouterr().out
