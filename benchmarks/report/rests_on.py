"""What a fault regime's headline rests on (issue 44): the table beside the verdicts at the top of
RESULTS.md, a row per figure (:data:`ROWS`) and a column per regime that passes the noise bar, for
its ``GNMR+e k`` arm (:func:`column`), from the same records.

GNMR+e keeps a few units on the recovery path whatever the fault does
(:func:`benchmarks.harness.designs.standing`): a fault that strikes one of them is covered
without being detected, so the comparisons are also given without those seeds. The old cost model
averaged per-branch speed-ups (convex in the gap) with unbounded extra steps; the bounded one
(:mod:`benchmarks.harness.cost`) stops at the schedule and takes the speed-up at the mean. Where
seeds were added after a look (:data:`benchmarks.harness.preregistered.STOPPING`), the sign count
at the end does not rest on the intervals' nominal level. No torch.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from benchmarks.harness import cost, designs, preregistered
from benchmarks.harness.branch_stats import per_seed, share_closed
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import interval
from benchmarks.report.branches import SCHEDULE_END
from benchmarks.report.faults import FAMILY, FaultRegime
from benchmarks.report.words import percent, pm

__all__ = ["column", "table"]

PILOT = "pilot1"
"""The folder of the first pilot's records (a smaller outlier) under ``results/faults/``."""
ROWS = (
    "standing spend: steps of 50 on the recovery path where the fault is elsewhere",
    "seeds whose fault struck a standing unit (share of the summed static gap)",
    "the comparisons without those seeds (98.75%)",
    "GNMR+e's work: standing units + the rest of their layer + the faulted unit + elsewhere",
    "the outlier's peak (the first pilot's static gap at a smaller one)",
    "the norms alone (GNMR k), blind by construction",
    "the static gap after each evaluation (the fault's window in steps)",
    "the old cost model, low-cost path: largest extra steps; mean of ratios -> at the mean",
    "the bounded model: low-cost not reached / behind at the end; GNMR+e's speed-up (B200)",
    "stopping: seeds planned + added; the first look; the end's sign count (p, x tests x looks)",
)


def _c(c: dict) -> str:
    return f"{c['text']}, {c['below']} of {c['n']} below (p = {c['p']:.2g})"


def _pilot(r: FaultRegime) -> str:
    """`` (2^10: gap, seeds x points)``: the static gap of the regime's first pilot."""
    pilot = designs.static_gap(designs.one_host(r.src.records(r.name, f"{FAMILY}/{PILOT}"))[0])
    if pilot is None:
        return ""
    d, peak, gap = pilot
    size = f"{len(d.seeds)} seeds x {len(d.points)} points"
    return f" (2^{peak:.0f}: {gap[0]:+.4f} +- {gap[1]:.4f}, {size})"


def _costs(r: FaultRegime, arm: str) -> list[str]:
    """The old model's largest extra steps (past the schedule's end?) and mean of per-branch
    speed-ups against the speed-up at the mean extra steps (B200, low-cost); the bounded model's
    low-cost branches not reached and behind at the end, ``arm``'s speed-up and its behind."""
    p = cost.price(r.formats, "B200")
    o = None if p.note is not None else designs.old_cost(r.records, r.design, p)
    if o is None:
        return ["-", "-"]
    (point, worst), h = o["worst"], r.design.horizon
    past = ", past the schedule's end" if point + h + worst > SCHEDULE_END else ""
    old = f"{worst:.0f}{past}; {o['ratios']:.2f} -> {o['at_mean']:.2f} ({o['extra']:.1f} steps)"
    low, ours = r.costs["low-cost"], r.costs.get(arm)
    end = low["at_end"] or (0, 0)
    now = f"{low['not_reached'][0]} of {low['not_reached'][1]} / {end[0]} of {end[1]}"
    if ours:
        b200 = cost.speed_cell(ours, "B200")
        behind, null = ours["at_end"] or (0, 0), r.costs.get("null BF16 (1e-6)", {}).get("at_end")
        now += f"; {b200} (behind at the end on {behind[0]} of {behind[1]}, "
        now += f"the BF16 null on {f'{null[0]} of {null[1]}' if null else None})"
    return [old, now]


