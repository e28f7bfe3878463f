"""What a fault regime's headline rests on (issue 44): the figures RESULTS.md's top paragraph and
the README's top set beside the verdicts, computed from the same records.

For a regime that passes the noise bar and its ``GNMR+e k`` arm (:func:`rests_on`):

- **standing spend**: the units GNMR+e keeps on the recovery path on at least :data:`STANDING`
  of the steps of the branches whose fault is elsewhere, whatever the fault does (its error
  score is the largest there at every step); the seeds whose fault struck one of them, which
  GNMR+e covers without detecting it, with their share of the summed static gap; and the
  pre-registered comparisons against the fixed rules on the other seeds (the family's
  Bonferroni-adjusted interval, and the sign count beside it);
- **how the work splits**: GNMR+e's recovered linear work on those standing units, on the
  faulted unit and on the rest;
- **the outlier**: its peak as the records state it, and the static gap of the same regime's
  pilot at a smaller peak where a pilot's records are kept (``results/faults/pilot1/``);
- **the norm-only arm** (``GNMR k``): its share of the gap and its work; the harness's outlier
  leaves the trained weight's gradient alone, so the norms cannot see it by construction;
- **after the window**: the static gap at every evaluation (a stale delayed-scaling history keeps
  damaging after the fault ends; current scaling heals);
- **the old cost model's flaws against the bounded one**: the largest extra-step count of one
  branch and the low-cost path's speed-up at the mean extra steps beside the mean of the
  per-branch speed-ups (the old model), then the branches that do not reach BF16's loss inside
  the schedule and the speed-ups as the bounded model gives them (:mod:`benchmarks.harness.cost`);
- **the stopping history** (:data:`benchmarks.harness.preregistered.STOPPING`): the verdicts at
  the seeds planned before the sweep, the seeds added after that look, and the sign count of
  each comparison at the end.

No torch: the figures come from the records.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import Design, Records, per_seed, share_closed
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import interval
from benchmarks.report.faults import (
    FAMILY,
    PROJECTIONS,
    SCHEDULE_END,
    FaultRegime,
    complete_seeds,
    one_host,
    unit_name,
    unit_of,
    work,
)

__all__ = ["HIDDEN", "FFN", "STANDING", "rests_on", "standing", "unit_work"]

STANDING = 0.8
"""A unit GNMR+e recovers on at least this share of the steps of the branches whose fault struck
another unit (their mean) is standing spend."""

PILOT = "pilot1"
"""The folder of the first pilot's records (a smaller outlier) under ``results/faults/``."""

HIDDEN, FFN = 128, 344
"""The harness Llama's widths (``benchmarks.harness.arms.Setup``): q, k, v and o are
``HIDDEN x HIDDEN``, gate, up and down ``HIDDEN x FFN``. :func:`unit_work` checks them against
each record's ``flops_recovered`` and gives no split where they do not add up."""


