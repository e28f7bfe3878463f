"""The template's filters: how RESULTS.md writes a figure, the verdict words it computes from an
interval, and the filling of its prose.

An interval is ``(mean, 95% half-width)`` of a paired difference ``a - b``. It is *resolved*
when it excludes 0; a resolved difference below 0 makes ``a`` *better* (lower loss), above 0
*worse*; an interval that holds 0 is *not resolved*, and RESULTS.md calls the two the *same*.
The template picks the phrasing of each verdict (``pair | says("beats", "loses to", "is level
with")``); which of the three it is comes from the interval alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness.branch_stats import verdict
from benchmarks.harness.stats import plus_minus

Pair = Sequence[float]


def pct(pair: Pair) -> str:
    """A share as ``54% +- 32%``."""
    m, h = pair
    return f"{100 * m:.0f}% +- {100 * h:.0f}%"


def fmt(x: Any, spec: str) -> str:
    """``format(x, spec)``: ``x | f(".3f")`` in the template."""
    return format(x, spec)


def resolved(pair: Pair) -> bool:
    """Whether the interval excludes 0."""
    m, h = pair
    return not math.isnan(h) and abs(m) > h


def resolved_word(pair: Pair) -> str:
    """``resolved`` or ``not resolved``."""
    return "resolved" if resolved(pair) else "not resolved"


def holds_zero(pair: Pair) -> str:
    """``holds 0`` or ``excludes 0``: the check of a null control."""
    return "excludes 0" if resolved(pair) else "holds 0"


def says(pair: Pair, better: str, worse: str, same: str) -> str:
    """The template's words for the verdict of ``a - b``: ``better``, ``worse`` or ``same``."""
    return {"better": better, "worse": worse}.get(verdict(pair), same)


def relation(pair: Pair, same: str = "the same as") -> str:
    """``a - b`` as the words between ``a`` and ``b``: ``better than``, ``worse than`` or
    ``same``."""
    return says(pair, "better than", "worse than", same)


def listing(items: Sequence[Any], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = [str(i) for i in items]
    if len(items) < 2:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


def span(values: Sequence[float], spec: str = ".2f", unit: str = "") -> str:
    """``lo-hi`` of ``values`` (one value when they agree at this precision)."""
    lo, hi = f"{min(values):{spec}}", f"{max(values):{spec}}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def ordinal(n: int) -> str:
    """``8th``, ``1st``, ``2nd``."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


FILTERS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (pct, resolved, resolved_word, holds_zero, says, relation, listing, span, ordinal)
}
FILTERS.update(f=fmt, pm=plus_minus, compared=verdict)
"""The template's filters by name (``x | f(".3f")`` formats with :func:`fmt`; ``pm``:
``+0.0031 +- 0.0011``; ``compared``: ``better``, ``worse`` or ``not resolved``)."""

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
