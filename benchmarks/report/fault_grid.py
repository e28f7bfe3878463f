"""The fault grid's section (issue 44, stage 4): the magnitude x onset grid, the gradient-visible
cells, the fault-free control and the break-even fault frequency, from the records of
``results/fault_grid/`` (:mod:`benchmarks.sweep.fault_grid`).

Every figure is exploratory (95% Student-t over the seeds, no verdict: the registration,
:data:`benchmarks.harness.preregistered.GRID_GATE`), with the sign count beside it. A
function-preserving cell reads its BF16 branch and its null control from ``free_long`` (a BF16
path computes the same bits with and without such an outlier), at the cell's horizon; each
(seed, point) is read on the host of its BF16 branch (:func:`benchmarks.report.faults.one_host`).
A cell shows the seeds on which its statics and nulls are complete, "not yet run" without any;
an arm shows only where it has every one of those seeds. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_stats import Records
from benchmarks.harness.break_even import advantage, break_even
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.preregistered import GRID_GATE, GRID_ORDER, GRID_SEEDS, sign_test
from benchmarks.harness.stats import interval
from benchmarks.report.error_cost import error_cost
from benchmarks.report.faults import machine, one_host, unit_of
from benchmarks.report.source import Source

FAMILY = "fault_grid"
POINT = 100
SCHEDULE_LEFT = 400 - POINT
"""Steps the trunk's schedule leaves after the branch point."""
MAGNITUDES = (20, 16, 13, 10)
ONSETS = {"instant": "instant", "rise": "x4 rise", "slow": "over 200 steps"}
HORIZON = {"instant": 50, "rise": 50, "slow": 225}
SHARED = ("BF16", "null BF16 (1e-6)")
NULLS = {"null BF16 (1e-6)": "BF16", "null low-cost (1e-6)": "low-cost"}
ARMS = ("GNMR+e 4", "e-only 4", "TE autoswitch 4", "GNMR 4")
ERROR_ARMS = ("GNMR+e 4", "e-only 4")
"""The arms that measure the error sums every step (priced with the measured ``C``)."""
RATIO = 2.0
"""BF16's step time over per-tensor FP8's: B200, GB300 and Hopper alike (2 : 1)."""


def _name(cell: str) -> str:
    return f"grid_{cell}"


def records(src: Source, cell: str) -> Records:
    """A cell's records on one host, with ``free_long``'s BF16 branches when it shares them."""
    own = dict(src.records(_name(cell), family=FAMILY))
    if not cell.endswith("_visible") and cell != "free_long":
        free = src.records(_name("free_long"), family=FAMILY)
        own |= {k: v for k, v in free.items() if k[0] in SHARED}
    return one_host(own)[0]


def horizon(cell: str) -> int:
    return 50 if cell == "free" else 225 if cell == "free_long" else HORIZON[cell.split("_")[1]]


def loss(rec: Records, arm: str, seed: int, h: int) -> float | None:
    r = rec.get((arm, seed, POINT))
    x = None if r is None else r["heldout"].get(str(h))
    return None if x is None else float(x)


def seeds_with(rec: Records, arms: Sequence[str], h: int) -> list[int]:
    """The grid's seeds with every one of ``arms``' held-out loss at ``h``."""
    return [s for s in GRID_SEEDS if all(loss(rec, a, s, h) is not None for a in arms)]


def diffs(rec: Records, a: str, b: str, seeds: Sequence[int], h: int) -> list[float]:
    return [loss(rec, a, s, h) - loss(rec, b, s, h) for s in seeds]  # type: ignore[operator]


def figure(values: Sequence[float], digits: int = 4) -> str:
    """``+0.0123 +- 0.0040 (5/5 > 0)``: mean, 95% half-width and the sign count."""
    if not values:
        return "-"
    m, h = interval(values)
    below, n, _ = sign_test(values)
    half = "one seed" if math.isnan(h) else f"+- {h:.{digits}f}"
    return f"{m:+.{digits}f} {half} ({n - below}/{len(values)} > 0)"


def resolved(values: Sequence[float]) -> bool:
    m, h = interval(values) if len(values) > 1 else (0.0, math.nan)
    return not math.isnan(h) and abs(m) > h


def work(rec: Records, arm: str, seeds: Sequence[int]) -> float:
    return sum(float(rec[(arm, s, POINT)]["flops_recovered"]) for s in seeds) / len(seeds)


