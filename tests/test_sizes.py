"""The sizes issue 45 set, kept: a result that wants room replaces text instead of adding to it.

RESULTS.md is a document of verdict tables (at most :data:`DOCUMENT_LINES` lines); its renderer's
Python (``benchmarks/report/*.py``) computes no more than it words (at most
:data:`RENDERER_LINES`); its templates compute nothing (no ``{% set %}``: every figure arrives
ready from Python); no test file outgrows :data:`TEST_FILE_LINES` lines.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT_LINES = 900
RENDERER_LINES = 1_100
TEST_FILE_LINES = 600


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_results_md_stays_a_short_document():
    assert lines(ROOT / "benchmarks" / "RESULTS.md") <= DOCUMENT_LINES


def test_the_renderer_stays_small_and_its_templates_compute_nothing():
    report = ROOT / "benchmarks" / "report"
    total = sum(lines(p) for p in report.glob("*.py"))
    assert total <= RENDERER_LINES, f"benchmarks/report/*.py: {total} lines"
    computing = [p.name for p in report.glob("templates/*.j2") if "{% set" in p.read_text()]
    assert computing == []


def test_no_test_file_outgrows_its_limit():
    big = {str(p.relative_to(ROOT)): lines(p) for p in (ROOT / "tests").rglob("*.py")}
    assert {p: n for p, n in big.items() if n > TEST_FILE_LINES} == {}
