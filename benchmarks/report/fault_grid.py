"""The fault grid's section of RESULTS.md (issue 44, stage 4; docs/benchmarks.md#sweep-fault-grid)
from ``results/fault_grid/``: the cells (magnitude x onset, function-preserving or
gradient-visible), the arms where they ran, the fault-free controls and the break-even fault
frequency, or its bound where no arm ran under a fault (:mod:`benchmarks.harness.break_even`).
Every figure is exploratory: 95% over seeds, with the count of seeds above 0. A function-preserving
cell reads BF16 and its null from ``free_long`` (a BF16 path computes the same bits with and
without such an outlier). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_stats import Records
from benchmarks.harness.break_even import break_even
from benchmarks.harness.designs import machine, one_host
from benchmarks.harness.grid_figures import ARMS, NULLS, POINT, advantages, cell_row, diffs, rates
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.preregistered import GRID_SEEDS, sign_test
from benchmarks.harness.stats import interval
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source

FAMILY = "fault_grid"
MAGNITUDES = (20, 16, 13, 10)
ONSETS = {"instant": "instant", "rise": "x4 rise", "slow": "over 200 steps"}
HORIZON = {"instant": 50, "rise": 50, "slow": 225}
CONTROL = {50: "free", 225: "free_long"}
"""The fault-free control at each horizon."""
SHARED = ("BF16", "null BF16 (1e-6)")


def records(src: Source, cell: str) -> Records:
    """A cell's records on one host, with ``free_long``'s BF16 branches when it shares them."""
    own = dict(src.records(f"grid_{cell}", family=FAMILY))
    if not cell.endswith("_visible") and cell != "free_long":
        free = src.records("grid_free_long", family=FAMILY)
        own |= {k: v for k, v in free.items() if k[0] in SHARED}
    return one_host(own)[0]


def horizon(cell: str) -> int:
    return 50 if cell == "free" else 225 if cell == "free_long" else HORIZON[cell.split("_")[1]]


def figure(values: Sequence[float], digits: int = 4) -> str:
    """``+0.0123 +- 0.0040 (5/5 > 0)``: mean, 95% half-width and the sign count."""
    if not values:
        return "-"
    m, h = interval(values)
    below, n, _ = sign_test(values)
    half = "one seed" if math.isnan(h) else f"+- {h:.{digits}f}"
    return f"{m:+.{digits}f} {half} ({n - below}/{len(values)} > 0)"


def _cells() -> list[tuple[str, str, str]]:
    """(cell, magnitude, onset) in the tables' order."""
    out = [(f"m{m}_{o}", f"2^{m}", words) for m in MAGNITUDES for o, words in ONSETS.items()]
    out += [
        (f"m{m}_{o}_visible", f"2^{m} visible", w) for m in MAGNITUDES for o, w in ONSETS.items()
    ]
    return out


def cells_table(src: Source, rows: dict[str, dict[str, Any]]) -> str:
    """Per cell its statics and nulls, and each path against the fault-free control's branch of
    the same seed and horizon: the fault's damage to the low-cost path, and in a gradient-visible
    cell what the visible gradient does to the BF16 path itself."""
    head = ["outlier", "onset", "seeds", "static gap (low-cost - BF16)", "null BF16"]
    head += ["null low-cost", "the fault's damage (low-cost - fault-free low-cost)"]
    head += ["BF16 - fault-free BF16 (visible cells)"]
    lines = []
    for cell, mag, onset in _cells():
        r = rows[cell]
        if not r["seeds"]:
            if not cell.endswith("_visible"):
                lines.append([mag, onset, "not yet run", "", "", "", "", ""])
            continue
        free, own = records(src, CONTROL[r["h"]]), records(src, cell)
        hurt = [diffs(own, a, free, a, r["seeds"], r["h"]) for a in ("low-cost", "BF16")]
        nulls = [figure(r["nulls"][n]) for n in NULLS]
        visible = figure(hurt[1]) if cell.endswith("_visible") else "-"
        lines.append([mag, onset, str(len(r["seeds"])), figure(r["gap"]), *nulls])
        lines[-1] += [figure(hurt[0]), visible]
    return markdown_table(head, lines)


def arms_table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["outlier", "onset", "arm", "held-out - low-cost", "share of gap closed", "work"]
    head += ["faulted unit: BF16 steps / window steps"]
    lines = []
    for cell, mag, onset in _cells():
        r = rows[cell]
        for arm, a in r["arms"].items():
            closed = -sum(a["vs_low"]) / sum(r["gap"]) if sum(r["gap"]) else math.nan
            f = "-" if a["on_fault"] is None else f"{100 * a['on_fault']:.0f}%"
            lines.append([mag, onset, arm, figure(a["vs_low"]), f"{closed:.2f}"])
            lines[-1] += [f"{100 * a['work']:.1f}%", f]
    return markdown_table(head, lines) if lines else ""


