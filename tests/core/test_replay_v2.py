"""gnmr-replay with the second policy's keys: what a trace can replay, and clear refusals for
what a trace without the inputs cannot (costs, the learning rate). Here rather than in
tests/cli because it tests the policy's keys on the command line
(docs/algorithm.md#tuning-offline)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from gnmr_dist.cli.replay import main
from tests.cli.traces import CFG, record_trace

UNITS = [f"layers.{i // 2}.{'qkv' if i % 2 == 0 else 'fc'}" for i in range(6)]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    record_trace(path, UNITS, steps=60)
    return str(path)


def summary(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_new_keys_replay_from_the_command_line(trace, capsys):
    base = summary(capsys, trace)
    assert base["matches_recorded"] == 60 and "latch" not in base["config"]
    pinned = summary(capsys, trace, "--pinned", '{"units": "all", "from": {"step": 50}}')
    assert pinned["config"]["pinned"] == {"units": "all", "from": {"step": 50}}
    assert pinned["recovery_rate"] > base["recovery_rate"]
    latched = summary(capsys, trace, "--latch", '{"step": 1}', "--lock-steps", "0")
    assert latched["config"]["latch"] == {"step": 1}
    budget = '{"schedule": "step", "start": 0, "end": 2, "steps": 40}'
    late = summary(capsys, trace, "--max-active", budget)
    assert late["config"]["max_active"]["schedule"] == "step"
    assert late["recovery_rate"] < base["recovery_rate"]
    none = summary(capsys, trace, "--max-active", "0", "--gamma", "null", "--max-share", "null")
    assert none["recovery_rate"] == 0.0 and "max_share" not in none["config"]
    # issue 41, item 2: pinned by pattern resolves over the trace's unit names
    named = summary(capsys, trace, "--pinned", '{"units": ["layers.1.*"]}', "--max-active", "0")
    assert named["recovery_rate"] == pytest.approx(2 / 5)  # 2 of the 5 eligible units, always
    assert [u for u, _ in named["top_units"]] == ["layers.1.qkv", "layers.1.fc"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--max-share", "0.2"],
            r"gnmr\.max_share needs the units' costs, and trace\.jsonl "
            r"records no meta\.unit_sizes .*--max-share null",
        ),
        (["--latch", '{"lr_decay": 0.5}'], r"gnmr\.latch runs on the lr_decay clock and trace"),
        (
            ["--max-active", '{"schedule": "step", "start": 0, "end": 2, "clock": "lr_decay"}'],
            r"gnmr\.max_active runs on the lr_decay clock",
        ),
        (["--latch", '{"setp": 3}'], r"unknown key gnmr\.latch\.setp; did you mean 'step'"),
        (["--max-active", "2.5"], r"gnmr\.max_active must be an integer >= 0, got 2\.5"),
    ],
)
def test_what_a_trace_cannot_replay_is_refused_by_name(trace, capsys, argv, match):
    assert main([trace, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gnmr-replay: ") and re.search(match, err)


def test_a_trace_recorded_with_max_share_replays_with_it_turned_off(tmp_path, capsys):
    path = tmp_path / "share.jsonl"
    record_trace(path, UNITS, steps=20)
    head, *rows = path.read_text().splitlines(keepends=True)
    header = json.loads(head)
    header["config"] = replace(CFG, max_share=0.5).to_dict()  # as a run with costs wrote it
    path.write_text(json.dumps(header) + "\n" + "".join(rows))
    assert main([str(path)]) == 2
    assert "--max-share null" in capsys.readouterr().err
    assert summary(capsys, str(path), "--max-share", "null")["steps"] == 20
