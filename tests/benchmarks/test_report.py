"""benchmarks/report: RESULTS.md is what the result files render through its template, its verdict
words follow the intervals, and every section shows the provenance its result files record.

The first test is the guard: a result file changed (or RESULTS.md edited by hand) without running
``python -m benchmarks.report`` fails it. The others render a copy of the result files with one
figure changed, to show that the figure and the words that depend on it move together.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.harness import provenance
from benchmarks.harness.branch_stats import verdict
from benchmarks.report import DOCUMENT, render
from benchmarks.report.__main__ import main
from benchmarks.report.source import RESULTS
from benchmarks.report.words import (
    holds_zero,
    paragraph,
    relation,
    resolved_word,
    says,
)


def test_results_md_is_what_the_result_files_render():
    assert main(["--check"]) == 0, "run `python -m benchmarks.report` and commit RESULTS.md"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """The committed result files without the trunk checkpoints; plots as empty files (the
    document only links them)."""
    root = tmp_path / "results"
    for src in RESULTS.rglob("*"):
        rel = src.relative_to(RESULTS)
        if src.is_dir() or rel.parts[0] == "sweep" or src.suffix == ".pt":
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".png":
            dst.touch()
        else:
            shutil.copyfile(src, dst)
    return root


def _flat(root: Path) -> str:
    """The rendered document with its lines joined (prose is filled to 100 columns)."""
    return " ".join(render(root).split())


def _edit(root: Path, name: str, edit) -> None:
    path = root / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_copy_renders_the_committed_document(results):
    assert render(results) == DOCUMENT.read_text()


def test_a_changed_interval_changes_its_figure_and_its_verdict(results, tmp_path):
    before = _flat(results)
    key = "GNMR+e 4 - NVIDIA last-4"
    assert f"- {key}: +0.0002 +- 0.0004 -> not resolved" in before
    assert "**no different from NVIDIA's last-layers rule**" in before

    def better(d):
        d["comparisons"][key] = [-0.0030, 0.0010]

    _edit(results, "sweep_fp4_nvfp4", better)
    after = _flat(results)
    assert f"- {key}: -0.0030 +- 0.0010 -> better" in after
    assert "**better than NVIDIA's last-layers rule**" in after
    assert "GNMR+e buys back 54% +- 32% of NVFP4's cost, more than NVIDIA's" in after
    out = tmp_path / "RESULTS.md"
    out.write_text(DOCUMENT.read_text())
    assert main(["--check", "--results", str(results), "--out", str(out)]) == 1


def test_a_resolved_static_gap_is_called_resolved(results):
    assert "**+0.002 +- 0.076**: not resolved" in _flat(results)

    def wider(d):
        d["static_gap"] = [0.1, 0.05]

    _edit(results, "sweep_act_quant", wider)
    assert "**+0.100 +- 0.050**: resolved" in _flat(results)


def test_a_stored_step_time_run_becomes_a_table(results):
    """The file ``python -m benchmarks.sweep.fp4 --step-time`` appends to (its writer:
    ``test_branch.py``)."""
    (results / "sweep_fp4_step_time_nvfp4.json").unlink(missing_ok=True)
    assert "No run is stored" in _flat(results)
    ms = {"NVIDIA last-4": 600.0, "GNMR+e 4": 606.0, "GNMR+e 4 replayed": 600.0}
    run = {"date": "2026-12-03", "seed": 1234, "point": 175, "steps": 40, "warmup": 5, "ms": ms}
    runs = [{**run, "vs_nvidia": 1.01, "vs_replayed": 1.01}] * 2
    stored = {"regime": "nvfp4", "target": 1.02, "runs": runs}
    (results / "sweep_fp4_step_time_nvfp4.json").write_text(json.dumps(stored))
    text = _flat(results)
    assert "No run is stored" not in text
    assert "| 2 | 2026-12-03 |" in text and "606.0 ms" in text
    assert "**1.010 and 1.010, within the 1.02 target**" in text


@pytest.mark.parametrize(
    ("pair", "word", "relation_", "null"),
    [
        ((-0.3, 0.1), "better", "better than", "excludes 0"),
        ((0.3, 0.1), "worse", "worse than", "excludes 0"),
        ((0.05, 0.1), "not resolved", "the same as", "holds 0"),
        ((0.1, 0.1), "not resolved", "the same as", "holds 0"),
    ],
)
def test_verdict_words_come_from_the_interval(pair, word, relation_, null):
    assert verdict(pair) == word
    assert relation(pair) == relation_
    assert holds_zero(pair) == null
    assert says(pair, "beats", "loses to", "is level with") == {
        "better": "beats",
        "worse": "loses to",
    }.get(word, "is level with")
    assert resolved_word(pair) == ("not resolved" if word == "not resolved" else "resolved")


def test_prose_never_starts_a_line_with_a_list_marker():
    text = paragraph("x" * 97 + " - y " + "+- z " * 40)
    assert all(not line.startswith(("- ", "+- ")) for line in text.splitlines())
    assert all(len(line) <= 100 for line in text.splitlines()[:-1])


def test_a_result_file_shows_the_provenance_it_records(results, monkeypatch):
    """A record made now names the commit, the versions and the host, and the document shows
    them beside the file; a file without one says so."""
    record = provenance.record()
    assert set(record) == {"commit", "commit_source", "dirty", "versions", "host"}
    assert set(record["versions"]) == {"python", "torch", "megatron-core", "deepspeed"}
    assert record["host"]["threads"] >= 1 and record["host"]["isa"]

    def stamped(d):
        d["provenance"] = {**record, "commit": "0123456789abcdef", "dirty": True}

    _edit(results, "overhead_error", stamped)
    text = _flat(results)
    head = "`overhead_error.json`: commit 0123456789 (git rev-parse HEAD (run), with uncommitted"
    assert head in text
    assert f"torch {record['versions']['torch']}" in text
    assert f"ISA {record['host']['isa']}, {record['host']['threads']} torch threads" in text

    def unstamped(d):
        d.pop("provenance", None)

    _edit(results, "overhead", unstamped)
    assert "`overhead.json`: commit not recorded (no provenance recorded)" in _flat(results)
