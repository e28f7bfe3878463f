"""Figures in words (an interval ``(mean, 95% half-width)``, a share, a list), tables, the
template's filters, and RESULTS.md's prose filled to 100 columns."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from benchmarks.harness.branch_figures import excludes
from benchmarks.harness.markdown import markdown_table


def pm(pair: Sequence[float] | None, digits: int = 4, sign: str = "+", unit: str = "") -> str:
    """``+0.0031 +- 0.0011`` (``unit="%"``: both scaled by 100); ``(one seed)`` without a
    half-width; ``-`` for none."""
    if pair is None:
        return "-"
    m, h = (100 * x for x in pair) if unit else pair
    head = f"{m:{sign}.{digits}f}{unit}"
    return f"{head} (one seed)" if math.isnan(h) else f"{head} +- {h:.{digits}f}{unit}"


pct = partial(pm, digits=0, sign="", unit="%")  # a share as ``54% +- 32%``
resolved = excludes  # whether an interval excludes 0: the harness's test, one definition


def percent(x: float | None) -> str:
    """A share of work as ``14.8%`` (``-`` for none)."""
    return "-" if x is None else f"{100 * x:.1f}%"


def listing(items: Sequence[Any], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    words = [str(i) for i in items]
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)


def ordinal(n: int) -> str:
    """``8th``, ``1st``, ``2nd``."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def table(rows: Sequence[Mapping[str, str | None]]) -> str:
    """A markdown table of rows given as ``{header: cell}``, less any column of ``None``s."""
    heads = [h for h in rows[0] if any(r[h] is not None for r in rows)] if rows else []
    return markdown_table(heads, [[str(r[h]) for h in heads] for r in rows]) if rows else ""


# the template's filters (``x | f(".3f")``: ``format(x, ".3f")``); all else is computed in Python
FILTERS: dict[str, Callable[..., Any]] = {"f": format, "listing": listing, "ordinal": ordinal}

WIDTH = 100
_STARTS_A_BLOCK = re.compile(r"^([-+*>|#]+|\d+[.)])$")  # a list, quote, table or heading marker


def fill_document(text: str) -> str:
    """The rendered template with its prose filled: of its blocks (between blank lines), a list
    item is filled with its later lines indented, tables, code, headings and images are kept."""
    out = []
    for block in (b.strip("\n") for b in re.split(r"\n\s*\n", text) if b.strip()):
        if block.startswith(("|", "```", "#", "![", "<!--")):
            out.append(block)
        elif block.startswith("- "):
            items = re.split(r"\n(?=- )", block)
            out.append("\n".join("- " + paragraph(i[2:], "  ", WIDTH - 2) for i in items))
        else:
            out.append(paragraph(block))
    return "\n\n".join(out) + "\n"


def paragraph(text: str, indent: str = "", width: int = WIDTH) -> str:
    """``text`` filled to ``width`` (continuation lines after ``indent``), never starting a line
    with a word markdown would read as a list item or a heading."""
    lines: list[list[str]] = [[]]
    for word in text.split():
        fits = len(" ".join([*lines[-1], word])) <= width
        if lines[-1] and not fits and not _STARTS_A_BLOCK.match(word):
            lines.append([])
        lines[-1].append(word)
    return f"\n{indent}".join(" ".join(line) for line in lines)