def _stopping(r: FaultRegime, k: int, arm: str) -> str:
    """The seeds planned and added, the verdicts against the fixed rules at the planned seeds
    (the first look), and their sign counts at the end (p, and p x tests x looks)."""
    stop = preregistered.STOPPING.get(r.name)
    if stop is None:
        return "-"
    family, first, final = len(preregistered.comparisons(k)), [], []
    added = f" ({', '.join(map(str, stop.added))}; looks at {', '.join(map(str, stop.looks))})"
    for rival in (f"random {k}", f"NVIDIA last-{k}"):
        if rival not in r.table_arms:
            continue
        dc = r.pair_design(arm, rival)
        planned = tuple(s for s in stop.planned if s in dc.seeds)
        if len(planned) >= 2 and stop.added:
            c = designs.comparison(r.records, replace(dc, seeds=planned), arm, rival, family)
            first.append(f"at {len(stop.planned)}: vs {rival} {_c(c)}")
        c = designs.comparison(r.records, dc, arm, rival, family)
        adj = c["p"] * family * len(stop.looks)
        final.append(f"{c['below']} of {c['n']} below {rival} (p = {c['p']:.2g}, {adj:.2g})")
    head = f"{len(stop.planned)} + {len(stop.added)}" + (added if stop.added else "")
    return "; ".join([head, *first, *final])


def column(r: FaultRegime, k: int) -> list[str] | None:
    """The regime's cells of :data:`ROWS` for ``GNMR+e k`` (``None``: not in the design)."""
    d, arm, rec = r.design, f"GNMR+e {k}", r.records
    if d is None or arm not in r.table_arms:
        return None
    keep = designs.standing(rec, d, arm)
    units = {u for u, _ in keep}
    gd = r.pair_design(arm, f"random {k}")
    gaps = dict(zip(gd.seeds, per_seed(rec, gd, "low-cost", "BF16"), strict=True))
    hit = [
        s
        for s in gaps
        if designs.unit_of(rec[("low-cost", s, d.points[0])]["outliers"][0]["module"]) in units
    ]
    others = tuple(s for s in gaps if s not in hit)
    margins = []
    for rival in (f"random {k}", f"NVIDIA last-{k}"):
        if hit and len(others) >= 2 and rival in r.table_arms:
            dc = replace(r.pair_design(arm, rival), seeds=others)
            c = designs.comparison(rec, dc, arm, rival, len(preregistered.comparisons(k)))
            margins.append(f"vs {rival} {_c(c)}")
    parts = designs.unit_work(rec, d, arm, units) or []
    work = functools.partial(designs.work, rec, d)
    norm = f"GNMR {k}"
    gap_at = [interval(per_seed(rec, replace(d, horizon=e), "low-cost", "BF16")) for e in r.evals]
    o = r.outlier()
    trend = "grows" if gap_at[-1][0] > gap_at[0][0] else "shrinks"
    at = ", ".join(f"{g[0]:+.4f} +- {g[1]:.4f} ({e})" for e, g in zip(r.evals, gap_at, strict=True))
    share = sum(gaps[s] for s in hit) / sum(gaps.values())
    return [
        ", ".join(f"{designs.unit_name(u)} {m:.0f}" for u, m in keep),
        f"{len(hit)} of {len(gaps)}: {', '.join(map(str, hit))} ({100 * share:.0f}%)",
        "; ".join(margins) or "-",
        f"{100 * work(arm):.1f}% = " + " + ".join(f"{100 * p:.1f}" for p in parts),
        o["peak"] + _pilot(r),
        f"closes {pm(share_closed(rec, d, norm), 2)}, {percent(work(norm))} of the work"
        if norm in r.table_arms
        else "not run",
        f"{at} ({o['offset']}-{o['offset'] + o['rise'] + o['hold'] - 1}): {trend} after the window",
        *_costs(r, arm),
        _stopping(r, k, arm),
    ]


def table(columns: list[tuple[str, list[str]]]) -> str:
    """What the verdicts rest on: one row per figure, one column per (regime, its cells)."""
    rows = [[what, *(cells[i] for _, cells in columns)] for i, what in enumerate(ROWS)]
    return markdown_table(["", *(f"`{name}`" for name, _ in columns)], rows)