def _sizes(units: int) -> list[int]:
    per_layer = [HIDDEN * HIDDEN] * 4 + [HIDDEN * FFN] * 3
    return (per_layer * (units // len(PROJECTIONS)))[:units]


def standing(records: Records, d: Design, arm: str) -> list[tuple[int, float]]:
    """(unit, mean recovered steps per branch) of the units ``arm`` recovers on at least
    :data:`STANDING` of the steps, over the design's branches whose fault struck another unit."""
    steps: dict[int, list[int]] = {}
    for s in d.seeds:
        for p in d.points:
            r = records[(arm, s, p)]
            fault = unit_of(r["outliers"][0]["module"])
            for u, n in enumerate(r["unit_recovered"]):
                if u != fault:
                    steps.setdefault(u, []).append(n)
    means = {u: statistics.fmean(v) for u, v in steps.items()}
    return [(u, m) for u, m in sorted(means.items()) if m >= STANDING * d.horizon]


def unit_work(
    records: Records, d: Design, arm: str, standing_units: set[int]
) -> dict[str, float] | None:
    """Mean over the design's branches of the share of the linear work ``arm`` recovered on the
    standing units, on the other units of their layers, on the faulted unit (never counted in
    the first two) and on every other unit, from the per-unit recovered steps and the units'
    sizes; ``None`` when the sizes do not give the record's ``flops_recovered`` (another model,
    or GEMM subsets)."""
    parts: dict[str, list[float]] = {"standing": [], "layer": [], "fault": [], "rest": []}
    layers = {u // len(PROJECTIONS) for u in standing_units}
    for s in d.seeds:
        for p in d.points:
            r = records[(arm, s, p)]
            n = r["unit_recovered"]
            size = _sizes(len(n))
            total = sum(size) * d.horizon
            w = [n[u] * size[u] / total for u in range(len(n))]
            if not math.isclose(sum(w), r["flops_recovered"], rel_tol=1e-6, abs_tol=1e-9):
                return None
            fault = unit_of(r["outliers"][0]["module"])
            kind = dict.fromkeys(range(len(n)), "rest")
            kind |= {u: "layer" for u in range(len(n)) if u // len(PROJECTIONS) in layers}
            kind |= dict.fromkeys(standing_units, "standing") | {fault: "fault"}
            for name in parts:
                parts[name].append(sum(w[u] for u in kind if kind[u] == name))
    return {k: statistics.fmean(v) for k, v in parts.items()}


def _comparison(records: Records, d: Design, arm: str, rival: str, family: int) -> dict[str, Any]:
    diffs = per_seed(records, d, arm, rival)
    m, h, v = preregistered.verdict(diffs, family)
    below, n, p = preregistered.sign_test(diffs)
    return {"arm": arm, "rival": rival, "mean": m, "half": h, "verdict": v} | {
        "below": below,
        "n": n,
        "p": p,
        "seeds": len(diffs),
    }


def _pilot(r: FaultRegime) -> dict[str, Any] | None:
    """The static gap of the regime's first pilot (a smaller outlier), on its own records."""
    records, _ = one_host(r.src.records(r.name, family=f"{FAMILY}/{PILOT}"))
    if not records:
        return None
    low = next(x for k, x in records.items() if k[0] == "low-cost")
    o = low["outliers"][0]
    seeds = list(dict.fromkeys(s for _, s, _ in records))
    points = sorted({p for _, _, p in records})
    horizon = max(int(e) for e in low["heldout"])
    ok = complete_seeds(records, ["low-cost", "BF16"], seeds, points)
    if not ok:
        return None
    gap = interval(per_seed(records, Design(tuple(ok), tuple(points), horizon), "low-cost", "BF16"))
    peak = math.log2(o["growth"] ** o["rise"])
    return {"peak": f"2^{peak:.0f}", "gap": gap, "seeds": len(ok), "points": len(points)}


def _stopping(r: FaultRegime, k: int) -> dict[str, Any] | None:
    """The stopping history and, for the comparisons against the fixed rules, their verdicts at
    the planned seeds (the first look) and the sign count at the end."""
    stop = preregistered.STOPPING.get(r.name)
    d = r.design
    if stop is None or d is None:
        return None
    family = len(preregistered.comparisons(k))
    arm = f"GNMR+e {k}"
    first, final = [], []
    for rival in (f"random {k}", f"NVIDIA last-{k}"):
        if rival not in r.table_arms or arm not in r.table_arms:
            continue
        dc = r.pair_design(arm, rival)
        planned = [s for s in stop.planned if s in dc.seeds]
        if len(planned) >= 2 and stop.added:
            first.append(
                _comparison(r.records, replace(dc, seeds=tuple(planned)), arm, rival, family)
            )
        final.append(_comparison(r.records, dc, arm, rival, family))
    return {"stop": stop, "first": first, "final": final, "family": family}


def _convexity(r: FaultRegime, k: int) -> dict[str, Any] | None:
    """The old cost model's two flatteries on the low-cost arm, against the bounded model
    (B200): the largest extra-step count of one branch (unbounded), the mean of per-branch
    speed-ups beside the speed-up at the mean extra steps; then, from :attr:`FaultRegime.costs`,
    the branches not reached in the schedule (of those with steps left) and behind at its end,
    and the low-cost path's and ``GNMR+e k``'s speed-ups as the tables now give them."""
    d = r.design
    p = cost.price(r.formats(), "B200")
    if p.note is not None:
        return None
    branches, seeds = [], []
    for s in d.seeds:
        row = [
            cost.branch_cost(
                r.records[("low-cost", s, pt)], r.records[("BF16", s, pt)], d.horizon, p
            )
            for pt in d.points
        ]
        if any(c.extra_steps is None or c.speedup is None for c in row):
            return None
        branches += zip(d.points, row, strict=True)
        seeds.append(row)
    extra = statistics.fmean(statistics.fmean(c.extra_steps for c in row) for row in seeds)
    ratios = statistics.fmean(statistics.fmean(c.speedup for c in row) for row in seeds)
    t = cost.step_time(0.0, p)
    point, worst = max(branches, key=lambda b: b[1].extra_steps or 0.0)
    arm = f"GNMR+e {k}"
    now = {
        a: r.costs[a] | {"b200": r.costs[a]["hardware"]["B200"]}
        for a in ("low-cost", arm)
        if a in r.costs
    }
    return {
        "max_extra": worst.extra_steps,
        "past_end": point + d.horizon + (worst.extra_steps or 0.0) > SCHEDULE_END,
        "mean_extra": extra,
        "mean_of_ratios": ratios,
        "at_mean": d.horizon / ((d.horizon + extra) * t),
        "horizon": d.horizon,
        "schedule": SCHEDULE_END,
        "arm": arm,
        "now": now,
        "null_at_end": _at_end(r.costs.get("null BF16 (1e-6)")),
    }


def _at_end(row: dict[str, Any] | None) -> str | None:
    """``2 of 10``: an arm's branches behind BF16 at points that end the schedule."""
    if row is None or row.get("at_end") is None:
        return None
    behind, n = row["at_end"]
    return f"{behind} of {n}"


def rests_on(r: FaultRegime, k: int) -> dict[str, Any] | None:
    """The figures of the module docstring for ``GNMR+e k`` in the regime ``r`` (``None`` when
    it is not in the regime's design)."""
    d, arm = r.design, f"GNMR+e {k}"
    if d is None or arm not in r.table_arms:
        return None
    keep = standing(r.records, d, arm)
    units = {u for u, _ in keep}
    gap_seeds = r.pair_design(arm, f"random {k}") or d
    gaps = dict(
        zip(gap_seeds.seeds, per_seed(r.records, gap_seeds, "low-cost", "BF16"), strict=True)
    )
    faulted = {
        s: unit_of(r.records[("low-cost", s, d.points[0])]["outliers"][0]["module"]) for s in gaps
    }
    covered = [s for s in gaps if faulted[s] in units]
    others = tuple(s for s in gaps if s not in covered)
    family = len(preregistered.comparisons(k))
    margins = []
    if covered and len(others) >= 2:
        for rival in (f"random {k}", f"NVIDIA last-{k}"):
            if rival in r.table_arms:
                dc = replace(r.pair_design(arm, rival) or d, seeds=others)
                margins.append(_comparison(r.records, dc, arm, rival, family))
    norm = f"GNMR {k}"
    gap_at = {
        e: interval(per_seed(r.records, replace(d, horizon=e), "low-cost", "BF16")) for e in r.evals
    }
    o = r.outlier()
    return {
        "k": k,
        "standing": [(unit_name(u), m) for u, m in keep],
        "horizon": d.horizon,
        "covered": covered,
        "seeds": len(gaps),
        "covered_share": sum(gaps[s] for s in covered) / sum(gaps.values()),
        "margins": margins,
        "work": unit_work(r.records, d, arm, units),
        "total_work": work(r.records, d, arm),
        "peak": o["peak"],
        "window": (o["offset"], o["offset"] + o["rise"] + o["hold"] - 1),
        "pilot": _pilot(r),
        "norm": (
            {"share": share_closed(r.records, d, norm), "work": work(r.records, d, norm)}
            if norm in r.table_arms
            else None
        ),
        "gap_at": gap_at,
        "convexity": _convexity(r, k),
        "stopping": _stopping(r, k),
    }


def _c(c: dict[str, Any]) -> str:
    return (
        f"{c['mean']:+.4f} +- {c['half']:.4f} {c['verdict']}, {c['below']} of {c['n']} "
        f"below (p = {c['p']:.2g})"
    )


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


def cells(x: dict[str, Any]) -> list[str]:
    """One regime's column of :func:`table`, the figures of :func:`rests_on` formatted."""
    w, cv, st = x["work"], x["convexity"], x["stopping"]
    out = [", ".join(f"{u} {m:.0f}" for u, m in x["standing"])]
    share = f"{100 * x['covered_share']:.0f}%"
    out.append(
        f"{len(x['covered'])} of {x['seeds']}: {', '.join(map(str, x['covered']))} ({share})"
    )
    out.append("; ".join(f"vs {c['rival']} {_c(c)}" for c in x["margins"]) or "-")
    parts = (w["standing"], w["layer"], w["fault"], w["rest"]) if w else ()
    out.append(f"{100 * x['total_work']:.1f}% = " + " + ".join(f"{100 * p:.1f}" for p in parts))
    pilot = x["pilot"]
    out.append(
        x["peak"]
        + (
            f" ({pilot['peak']}: {pilot['gap'][0]:+.4f} +- {pilot['gap'][1]:.4f},"
            f" {pilot['seeds']} seeds x {pilot['points']} points)"
            if pilot
            else ""
        )
    )
    norm = x["norm"]
    out.append(
        f"closes {norm['share'][0]:+.2f} +- {norm['share'][1]:.2f}, "
        f"{100 * norm['work']:.1f}% of the work"
        if norm
        else "not run"
    )
    gaps = list(x["gap_at"].values())
    trend = "grows after the window" if gaps[-1][0] > gaps[0][0] else "shrinks after the window"
    at = ", ".join(f"{g[0]:+.4f} +- {g[1]:.4f} ({e})" for e, g in x["gap_at"].items())
    out.append(f"{at} ({x['window'][0]}-{x['window'][1]}): {trend}")
    if cv:
        past = ", past the schedule's end" if cv["past_end"] else ""
        out.append(
            f"{cv['max_extra']:.0f}{past}; {cv['mean_of_ratios']:.2f} -> {cv['at_mean']:.2f} "
            f"({cv['mean_extra']:.1f} steps)"
        )
        low, arm = cv["now"]["low-cost"], cv["now"].get(cv["arm"])
        end = low["at_end"] or (0, 0)
        text = f"{low['not_reached'][0]} of {low['not_reached'][1]} / {end[0]} of {end[1]}"
        if arm:
            sp = arm["b200"]["speedup"]
            speed = f"{sp[0]:.2f} +- {sp[1]:.2f}" if sp else arm["b200"]["note"]
            behind = arm["at_end"] or (0, 0)
            text += f"; {speed} (behind at the end on {behind[0]} of {behind[1]}, "
            text += f"the BF16 null on {cv['null_at_end']})"
        out.append(text)
    else:
        out += ["-", "-"]
    if st:
        stop, looks = st["stop"], len(st["stop"].looks)
        head = f"{len(stop.planned)} + {len(stop.added)}" + (
            f" ({', '.join(map(str, stop.added))}; looks at {', '.join(map(str, stop.looks))})"
            if stop.added
            else ""
        )
        first = "; ".join(f"at {len(stop.planned)}: vs {c['rival']} {_c(c)}" for c in st["first"])
        final = "; ".join(
            f"{c['below']} of {c['n']} below {c['rival']} "
            f"(p = {c['p']:.2g}, {c['p'] * st['family'] * looks:.2g})"
            for c in st["final"]
        )
        out.append("; ".join(p for p in (head, first, final) if p))
    else:
        out.append("-")
    return out


def table(items: list[tuple[str, dict[str, Any]]]) -> str:
    """What the verdicts rest on: one row per figure, one column per regime."""
    columns = [cells(x) for _, x in items]
    rows = [[what, *(col[i] for col in columns)] for i, what in enumerate(ROWS)]
    return markdown_table(["", *(f"`{name}`" for name, _ in items)], rows)
