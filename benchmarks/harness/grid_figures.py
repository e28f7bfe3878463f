"""The fault grid's figures per cell (issue 44, stage 4; docs/benchmarks.md#sweep-fault-grid):
per seed at branch point :data:`POINT`, the static gap, the nulls, each path against the
fault-free control and each arm's paired differences, work and share of the fault's window on
BF16 (:func:`cell_row`), the fault-free BF16 branch's local rate of progress (:func:`rates`), each
arm's advantage at matched loss with and without the fault (:func:`advantages`) and per control
the break-even of each arm in each cell (:func:`break_even_blocks`).
A function-preserving cell reads BF16 and its null from ``free_long``'s records (a BF16 path
computes the same bits with and without such an outlier). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_stats import Records
from benchmarks.harness.break_even import advantage, break_even
from benchmarks.harness.designs import unit_of
from benchmarks.harness.preregistered import GRID_SEEDS
from benchmarks.harness.stats import interval

POINT = 100
SCHEDULE_LEFT = 400 - POINT
"""Steps the trunk's schedule leaves after the branch point."""
NULLS = {"null BF16 (1e-6)": "BF16", "null low-cost (1e-6)": "low-cost"}
ARMS = ("GNMR+e 4", "e-only 4", "TE autoswitch 4", "GNMR 4")
ERROR_ARMS = ("GNMR+e 4", "e-only 4")
"""The arms that measure the error sums every step (priced with the measured ``C``)."""
RATIO = 2.0
"""BF16's step time over per-tensor FP8's: B200, GB300 and Hopper alike (2 : 1)."""
CONTROL = {50: "free", 225: "free_long"}
"""The fault-free control at each horizon."""
CELLS = {
    f"m{m}_{onset}{visible}": h
    for visible in ("", "_visible")
    for m in (20, 16, 13, 10)
    for onset, h in (("instant", 50), ("rise", 50), ("slow", 225))
}
"""The cells (log2 of the outlier's size, onset, gradient-visible or not) in the tables' order,
with their horizons: a 35-step window in 50-step branches, 200 steps emerging in 225."""


def loss(rec: Records, arm: str, seed: int, h: int) -> float | None:
    r = rec.get((arm, seed, POINT))
    x = None if r is None else r["heldout"].get(str(h))
    return None if x is None else float(x)


def seeds_with(rec: Records, arms: Sequence[str], h: int) -> list[int]:
    """The grid's seeds with every one of ``arms``' held-out loss at ``h``."""
    return [s for s in GRID_SEEDS if all(loss(rec, a, s, h) is not None for a in arms)]


def diffs(a: Records, arm: str, b: Records, twin: str, seeds: Sequence[int], h: int) -> list[float]:
    """Per seed ``arm``'s held-out loss in ``a`` less ``twin``'s in ``b``; empty if one lacks it."""
    out = [(loss(a, arm, s, h), loss(b, twin, s, h)) for s in seeds]
    return [x - y for x, y in out] if all(None not in p for p in out) else []  # type: ignore[operator]


def on_fault(rec: Records, arm: str, seeds: Sequence[int]) -> float | None:
    """The share of the faulted unit's window steps inside the branch it ran on BF16."""
    shares = []
    for r in (rec[(arm, s, POINT)] for s in seeds):
        if not r.get("outliers"):
            return None
        o = r["outliers"][0]
        steps = (o.get("emerge") or o["rise"]) + o["hold"]
        inside = min(steps, len(r["train_loss"]) - (o["start"] - POINT) + 1)
        shares.append(r["unit_recovered"][unit_of(o["module"])] / inside)
    return float(sum(shares) / len(shares))


def cell_row(cell: str, rec: Records, h: int, control: Records | None = None) -> dict[str, Any]:
    """A cell's statics and nulls at horizon ``h`` (on the seeds that have them all) and its
    arms; ``resolved``: whether the static gap's 95% interval excludes 0; ``hurt``: each static
    path less the fault-free ``control``'s branch of the same seed (what the fault itself did);
    ``closed``: the share of the static gap an arm closes, at the means over seeds."""
    seeds = seeds_with(rec, ("low-cost", "BF16", *NULLS), h)
    row: dict[str, Any] = {"cell": cell, "seeds": seeds, "n": len(seeds), "h": h, "arms": {}}
    row["visible"] = cell.endswith("_visible")  # the outlier's gradient reaches the weight
    if not seeds:
        return row
    gap = diffs(rec, "low-cost", rec, "BF16", seeds, h)
    nulls = {n: diffs(rec, n, rec, twin, seeds, h) for n, twin in NULLS.items()}
    m, half = interval(gap) if len(gap) > 1 else (0.0, 0.0)
    row |= {"gap": gap, "resolved": abs(m) > half, "nulls": nulls}
    if control is not None:
        # the same path on the same seed without the fault: the difference is the fault's doing;
        # a function-preserving cell's BF16 branches are the control's own (nothing to compare)
        paths = ("low-cost", "BF16") if cell.endswith("_visible") else ("low-cost",)
        row["hurt"] = {a: diffs(rec, a, control, a, seeds, h) for a in paths}
    for arm in ARMS:
        if set(seeds) <= set(seeds_with(rec, (arm,), h)):
            works = [float(rec[(arm, s, POINT)]["flops_recovered"]) for s in seeds]
            vs_low = diffs(rec, arm, rec, "low-cost", seeds, h)
            row["arms"][arm] = {
                "vs_low": vs_low,
                # held-out - low-cost < 0 closes the gap: the sign flips
                "closed": -sum(vs_low) / sum(gap) if sum(gap) else math.nan,
                "vs_bf16": diffs(rec, arm, rec, "BF16", seeds, h),
                "works": works,
                "work": sum(works) / len(works),
                "on_fault": on_fault(rec, arm, seeds),
            }
    return row


