"""A trace already on disk is never overwritten: a new writer sets it aside (issue 33, item 2)."""

from __future__ import annotations

import json

import torch

from gnmr_dist.core import GNMRConfig, GNMRController
from gnmr_dist.telemetry.trace import TraceHeader, TraceReader, TraceWriter

UNITS = ("a", "b", "c")


def _write(path, steps: int, meta=None) -> None:
    controller = GNMRController(3, GNMRConfig(max_active=1, warmup_steps=0))
    header = TraceHeader(UNITS, (True, True, True), controller.config, meta or {})
    with TraceWriter(path, header) as writer:
        for _ in range(steps):
            norms = torch.rand(3, dtype=torch.float64)
            writer.write(norms, controller.step(norms))


def test_a_second_run_keeps_the_first_runs_records(tmp_path, caplog):
    path = tmp_path / "trace.jsonl"
    _write(path, 13)
    first = path.read_bytes()
    _write(path, 3, {"run": 2})
    _write(path, 2, {"run": 3})
    assert (tmp_path / "trace.1.jsonl").read_bytes() == first  # 13 records, byte for byte
    assert len((tmp_path / "trace.2.jsonl").read_text().splitlines()) == 1 + 3
    assert [r["step"] for r in TraceReader(path)] == [1, 2]
    header = json.loads(path.read_text().splitlines()[0])
    assert header["meta"] == {"run": 3, "previous_trace": "trace.2.jsonl"}
    assert "it is kept as" in caplog.text and "trace.2.jsonl" in caplog.text


def test_an_empty_file_is_simply_written(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    _write(path, 2)
    assert not (tmp_path / "trace.1.jsonl").exists()
    assert "previous_trace" not in json.loads(path.read_text().splitlines()[0])["meta"]
