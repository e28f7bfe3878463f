"""The template's filters (a figure's format, a list in words, an ordinal, whether an interval is
resolved) and the filling of RESULTS.md's prose to 100 columns.

An interval is ``(mean, 95% half-width)`` of a paired difference ``a - b``. It is *resolved*
when it excludes 0 (:func:`resolved`); the verdict words (better, worse, not resolved) are
:func:`benchmarks.harness.branch_stats.verdict`'s, computed in the sections' modules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness.stats import plus_minus

Pair = Sequence[float]


def pct(pair: Pair | None) -> str:
    """A share as ``54% +- 32%`` (``54% (one seed)``; ``-`` for none)."""
    if pair is None:
        return "-"
    m, h = pair
    return f"{100 * m:.0f}% (one seed)" if math.isnan(h) else f"{100 * m:.0f}% +- {100 * h:.0f}%"


def pm(pair: Pair | None, digits: int = 4) -> str:
    """``+0.0031 +- 0.0011``; ``(one seed)`` without a half-width; ``-`` for none."""
    if pair is not None and math.isnan(pair[1]):
        return f"{pair[0]:+.{digits}f} (one seed)"
    return plus_minus(pair, digits)


def percent(x: float | None) -> str:
    """A share of work as ``14.8%`` (``-`` for none)."""
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt(x: Any, spec: str) -> str:
    """``format(x, spec)``: ``x | f(".3f")`` in the template."""
    return format(x, spec)


def resolved(pair: Pair) -> bool:
    """Whether the interval excludes 0."""
    m, h = pair
    return not math.isnan(h) and abs(m) > h


def listing(items: Sequence[Any], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = [str(i) for i in items]
    if len(items) < 2:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


def ordinal(n: int) -> str:
    """``8th``, ``1st``, ``2nd``."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


FILTERS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (resolved, listing, ordinal)}
FILTERS["f"] = fmt
"""The template's filters by name (``x | f(".3f")`` formats with :func:`fmt`); every other figure
and verdict word is computed in the sections' modules."""

WIDTH = 100
"""Prose lines are filled to this width, as the rest of the repository's markdown."""

_STARTS_A_BLOCK = re.compile(r"^([-+*>|#]+|\d+[.)])$")
"""A word that would open a list, quote, table or heading at the start of a line."""

_KEPT = ("|", "```", "#", "![", "<!--")
"""Blocks that are not prose: tables, code, headings, images, comments."""


def fill_document(text: str) -> str:
    """The rendered template with its prose filled: blocks are separated by blank lines; a list
    item (``- ``) is filled with its continuation lines indented, every other prose block as one
    paragraph; tables, code, headings and images are kept as they are."""
    blocks = [b.strip("\n") for b in re.split(r"\n\s*\n", text) if b.strip()]
    out = []
    for block in blocks:
        if block.startswith(_KEPT):
            out.append(block)
        elif block.startswith("- "):
            items = re.split(r"\n(?=- )", block)
            out.append("\n".join(item(i[2:]) for i in items))
        else:
            out.append(paragraph(block))
    return "\n\n".join(out) + "\n"


def paragraph(text: str) -> str:
    """``text`` as one paragraph filled to :data:`WIDTH`, without starting a line with a word
    markdown would read as a list item or a heading."""
    return _fill(text, "")


def item(text: str) -> str:
    """One list item, filled as :func:`paragraph` with its continuation lines indented."""
    return "- " + _fill(text, "  ", WIDTH - 2)


def _fill(text: str, indent: str, width: int = WIDTH) -> str:
    lines: list[list[str]] = [[]]
    for word in text.split():
        line = lines[-1]
        fits = len(" ".join([*line, word])) <= width
        if line and not fits and not _STARTS_A_BLOCK.match(word):
            lines.append([word])
        else:
            line.append(word)
    return f"\n{indent}".join(" ".join(line) for line in lines)
