"""The trace's accounting fields: written where they apply, and counted back from the records
alone to the runtime's own accounting (one process)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gnmr_dist.core import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitNorms, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.session import open_trace, trace_fields
from gnmr_dist.telemetry import read_accounting, read_lrs, read_trace
from tests.distributed.toy import FFN, HIDDEN, Toy

NAN, INF = math.nan, math.inf
ROWS = [
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 30.0, 1.0, 1.0],
    [1.0, 1.0, NAN, 1.0],
    [1.0, 1.0, 1.0, 1.0],
    [INF, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
]
SKIPS = {1: [1.0, 1.0, 1.0, NAN], 4: [1.0, 1.0, 1.0, NAN]}
"""Skipped attempts before the rows of these indices (unit 3 non-finite)."""


def _trace(tmp_path, gemms):
    reg = UnitRegistry.from_model(Toy(layers=2))
    block = GNMRBlock.from_dict(
        {
            "backend": "act_quant",
            "gemms": gemms,
            "warmup_steps": 1,
            "max_active": 1,
            "log": {"trace": str(tmp_path / "t.jsonl")},
        }
    )
    runtime = GNMRRuntime(reg, block.policy, gemms=block.gemms)
    writer = open_trace(block, reg, 0)
    for i, row in enumerate(ROWS):
        skipped = []
        if i in SKIPS:
            skipped += runtime.skip(UnitNorms(torch.tensor(SKIPS[i]), 1.0, 2.0))
        norms = UnitNorms(torch.tensor(row, dtype=torch.float64), 1.0, 2.0)
        lr = 1e-3 * (1 - i / 10)
        decision = runtime.observe(norms, lr=lr)
        fields = {**trace_fields(runtime, norms, skipped), "lr": lr}
        writer.write(norms.norms, decision, {}, fields=fields)
    writer.close()
    return runtime, reg


@pytest.mark.parametrize("gemms", [["fprop", "dgrad", "wgrad"], ["wgrad"]])
def test_the_records_count_back_to_the_runtimes_accounting(tmp_path, gemms):
    runtime, _ = _trace(tmp_path, gemms)
    header, _, records = read_trace(tmp_path / "t.jsonl")
    assert header.meta["unit_sizes"] == [HIDDEN * FFN] * 4
    assert header.meta.get("gemms", ["fprop", "dgrad", "wgrad"]) == gemms
    # only where they apply
    assert [r.get("nonfinite") for r in records] == [None, None, None, [2], None, [0], None]
    assert [r.get("skipped_nonfinite") for r in records] == [None, [3], None, None, [3], None, None]
    firsts = [(i, r["first_nonfinite"]) for i, r in enumerate(records) if "first_nonfinite" in r]
    assert firsts == [(1, {"step": 2, "unit": 3, "name": "layers.1.fc2", "skipped": True})]
    assert read_lrs(tmp_path / "t.jsonl", records) == pytest.approx(
        [1e-3 * (1 - i / 10) for i in range(len(ROWS))]
    )
    counted, s = read_accounting(header, records), runtime.summary()
    assert counted["nonfinite"] == s.nonfinite.tolist() == [1, 0, 1, 2]
    assert counted["recovered"] == s.recovered.tolist()
    per_gemm = [counted["recovered_gemms"][g] for g in ("fprop", "dgrad", "wgrad")]
    assert torch.tensor(per_gemm).T.tolist() == s.recovered_gemms.tolist()
    assert sum(s.recovered.tolist()) > 0


def test_a_field_may_not_replace_the_records_own_and_lrs_come_whole(tmp_path):
    runtime, reg = _trace(tmp_path, ["fprop", "dgrad", "wgrad"])
    block = GNMRBlock.from_dict({"log": {"trace": str(tmp_path / "u.jsonl")}})
    writer = open_trace(block, reg, 0)
    n = runtime.last_norms
    with pytest.raises(ValueError, match=r"trace fields \['active'\] would replace"):
        writer.write(n.norms, runtime.last_decision, {}, fields={"active": []})
    writer.close()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines[1:]]
    del records[2]["lr"]
    with pytest.raises(ValueError, match=r"steps \[3\] have no learning rate"):
        read_lrs("t.jsonl", records)
    assert read_lrs("t.jsonl", [{k: v for k, v in r.items() if k != "lr"} for r in records]) is None
    assert GNMRConfig.from_dict(json.loads(lines[0])["config"]).max_active == 1