def free_table(controls: dict[str, dict[str, Any]]) -> str:
    """The fault-free controls' arms: what each costs when nothing is wrong."""
    head = ["control", "arm", "seeds", "held-out - low-cost", "held-out - BF16", "work"]
    lines = []
    for name, c in controls.items():
        what = f"{name} ({c['h']} steps)"
        if not c["seeds"]:
            lines.append([what, "not yet run", "", "", "", ""])
            continue
        n = str(len(c["seeds"]))
        lines.append([what, "low-cost - BF16", n, "", figure(c["gap"]), "0.0%"])
        for arm, a in c["arms"].items():
            cells = [figure(a["vs_low"]), figure(a["vs_bf16"]), f"{100 * a['work']:.1f}%"]
            lines.append([what, arm, n, *cells])
    return markdown_table(head, lines)


def _phi(zero: list[float], fault: list[float], bound: bool) -> str:
    b = break_even(zero, fault)
    if b.phi is None:
        return "never" if bound else "never (below 1)"
    if b.phi == 0:
        return "0 (pays without faults)"
    if bound:
        return f"at least {b.phi:.2f}"
    return f"{b.phi:.2f}" + ("" if math.isnan(b.half) else f" +- {b.half:.2f}")


def break_even_table(
    src: Source, rows: dict[str, dict[str, Any]], controls: dict[str, dict[str, Any]], c: float
) -> tuple[str, list[dict[str, Any]]]:
    """Per fault-free control a row of each arm's advantage at matched loss ``a_0``, then per
    cell at its horizon the arm's ``a_f`` and the break-even fault frequency; where no arm ran
    in a function-preserving cell, its bound (``<=``: the best ``a_f`` any arm could reach
    there, closing the cell's whole gap at the arm's fault-free spend)."""
    lines, found = [], []
    for name, free in controls.items():
        rate, a0, block = rates(records(src, "free_long"), free["h"]), {}, []
        for cell, mag, onset in _cells():
            r = rows[cell]
            if (
                r["h"] != free["h"]
                or not r["seeds"]
                or (cell.endswith("_visible") > bool(r["arms"]))
            ):
                continue
            out = []
            for arm in ARMS:
                got = r["arms"].get(arm)
                zero, fault, past = advantages(r, free, arm, rate, c)
                if not fault:
                    out.append("-")
                    continue
                a0.setdefault(arm, zero)
                tail = f"; D past the schedule on {past}" if past else ""
                text = f"{'<= ' if got is None else ''}{figure(fault, 3)}: "
                out.append(text + _phi(zero, fault, got is None) + tail)
                found.append({"cell": cell, "arm": arm, "phi": break_even(zero, fault).phi})
            block.append([mag, onset, str(len(r["seeds"])), *out])
        if a0:
            seeds = str(len(next(iter(a0.values()))))
            lines += [
                [f"no fault ({name}): a_0", "", seeds, *(figure(a0.get(a, []), 3) for a in ARMS)]
            ]
            lines += block
    head = ["outlier", "onset", "seeds", *ARMS]
    return (markdown_table(head, lines) if lines else ""), found


def reproduced(src: Source) -> tuple[int, int]:
    """(equal, compared): the 2^20 rise cell's low-cost and BF16 branches against
    ``outlier_delayed``'s records of the same (seed, point), held-out bits at 50 steps."""
    old = one_host(src.records("outlier_delayed", family="faults"))[0]
    cell = records(src, "m20_rise")
    keys = [(a, s, POINT) for a in ("low-cost", "BF16") for s in GRID_SEEDS]
    keys = [k for k in keys if k in old and k in cell]
    return sum(old[k]["heldout"]["50"] == cell[k]["heldout"]["50"] for k in keys), len(keys)


def context(src: Source) -> dict[str, Any]:
    """The names of ``templates/fault_grid.md.j2``."""
    names = [c for c, _, _ in _cells()]
    rows = {c: cell_row(c, records(src, c), horizon(c)) for c in names}
    controls = {c: cell_row(c, records(src, c), horizon(c)) for c in CONTROL.values()}
    measured = error_cost(src, "fp8_emulated")
    price = 0.0 if measured is None else measured.share
    table, found = break_even_table(src, rows, controls, price)
    done = [c for c in names if rows[c]["seeds"]]
    kept = [f"grid_{c}" for c in [*done, *CONTROL.values()] if src.has(f"{FAMILY}/grid_{c}.jsonl")]
    provenance = [r.get("provenance", {}) for c in kept for r in src.records(c, FAMILY).values()]
    return {
        "fault_grid": {
            "any": bool(done),
            "cells": cells_table(src, rows),
            "arms": arms_table(rows),
            "free": free_table(controls),
            "break_even": table,
            "measured": any(f["cell"] in done and rows[f["cell"]]["arms"] for f in found),
            "resolved": [c for c in done if rows[c].get("resolved")],
            "error": "not measured" if measured is None else f"{price:.3f}",
            "reproduced": reproduced(src),
            "hosts": sorted({machine({"provenance": p}) for p in provenance}),
            "commits": len({p.get("commit") for p in provenance} - {None}),
            "provenance": src.records_table([f"{FAMILY}/{c}.jsonl" for c in kept]),
        }
    }
