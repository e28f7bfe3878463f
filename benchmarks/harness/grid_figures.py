"""The fault grid's figures per cell (issue 44, stage 4; docs/benchmarks.md#sweep-fault-grid):
per seed at branch point :data:`POINT`, the static gap, the nulls and each arm's paired
differences, work and share of the fault's window on BF16 (:func:`cell_row`), the fault-free
BF16 branch's local rate of progress (:func:`rates`) and each arm's advantage at matched loss with
and without the fault (:func:`advantages`, for :func:`benchmarks.harness.break_even.break_even`).
A function-preserving cell reads BF16 and its null from ``free_long``'s records (a BF16 path
computes the same bits with and without such an outlier). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_stats import Records
from benchmarks.harness.break_even import advantage
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


def cell_row(cell: str, rec: Records, h: int) -> dict[str, Any]:
    """A cell's statics and nulls at horizon ``h`` (on the seeds that have them all) and its
    arms; ``resolved``: whether the static gap's 95% interval excludes 0."""
    seeds = seeds_with(rec, ("low-cost", "BF16", *NULLS), h)
    row: dict[str, Any] = {"cell": cell, "seeds": seeds, "h": h, "arms": {}}
    if not seeds:
        return row
    gap = diffs(rec, "low-cost", rec, "BF16", seeds, h)
    nulls = {n: diffs(rec, n, rec, twin, seeds, h) for n, twin in NULLS.items()}
    m, half = interval(gap) if len(gap) > 1 else (0.0, 0.0)
    row |= {"gap": gap, "resolved": abs(m) > half, "nulls": nulls}
    for arm in ARMS:
        if set(seeds) <= set(seeds_with(rec, (arm,), h)):
            works = [float(rec[(arm, s, POINT)]["flops_recovered"]) for s in seeds]
            row["arms"][arm] = {
                "vs_low": diffs(rec, arm, rec, "low-cost", seeds, h),
                "vs_bf16": diffs(rec, arm, rec, "BF16", seeds, h),
                "works": works,
                "work": sum(works) / len(works),
                "on_fault": on_fault(rec, arm, seeds),
            }
    return row


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
