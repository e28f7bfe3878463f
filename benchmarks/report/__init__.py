"""RESULTS.md, rendered by ``python -m benchmarks.report`` from ``benchmarks/results/``: its
sentences are in ``templates/``, each figure a placeholder that a section (:data:`SECTIONS`) names
from the files :mod:`.source` reads and :mod:`benchmarks.harness` analyses."""

from __future__ import annotations

import argparse
import difflib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from benchmarks.report import (
    fault_grid,
    faults,
    fp4,
    overhead,
    paper,
    paper_branch,
    selection,
    summary,
)
from benchmarks.report.source import RESULTS, Source
from benchmarks.report.words import FILTERS, fill_document

logger = logging.getLogger(__name__)
DOCUMENT = Path(__file__).resolve().parents[1] / "RESULTS.md"
SECTIONS = (summary, fp4, faults, fault_grid, paper_branch, selection, paper, overhead)


def sep(loop: Any, comma: str = "") -> str:
    """What follows a ``{% for %}``'s item to list them as ``a, b and c`` (or ``a; b; c``)."""
    return "" if loop.last else comma or (" and " if loop.revindex == 2 else ", ")


def environment() -> Environment:
    """The package's ``templates/``, with the report's filters and ``sep``."""
    env = Environment(loader=PackageLoader(__name__), undefined=StrictUndefined)
    # a line of a lone {% tag %} leaves no line; an included section ends with its own newline
    env.trim_blocks = env.lstrip_blocks = env.keep_trailing_newline = True
    env.filters.update(FILTERS)
    env.globals["sep"] = sep
    return env


def render(root: Path = RESULTS) -> str:
    """The whole document from the result files under ``root``."""
    src = Source(root)
    names = {k: v for section in SECTIONS for k, v in section.context(src).items()}
    return fill_document(environment().get_template("RESULTS.md.j2").render(names))


def main(argv: Sequence[str] | None = None) -> int:
    """Write the document, or with ``--check`` exit 1 when it is not what the files render."""
    p = argparse.ArgumentParser("python -m benchmarks.report", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the document is out of date")
    p.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    p.add_argument("--out", type=Path, default=DOCUMENT, help="the document")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text, have = render(a.results), a.out.read_text() if a.out.exists() else ""
    if not a.check:
        a.out.write_text(text)
    elif have != text:
        diff = difflib.unified_diff(have.splitlines(), text.splitlines(), n=0, lineterm="")
        logger.error("%s is out of date; run `python -m benchmarks.report`:", a.out)
        logger.error("\n".join(list(diff)[2:42]))
    return int(a.check and have != text)
