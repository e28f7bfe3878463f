"""Render ``benchmarks/RESULTS.md`` from the result files, or check that it is up to date.

    python -m benchmarks.report [--check] [--results DIR] [--out FILE]

Without ``--check`` the document is written. With it nothing is written, and the exit status is
1 when the file differs from what the result files render (the first differing lines are logged).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.report import DOCUMENT, render
from benchmarks.report.source import RESULTS

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the document is out of date")
    p.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    p.add_argument("--out", type=Path, default=DOCUMENT, help="the document")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = render(a.results)
    if not a.check:
        a.out.write_text(text)
        logger.info("wrote %s", a.out)
        return 0
    have = a.out.read_text() if a.out.exists() else ""
    if have == text:
        return 0
    diff = difflib.unified_diff(
        have.splitlines(), text.splitlines(), str(a.out), "rendered", n=0, lineterm=""
    )
    logger.error(
        "%s is not what the result files render; run `python -m benchmarks.report`:\n%s",
        a.out,
        "\n".join(list(diff)[:40]),
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