def same_bits(old: Records, new: Records, h: int) -> tuple[int, int]:
    """(equal, compared): the low-cost and BF16 branches of the grid's seeds at :data:`POINT` that
    both ``old`` and ``new`` hold, whose held-out losses at ``h`` are the same bits."""
    keys = [(a, s, POINT) for a in ("low-cost", "BF16") for s in GRID_SEEDS]
    # exact equality on purpose: the same seed, point and code must reproduce every bit
    keys = [k for k in keys if k in old and k in new]
    return sum(old[k]["heldout"][str(h)] == new[k]["heldout"][str(h)] for k in keys), len(keys)


def rates(rec: Records, h: int) -> dict[int, float]:
    """Per seed, the fault-free BF16 branch's local rate over the 25 steps before ``h`` (``rec``:
    the fault-free control's records)."""
    out = {}
    for s in GRID_SEEDS:
        early, final = loss(rec, "BF16", s, h - 25), loss(rec, "BF16", s, h)
        if early is not None and final is not None:
            out[s] = (early - final) / 25
    return out


def advantages(
    r: dict[str, Any], free: dict[str, Any], arm: str, rate: dict[int, float], c: float
) -> tuple[list[float], list[float], int]:
    """(``a_0``, ``a_f``, how many need more steps than the schedule leaves) per seed of the cell
    ``r`` (:func:`cell_row`) with the fault-free control ``free``'s branch and a rate: where the
    arm did not run in the cell, the best it could reach there (closing the whole gap at its
    fault-free spend); ``c``: the error term's cost for :data:`ERROR_ARMS`."""
    got, base = r["arms"].get(arm), free["arms"].get(arm)
    zero, fault, past = [], [], 0
    for s in (s for s in r["seeds"] if base and s in free["seeds"] and s in rate):
        i, j = r["seeds"].index(s), free["seeds"].index(s)
        spend, e = base["works"][j], c if arm in ERROR_ARMS else 0.0
        gain = -r["gap"][i] if got is None else got["vs_low"][i]
        work = spend if got is None else got["works"][i]
        af = advantage(gain, work, rate[s], r["h"], RATIO, e)
        az = advantage(base["vs_low"][j], spend, rate[s], r["h"], RATIO, e)
        if af is not None and az is not None:
            zero.append(az)
            fault.append(af)
            past += -gain / rate[s] > SCHEDULE_LEFT - r["h"]
    return zero, fault, past


def break_even_blocks(
    rows: Sequence[dict[str, Any]], controls: dict[str, dict[str, Any]], bf16: Records, c: float
) -> list[dict[str, Any]]:
    """Per fault-free control (``controls``, :func:`cell_row`) with an arm that breaks even
    somewhere: ``a0``, each arm's ``a_0`` per seed, and ``cells``, per cell of ``rows`` at its
    horizon each arm's ``a_f`` (``fault``), whether it is the ``bound`` of an arm that did not run
    there, how many seeds need steps ``past`` the schedule and the :class:`BreakEven` (``even``).
    ``bf16``: the fault-free BF16 branches the rate is read from (``free_long``'s); ``c``: the
    error term's cost. A gradient-visible cell has no bound (its BF16 path is hurt too)."""
    blocks = []
    for name, free in controls.items():
        rate, cells = rates(bf16, free["h"]), []
        a0: dict[str, list[float]] = {}
        for r in rows:
            # a visible cell only where its arms ran: its BF16 path is hurt too, so no bound
            if r["h"] != free["h"] or not r["n"] or (not r["arms"] and "_visible" in r["cell"]):
                continue
            arms: dict[str, dict[str, Any]] = {}
            for arm in ARMS:
                zero, fault, past = advantages(r, free, arm, rate, c)
                if fault:
                    # a_0 is the control's: the first cell's seeds give it (all cells share them)
                    a0.setdefault(arm, zero)
                    bound = arm not in r["arms"]  # the best it could do where it did not run
                    even = break_even(zero, fault)
                    arms[arm] = {"fault": fault, "bound": bound, "past": past, "even": even}
            cells.append({"cell": r["cell"], "seeds": r["n"], "arms": arms})
        if a0:
            # every arm's a_0 comes from the same first cell: one seed count
            seeds = len(next(iter(a0.values())))
            blocks.append({"control": name, "a0": a0, "seeds": seeds, "cells": cells})
    return blocks
