"""``benchmarks/gpu/torchao_check.py`` end to end in its dry mode (the CPU, tiny sizes): every part
runs, the bitwise part passes on this CPU's real FP8 GEMMs, the JSON holds each part's figures."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.requires import require

require("torchao")

pytestmark = pytest.mark.slow


def test_the_dry_run_exercises_every_part_and_records_it(tmp_path, capsys):
    from benchmarks.gpu import torchao_check

    assert torchao_check.main(["--dry", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split(":")[0]: line.split()[1] for line in lines[1:-1]}
    # torchtitan runs where it imports (``.venv/torchtitan`` once tests/integrations/
    # test_torchtitan.py put it on sys.path), and is skipped with its reason elsewhere
    titan = "PASS" if importlib.util.find_spec("torchtitan") is not None else "SKIP"
    assert status == {
        "bitwise": "PASS",
        "throughput": "DRY",
        "outlier": "DRY",
        "torchtitan": titan,
    }
    got = json.loads((tmp_path / "torchao_check.json").read_text())
    assert all(got["bitwise"]["equal"].values()) and len(got["bitwise"]["equal"]) == 6
    t = got["throughput"]
    assert set(t["tokens_per_s"]) == {"bf16", "fp8", "gnmr"} and t["units"] == 14
    assert "no CUDA" in t["dry"]
    o = got["outlier"]
    assert all(len(v) == 8 for v in o["losses"].values())
    assert o["faulted_unit_recovered_steps"] >= 1  # GNMR moved the faulted down_proj to BF16
