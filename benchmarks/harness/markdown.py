"""The markdown tables of the studies' printed reports and of RESULTS.md (no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """``| a | b |`` lines: the header, its ``| --- |`` rule, one line per row of cells."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
