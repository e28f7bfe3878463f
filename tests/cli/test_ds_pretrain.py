"""The `make demo` job end to end: two processes under torchrun and the run folder it leaves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_dist.telemetry import read_trace
from tests.multiproc import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_demo_job_writes_trace_report_summary_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "-m", "gnmr_dist.cli.ds_pretrain",
           "--config", str(ROOT / "configs" / "demo_deepspeed.hjson"), "--run-dir", str(run),
           "--steps", "25", "--layers", "2", "--hidden", "64", "--seq-len", "64",
           "--max-bytes", "400000", "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gnmr-ds-pretrain: 25 steps on 2 processes" in out.stdout
    summary = json.loads((run / "summary.json").read_text())
    _, norms, records = read_trace(run / "trace.jsonl")
    assert summary["steps"] == 25 and summary["decisions"] == 25 and norms.shape == (25, 14)
    assert all("loss" in r["extra"] for r in records)  # the job notes its loss per step
    assert summary["last_loss"] < summary["first_loss"]
    assert (run / "report.png").stat().st_size > 20_000
    assert (run / "checkpoint" / "latest").read_text().strip() == "global_step25"
    assert (run / "checkpoint" / "global_step25" / "gnmr_state.pt").is_file()


def test_missing_config_is_reported(tmp_path, capsys):
    from gnmr_dist.cli.ds_pretrain import main

    with pytest.raises(SystemExit) as stop:
        main(["--config", str(tmp_path / "nope.json")])
    assert stop.value.code == 2
    assert "nope.json does not exist (see configs/" in capsys.readouterr().err
