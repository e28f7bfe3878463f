"""The fault grid's section of RESULTS.md (issue 44, stage 4; docs/benchmarks.md#sweep-fault-grid):
the figures of :mod:`benchmarks.harness.grid_figures` in words (:func:`worded`), laid out in the
template's tables; each figure 95% over seeds with the count of seeds above 0. No torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import grid_figures as grid
from benchmarks.harness.branch_stats import Records
from benchmarks.harness.designs import machine, one_host
from benchmarks.harness.preregistered import sign_test
from benchmarks.harness.stats import interval
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source

FAMILY = "fault_grid"
ONSETS = {"instant": "instant", "rise": "x4 rise", "slow": "over 200 steps"}


def records(src: Source, cell: str) -> Records:
    """A cell's records on one host; a function-preserving cell's BF16 and null BF16 are
    ``free_long``'s (a BF16 path computes the same bits with and without such an outlier)."""
    own = dict(src.records(f"grid_{cell}", family=FAMILY))
    if not cell.endswith(("_visible", "free_long")):
        free = src.records("grid_free_long", family=FAMILY)
        own |= {k: v for k, v in free.items() if k[0] in ("BF16", "null BF16 (1e-6)")}
    return one_host(own)[0]


def figure(values: Sequence[float], digits: int = 4) -> str:
    """``+0.0123 +- 0.0040 (5/5 > 0)``: mean, 95% half-width and the sign count."""
    if not values:
        return "-"
    (m, h), (below, n, _) = interval(values), sign_test(values)
    half = "one seed" if math.isnan(h) else f"+- {h:.{digits}f}"
    return f"{m:+.{digits}f} {half} ({n - below}/{len(values)} > 0)"


def even(e: dict[str, Any], digits: int) -> str:
    """An arm's ``a_f`` and ``phi*``; ``<=``, ``at least``: the bound where it did not run."""
    b, bound = e["even"], e["bound"]
    if b.phi is None:
        phi = "never" if bound else "never (below 1)"
    elif b.phi == 0 or bound:
        phi = "0 (pays without faults)" if b.phi == 0 else f"at least {b.phi:.2f}"
    else:
        phi = f"{b.phi:.2f}" + ("" if math.isnan(b.half) else f" +- {b.half:.2f}")
    past = f"; D past the schedule on {e['past']}" if e["past"] else ""
    return f"{'<= ' * bound}{figure(e['fault'], digits)}: {phi}{past}"


def worded(x: Any, digits: int = 4) -> Any:
    """The harness's figures for the template: each per-seed list (floats) as its :func:`figure`,
    an arm's break-even as :func:`even`'s, and a grid cell's name as (outlier, onset) words."""
    if isinstance(x, list) and x and all(isinstance(v, float) for v in x):
        return figure(x, digits)
    if isinstance(x, list):
        return [worded(v, digits) for v in x]  # the seeds (ints), the rows
    if not isinstance(x, dict):
        return x
    if "even" in x:
        return even(x, digits)
    out = {k: worded(v, digits) for k, v in x.items()}
    if x.get("cell") in grid.CELLS:
        m, onset, *visible = x["cell"].split("_")
        out["words"] = [f"2^{m[1:]}" + " visible" * bool(visible), ONSETS[onset]]
    return out


def context(src: Source) -> dict[str, Any]:
    """The names of ``templates/fault_grid.md.j2``."""
    free = {h: records(src, c) for h, c in grid.CONTROL.items()}
    rows = [grid.cell_row(c, records(src, c), h, free[h]) for c, h in grid.CELLS.items()]
    controls = {c: grid.cell_row(c, free[h], h) for h, c in grid.CONTROL.items()}
    cost = error_cost(src, "fp8_emulated")
    blocks = grid.break_even_blocks(rows, controls, free[225], cost.share if cost else 0.0)
    kept = [f"grid_{c}" for c in [*(r["cell"] for r in rows if r["n"]), *controls]]
    kept = [c for c in kept if src.has(f"{FAMILY}/{c}.jsonl")]
    recs = [r for c in kept for r in src.records(c, FAMILY).values()]
    old = one_host(src.records("outlier_delayed", family="faults"))[0]
    return {
        "fault_grid": {
            "any": any(r["n"] for r in rows),
            "ran": any(r["arms"] for r in rows),
            "cells": worded(rows),
            "controls": worded(controls),
            "arms": grid.ARMS,
            "break_even": worded(blocks, 3),
            "resolved": [r["cell"] for r in rows if r.get("resolved")],
            "error": "not measured" if cost is None else f"{cost.share:.3f}",
            "reproduced": grid.same_bits(old, records(src, "m20_rise"), 50),
            "hosts": sorted({machine(r) for r in recs}),
            "commits": len({r.get("provenance", {}).get("commit") for r in recs} - {None}),
            "provenance": src.provenance_table([f"{FAMILY}/{c}.jsonl" for c in kept]),
        }
    }