def on_fault(rec: Records, arm: str, seeds: Sequence[int]) -> float | None:
    """The share of the faulted unit's window steps inside the branch it ran on BF16."""
    shares = []
    for s in seeds:
        r = rec[(arm, s, POINT)]
        if not r.get("outliers"):
            return None
        o = r["outliers"][0]
        steps = (o.get("emerge") or o["rise"]) + o["hold"]
        inside = min(steps, len(r["train_loss"]) - (o["start"] - POINT) + 1)
        shares.append(r["unit_recovered"][unit_of(o["module"])] / inside)
    return float(sum(shares) / len(shares))


def cell_row(cell: str, rec: Records) -> dict[str, Any]:
    """A cell's statics and nulls (on the seeds that have them all) and its arms."""
    h = horizon(cell)
    statics = ("low-cost", "BF16", *NULLS)
    seeds = seeds_with(rec, statics, h)
    row: dict[str, Any] = {"cell": cell, "seeds": seeds, "h": h, "arms": {}}
    if not seeds:
        return row
    gap = diffs(rec, "low-cost", "BF16", seeds, h)
    row |= {
        "gap": gap,
        "resolved": resolved(gap),
        "nulls": {n: diffs(rec, n, twin, seeds, h) for n, twin in NULLS.items()},
    }
    for arm in ARMS:
        if seeds_with(rec, (arm,), h) == seeds or set(seeds) <= set(seeds_with(rec, (arm,), h)):
            row["arms"][arm] = {
                "vs_low": diffs(rec, arm, "low-cost", seeds, h),
                "vs_bf16": diffs(rec, arm, "BF16", seeds, h),
                "work": work(rec, arm, seeds),
                "on_fault": on_fault(rec, arm, seeds),
            }
    return row


def _cells() -> list[tuple[str, str, str]]:
    """(cell, magnitude, onset) in the tables' order."""
    out = [(f"m{m}_{o}", f"2^{m}", words) for m in MAGNITUDES for o, words in ONSETS.items()]
    out += [
        (f"m{m}_{o}_visible", f"2^{m} visible", w) for m in MAGNITUDES for o, w in ONSETS.items()
    ]
    return out


def damage(src: Source, cell: str, row: dict[str, Any]) -> list[float]:
    """Per seed, the low-cost path's held-out loss under the fault less without it (the
    fault-free branch of the same seed and horizon): what the fault itself did; empty where the
    fault-free low-cost branch of a seed is missing."""
    h = row["h"]
    free = records(src, "free" if h == 50 else "free_long")
    own = records(src, cell)
    out = []
    for s in row["seeds"]:
        a, b = loss(own, "low-cost", s, h), loss(free, "low-cost", s, h)
        if a is None or b is None:
            return []
        out.append(a - b)
    return out


