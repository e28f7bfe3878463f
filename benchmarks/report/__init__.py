"""RESULTS.md, rendered from the result files in ``benchmarks/results/``.

    python -m benchmarks.report [--check]

The document is ``templates/RESULTS.md.j2`` (one included template per section): its sentences
are written there, with named placeholders for every figure. This package reads the result files
(:mod:`.source`), and each section's module (:data:`SECTIONS`) builds its tables' rows and its
sentences' values; the analysis behind them is :mod:`benchmarks.harness`'s. The rendered text is
filled to 100 columns (:func:`.words.fill_document`). ``--check`` exits non-zero when the
committed RESULTS.md is not what the result files render.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from benchmarks.report import (
    fault_grid,
    faults,
    fp4,
    overhead,
    paper,
    paper_branch,
    selection,
    shadow,
    summary,
)
from benchmarks.report.source import RESULTS, Source
from benchmarks.report.words import FILTERS, fill_document, resolved

DOCUMENT = Path(__file__).resolve().parents[1] / "RESULTS.md"
"""The rendered document (``benchmarks/RESULTS.md``)."""

TEMPLATES = Path(__file__).resolve().parent / "templates"

SECTIONS = (summary, fp4, faults, fault_grid, paper_branch, selection, paper, overhead, shadow)
"""The modules whose ``context(src)`` give the sections' templates their names."""


def sep(loop: Any, comma: str | None = None, last: str = "and") -> str:
    """What follows an item of a ``{% for %}`` to list it as ``a, b and c`` (``comma``: the
    same separator between all items)."""
    if loop.last:
        return ""
    if comma is not None:
        return comma
    return f" {last} " if loop.revindex == 2 else ", "


def environment() -> jinja2.Environment:
    """The templates with the report's filters, tests and shared names."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML
    )
    env.filters.update(FILTERS)
    env.tests["resolved"] = resolved
    env.globals["sep"] = sep
    return env


def render(root: Path = RESULTS) -> str:
    """The whole document from the result files under ``root``."""
    src = Source(root)
    names: dict[str, Any] = {"src": src}
    for section in SECTIONS:
        names.update(section.context(src))
    return fill_document(environment().get_template("RESULTS.md.j2").render(names))
