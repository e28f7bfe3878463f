"""RESULTS.md, rendered from the result files in ``benchmarks/results/``.

    python -m benchmarks.results_md [--check]

Every figure of RESULTS.md is read from a result file when the document is rendered: the
reports and records of the sweeps, the seed experiments' JSON files and the overhead
measurements. The prose around the figures lives here as text; the verdict words in it
(resolved, better, worse, the same) are computed from the intervals (:mod:`.words`). ``--check``
exits non-zero when the committed RESULTS.md is not what the result files render, so a result
file changed without regenerating the document fails the tests.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.results_md import fp4, overhead, seed, selection
from benchmarks.results_md.source import RESULTS, Source
from benchmarks.results_md.words import paragraph

DOCUMENT = Path(__file__).resolve().parents[1] / "RESULTS.md"
"""The rendered document (``benchmarks/RESULTS.md``)."""

SECTIONS = (fp4, selection, seed, overhead)
"""The document's sections in order; each renders its markdown blocks from the result files."""


def preamble() -> list[str]:
    return [
        "# Results at CPU scale",
        "<!-- Rendered by `python -m benchmarks.results_md` from benchmarks/results/: edit the "
        "generator, not this file. -->",
        paragraph(
            "Every number here comes from a result file in `benchmarks/results/`, written by a "
            "command of `benchmarks/` (named beside its table) run on a CPU machine, and is read "
            "from it when this document is rendered (`python -m benchmarks.results_md`). The "
            "README keeps a summary. Machines are noisy: ratios are measured side by side in one "
            "run, and every comparison of training arms is paired and carries its interval.",
        ),
    ]


def render(root: Path = RESULTS) -> str:
    """The whole document from the result files under ``root``."""
    src = Source(root)
    blocks = preamble()
    for section in SECTIONS:
        blocks += section.render(src)
    return "\n\n".join(b for b in blocks if b) + "\n"