def visible_cost(src: Source, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per gradient-visible cell with statics: what the visible gradient does to the BF16 path
    itself, its BF16 branch less the fault-free one of the same seed (``free_long`` at the
    cell's horizon)."""
    free = records(src, "free_long")
    out = []
    for cell, mag, onset in _cells():
        r = rows[cell]
        if not cell.endswith("_visible") or not r["seeds"]:
            continue
        own = records(src, cell)
        d = [loss(own, "BF16", s, r["h"]) - loss(free, "BF16", s, r["h"]) for s in r["seeds"]]  # type: ignore[operator]
        out.append({"cell": f"{mag} {onset}", "bf16": figure(d), "low": figure(r["damage"])})
    return out


def statics_table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["outlier", "onset", "seeds", "static gap (low-cost - BF16)", "null BF16"]
    head += ["null low-cost", "the fault's damage (low-cost - fault-free low-cost)"]
    lines = []
    for cell, mag, onset in _cells():
        r = rows[cell]
        if not r["seeds"]:
            if not cell.endswith("_visible"):
                lines.append([mag, onset, "not yet run", "", "", "", ""])
            continue
        nulls = [figure(r["nulls"][n]) for n in NULLS]
        hurt = figure(r.get("damage", []))
        lines.append([mag, onset, str(len(r["seeds"])), figure(r["gap"]), *nulls, hurt])
    return markdown_table(head, lines)


def arms_table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["outlier", "onset", "arm", "held-out - low-cost", "share of gap closed", "work"]
    head += ["faulted unit: BF16 steps / window steps"]
    lines = []
    for cell, mag, onset in _cells():
        r = rows[cell]
        for arm, a in r["arms"].items():
            closed = -sum(a["vs_low"]) / sum(r["gap"]) if sum(r["gap"]) else math.nan
            f = a["on_fault"]
            lines.append(
                [
                    mag,
                    onset,
                    arm,
                    figure(a["vs_low"]),
                    f"{closed:.2f}",
                    f"{100 * a['work']:.1f}%",
                    "-" if f is None else f"{100 * f:.0f}%",
                ]
            )
    return markdown_table(head, lines) if lines else ""


def free_table(free: dict[str, Any]) -> str:
    if not free["seeds"]:
        return ""
    head = ["arm", "seeds", "held-out - low-cost", "held-out - BF16", "work"]
    lines = [["low-cost - BF16", str(len(free["seeds"])), "", figure(free["gap"]), "0.0%"]]
    for arm, a in free["arms"].items():
        lines.append(
            [
                arm,
                str(len(free["seeds"])),
                figure(a["vs_low"]),
                figure(a["vs_bf16"]),
                f"{100 * a['work']:.1f}%",
            ]
        )
    return markdown_table(head, lines)


def rates(src: Source, h: int) -> dict[int, float]:
    """Per seed, the fault-free BF16 branch's local rate over the 25 steps before ``h``."""
    rec = records(src, "free_long")
    out = {}
    for s in GRID_SEEDS:
        early, final = loss(rec, "BF16", s, h - 25), loss(rec, "BF16", s, h)
        if early is not None and final is not None:
            out[s] = (early - final) / 25
    return out


def break_even_rows(
    src: Source, rows: dict[str, dict[str, Any]], free: dict[str, Any], error: float
) -> tuple[str, list[dict[str, Any]]]:
    """The break-even table of every cell with an arm that the fault-free control has too."""
    lines, found = [], []
    for cell, mag, onset in _cells():
        r, h = rows[cell], horizon(cell)
        if h != free["h"] or not r["arms"]:
            continue
        rate = rates(src, h)
        for arm, a in r["arms"].items():
            if arm not in free["arms"]:
                continue
            seeds = [s for s in r["seeds"] if s in free["seeds"] and s in rate]
            c = error if arm in ERROR_ARMS else 0.0
            fault, zero, past = [], [], 0
            for s in seeds:
                i, j = r["seeds"].index(s), free["seeds"].index(s)
                af = advantage(a["vs_low"][i], _work1(src, cell, arm, s), rate[s], h, RATIO, c)
                a0 = advantage(
                    free["arms"][arm]["vs_low"][j],
                    _work1(src, "free", arm, s),
                    rate[s],
                    h,
                    RATIO,
                    c,
                )
                if af is None or a0 is None:
                    continue
                past += -a["vs_low"][i] / rate[s] > SCHEDULE_LEFT - h
                fault.append(af)
                zero.append(a0)
            if not fault:
                continue
            b = break_even(zero, fault)
            phi = (
                "never (below 1)"
                if b.phi is None
                else "0 (pays without faults)"
                if b.phi == 0
                else f"{b.phi:.2f}" + ("" if math.isnan(b.half) else f" +- {b.half:.2f}")
            )
            found.append({"cell": cell, "arm": arm, "phi": b.phi, "half": b.half})
            lines.append(
                [
                    mag,
                    onset,
                    arm,
                    str(b.seeds),
                    figure(zero, 3),
                    figure(fault, 3),
                    phi,
                    str(past) if past else "0",
                ]
            )
    head = ["outlier", "onset", "arm", "seeds", "a_0 (no fault)", "a_f (fault)", "break-even"]
    head += ["D past the schedule"]
    return (markdown_table(head, lines) if lines else ""), found


def bound_rows(
    src: Source, rows: dict[str, dict[str, Any]], free: dict[str, Any], error: float
) -> str:
    """The break-even's bound where no arm ran under the fault: each fault-free arm's ``a_0``
    (its measured spend and loss without a fault) against the best ``a_f`` any arm could reach
    in a faulted cell, closing the cell's whole static gap at the same spend,
    ``a_f <= (gap / r) / H - s - c``: "never" where even that is not positive."""
    rate = rates(src, 50)
    lines = []
    for arm, a in free["arms"].items():
        c = error if arm in ERROR_ARMS else 0.0
        for cell, mag, onset in _cells():
            r = rows[cell]
            if not r["seeds"] or r["arms"] or r["h"] != 50 or cell.endswith("_visible"):
                continue
            seeds = [s for s in r["seeds"] if s in free["seeds"] and s in rate]
            zero, best = [], []
            for s in seeds:
                i, j = r["seeds"].index(s), free["seeds"].index(s)
                spend = _work1(src, "free", arm, s)
                a0 = advantage(a["vs_low"][j], spend, rate[s], 50, RATIO, c)
                af = advantage(-r["gap"][i], spend, rate[s], 50, RATIO, c)
                if a0 is not None and af is not None:
                    zero.append(a0)
                    best.append(af)
            if not zero:
                continue
            b = break_even(zero, best)
            phi = (
                "never, even closing the whole gap"
                if b.phi is None
                else "0 (pays without faults)"
                if b.phi == 0
                else f"at least {b.phi:.2f}"
            )
            lines.append([arm, mag, onset, str(b.seeds), figure(zero, 3), figure(best, 3), phi])
    head = ["arm", "outlier", "onset", "seeds", "a_0 (no fault)", "best a_f (the whole gap)"]
    head += ["break-even"]
    return markdown_table(head, lines) if lines else ""


def _work1(src: Source, cell: str, arm: str, seed: int) -> float:
    return float(records(src, cell)[(arm, seed, POINT)]["flops_recovered"])


def reproduced(src: Source) -> tuple[int, int]:
    """(equal, compared): the 2^20 rise cell's low-cost and BF16 branches (the latter
    ``free_long``'s, at 50 steps) against ``outlier_delayed``'s records of the same (seed, point),
    the same fault recorded before the grid: equal held-out bits on how many."""
    old = one_host(src.records("outlier_delayed", family="faults"))[0]
    cell = records(src, "m20_rise")
    keys = [(a, s, POINT) for a in ("low-cost", "BF16") for s in GRID_SEEDS]
    keys = [k for k in keys if k in old and k in cell]
    same = sum(old[k]["heldout"]["50"] == cell[k]["heldout"]["50"] for k in keys)
    return same, len(keys)


def context(src: Source) -> dict[str, Any]:
    """The names of ``templates/fault_grid.md.j2``."""
    names = [c for c, _, _ in _cells()]
    rows = {c: cell_row(c, records(src, c)) for c in names}
    for cell in names:
        if rows[cell]["seeds"]:
            rows[cell]["damage"] = damage(src, cell, rows[cell])
    free = cell_row("free", records(src, "free"))
    measured = error_cost(src, "fp8_emulated")
    price = 0.0 if measured is None else measured.share
    be_table, be = break_even_rows(src, rows, free, price)
    bound = bound_rows(src, rows, free, price)
    done = [c for c in names if rows[c]["seeds"]]
    hosts = sorted(
        {machine(r) for c in [*done, "free", "free_long"] for r in records(src, c).values()}
    )
    commits = {
        r.get("provenance", {}).get("commit")
        for c in [*done, "free", "free_long"]
        for r in records(src, c).values()
    }
    files = [
        f"{FAMILY}/{_name(c)}.jsonl"
        for c in [*done, "free", "free_long"]
        if src.has(f"{FAMILY}/{_name(c)}.jsonl")
    ]
    return {
        "fault_grid": {
            "any": bool(done),
            "statics": statics_table(rows),
            "arms": arms_table(rows),
            "free": free_table(free),
            "free_seeds": len(free["seeds"]),
            "break_even": be_table,
            "found": be,
            "bound": bound,
            "visible": visible_cost(src, rows),
            "resolved": [c for c in done if rows[c].get("resolved")],
            "unresolved": [c for c in done if not rows[c].get("resolved")],
            "not_run": [c for c in names if not rows[c]["seeds"] and not c.endswith("_visible")],
            "error": "not measured" if measured is None else f"{price:.3f}",
            "error_source": "" if measured is None else measured.source,
            "reproduced": reproduced(src),
            "gate": GRID_GATE,
            "order": GRID_ORDER,
            "hosts": hosts,
            "commits": len(commits - {None}),
            "provenance": src.provenance(*files) if files else "",
        }
    }
