"""The fault regimes' section of RESULTS.md (issue 35), from ``results/faults/<regime>.jsonl``: per
records file one :class:`FaultRegime` and its tables for ``templates/faults.md.j2``, the
pre-registered comparisons of every regime in one table (:mod:`benchmarks.harness.preregistered`)
and the records' provenance in one. Why the rules below: docs/benchmarks.md#sweep-faults.

**The design.** A figure pairs arms on the same (seed, point) and averages a seed's points, so a
table needs all its arms at every (seed, point) of one grid: the largest such grid, by branches
per arm, then seeds (:func:`largest_design`). An arm that would leave it under :data:`MIN_SEEDS`
seeds waits outside it (:func:`choose_arms`); arms run on part of the grid by design (the loss
oracle) are read on their own grid. A pre-registered comparison pairs its two arms over every seed
that has both at the design's points (:meth:`FaultRegime.pair_design`).

**One host per branch point.** Another CPU trains other bits from the same commit, so a
(seed, point) is read on the host of its BF16 branch and other hosts' records there are set aside
and counted (:func:`one_host`). No torch.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from itertools import combinations
from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import (
    Design,
    Records,
    paired,
    per_seed,
    share_closed,
    troubles,
)
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.provenance import UNKNOWN
from benchmarks.harness.stats import interval, plus_minus
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source, describe
from benchmarks.report.words import listing, resolved

FAMILY = "faults"
NULLS = {"null BF16 (1e-6)": "BF16", "null low-cost (1e-6)": "low-cost"}
NULLS["low-cost (SR seed 1)"] = "low-cost"
"""Each null control and the arm it pairs with (the SR seed only in stochastic regimes)."""
SUBSET = ("loss oracle ", "single ")
LATE = ("NVIDIA late", "late fwd")
"""Name prefixes of the arms run on part of the grid only, and of the time rules."""
ORDER = ("random", "GNMR", "GNMR+e", "GNMR+e v2", "e-only", "GNMR+e lean", "TE autoswitch")
ORDER += ("oracle", "loss oracle", "random wgrad", "GNMR+e wgrad")
FIXED = ("low-cost", "BF16", *NULLS, "NVIDIA last", "TE autoswitch", *LATE)
"""The tables' order: the unbudgeted arms (by prefix), then per budget the policies."""
SCHEDULE_END = 400
"""The trunk's schedule (``Instrument.trunk_steps``): a branch from ``SCHEDULE_END - horizon``
ends it, the one place a run has the late rules' window."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_SEEDS = 2
COUNTERPART = {"outlier_torchao_tensorwise": "outlier_fp8_tensor"}
"""A regime set beside another with the same trunks, seeds, points and outlier (issue 43)."""
BESIDE_ARMS = ("GNMR+e 4", "random 4", "NVIDIA last-4", "oracle 4")
NULL_BAR = 1 / 3
"""Issue 35's bar: each null's interval holds 0 and reaches at most this share of the gap."""


def budget(arm: str) -> int | None:
    """``k`` of a budgeted arm (``GNMR+e v2 4``: 4), else ``None``."""
    head, _, tail = arm.rpartition(" ")
    return int(tail) if head in ORDER and tail.isdigit() else None


def rank(arm: str) -> tuple[int, int, int, str]:
    """The tables' order, total (ties by name: no set's iteration order reaches the document)."""
    k = budget(arm)
    if k is not None:
        return 1, k, ORDER.index(arm.rpartition(" ")[0]), arm
    first = [i for i, p in enumerate(FIXED) if arm == p or arm.startswith(p)]
    return 0, first[0] if first else len(FIXED), 0, arm


def unit_of(module: str) -> int:
    """The unit index of ``model.layers.<L>.<block>.<proj>`` in the records' order."""
    parts = module.split(".")
    return int(parts[2]) * len(PROJECTIONS) + PROJECTIONS.index(parts[-1])


def unit_name(u: int) -> str:
    layer, j = divmod(u, len(PROJECTIONS))
    return f"L{layer}.{PROJECTIONS[j].removesuffix('_proj')}"


def pm(pair: Sequence[float] | None, digits: int = 4) -> str:
    """``+0.0031 +- 0.0011``; ``(one seed)`` without a half-width; ``-`` for none."""
    if pair is not None and math.isnan(pair[1]):
        return f"{pair[0]:+.{digits}f} (one seed)"
    return plus_minus(pair, digits)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def machine(record: dict[str, Any]) -> str:
    """The host a record was trained on (CPU model and ISA), ``not recorded`` without one."""
    h = record.get("provenance", {}).get("host")
    return f"{h['cpu']}, ISA {h['isa']}" if isinstance(h, dict) else UNKNOWN


def one_host(records: Records) -> tuple[Records, Records]:
    """(kept, set aside): per (seed, point) the records on the host of its BF16 branch (without
    one, the host with the most records there, ties by name) are kept."""
    hosts: dict[tuple[int, int], Counter[str]] = {}
    for (_, s, p), r in records.items():
        hosts.setdefault((s, p), Counter())[machine(r)] += 1
    chosen = {}
    for (s, p), counts in hosts.items():
        ref = records.get(("BF16", s, p))
        best = sorted(counts, key=lambda h: (-counts[h], h))[0]
        chosen[(s, p)] = machine(ref) if ref is not None else best
    kept: Records = {}
    aside: Records = {}
    for key, r in records.items():
        (kept if machine(r) == chosen[(key[1], key[2])] else aside)[key] = r
    return kept, aside


def complete_seeds(
    records: Records, arms: Sequence[str], seeds: Sequence[int], points: Sequence[int]
) -> list[int]:
    """The seeds of ``seeds`` with a record of every arm at every point of ``points``."""
    return [s for s in seeds if all((a, s, p) in records for a in arms for p in points)]


def largest_design(records: Records, arms: Sequence[str], horizon: int) -> Design | None:
    """The seeds x points grid with every arm of ``arms``, largest by branches per arm, then
    seeds (points: any subset of those recorded); ``None`` when there is none."""
    seeds = list(dict.fromkeys(s for a, s, _ in records if a in arms))
    points = sorted({p for a, _, p in records if a in arms})
    best, design = (0, 0), None
    for n in range(len(points), 0, -1):
        for pts in combinations(points, n):
            got = complete_seeds(records, arms, seeds, pts)
            if (len(got) * n, len(got)) > best:
                best, design = (len(got) * n, len(got)), Design(tuple(got), pts, horizon)
    return design


def choose_arms(
    records: Records, arms: Sequence[str], horizon: int, high: str = "BF16"
) -> tuple[Design | None, list[str], list[str]]:
    """(design, its arms, the arms waiting): while the design of all ``arms`` has fewer than
    :data:`MIN_SEEDS` seeds and the static arms (low-cost, ``high``) alone have that many, the
    arm with the fewest records leaves it (ties: the last in the tables' order)."""
    kept, waiting, statics = list(arms), [], ["low-cost", high]
    alone = largest_design(records, statics, horizon)
    while True:
        d = largest_design(records, kept, horizon)
        d = replace(d, high=high) if d else None
        if d is None or len(d.seeds) >= MIN_SEEDS or alone is None:
            return d, kept, waiting
        if len(alone.seeds) < MIN_SEEDS or len(kept) <= 2:
            return d, kept, waiting
        counts = {a: sum(k[0] == a for k in records) for a in kept if a not in statics}
        worst = min(reversed(list(counts)), key=counts.__getitem__)
        kept.remove(worst)
        waiting.append(worst)


def progress(records: Records, d: Design, arms: Sequence[str]) -> list[tuple[int, list[str]]]:
    """(seeds with every design point, the arms) of each of ``arms`` short of all their seeds."""
    seeds = list(dict.fromkeys(s for a, s, _ in records if a in arms))
    out: dict[int, list[str]] = {}
    for a in arms:
        n = len(complete_seeds(records, [a], seeds, d.points))
        if n < len(seeds):
            out.setdefault(n, []).append(a)
    return sorted(out.items())


def work(records: Records, d: Design, arm: str) -> float:
    """Mean share of the linear-layer work on the recovery path (``flops_recovered``)."""
    keys = [(arm, s, p) for s in d.seeds for p in d.points]
    return statistics.fmean(cost.flops_share(records[k])[0] for k in keys)


def on_fault(records: Records, d: Design, arm: str) -> float | None:
    """Mean over branches that recovered anything: the share of the arm's recovered unit-steps
    spent on the faulted unit."""
    shares = []
    for r in (records[(arm, s, p)] for s in d.seeds for p in d.points):
        if r.get("unit_recovered") and r["recovered_unit_steps"] and r.get("outliers"):
            u = unit_of(r["outliers"][0]["module"])
            shares.append(r["unit_recovered"][u] / r["recovered_unit_steps"])
    return statistics.fmean(shares) if shares else None


def reach(pair: Sequence[float]) -> float:
    """How far a null's 95% interval reaches from 0: ``|mean| + half-width``."""
    return abs(pair[0]) + (0.0 if math.isnan(pair[1]) else pair[1])


def spend(a: float, b: float) -> str:
    """``the same work`` within a tenth of the larger (or both under 0.5%), else more / less."""
    if abs(a - b) <= 0.1 * max(a, b) or max(a, b) < 0.005:
        return "the same work"
    return "more work" if a > b else "less work"


class FaultRegime:
    """One fault regime's records (on one host per branch point) and its section's figures."""

    def __init__(self, src: Source, name: str) -> None:
        self.src, self.name = src, name
        self.records, self.set_aside = one_host(src.records(name, family=FAMILY))
        self.arms = sorted({a for a, _, _ in self.records if not a.startswith(SUBSET)}, key=rank)
        self.low = next((r for k, r in self.records.items() if k[0] == "low-cost"), None)
        self.evals = sorted(int(e) for e in self.low["heldout"]) if self.low else []
        self.horizon = self.evals[-1] if self.evals else 0

    @cached_property
    def chosen(self) -> tuple[Design | None, list[str], list[str]]:
        if self.low is None or not any(a == "BF16" for a, _, _ in self.records):
            return None, [], list(self.arms)
        return choose_arms(self.records, self.arms, self.horizon)

    design = property(lambda self: self.chosen[0])
    table_arms = property(lambda self: self.chosen[1])
    waiting = property(lambda self: self.chosen[2])

    def progress(self) -> list[tuple[int, list[str]]]:
        return progress(self.records, self.design, self.table_arms) if self.design else []

    def all_seeds(self) -> list[int]:
        return list(dict.fromkeys(s for a, s, _ in self.records if a in self.arms))

    def left_points(self) -> list[int]:
        """Points recorded but left out of the design."""
        return sorted({p for a, _, p in self.records if a in self.arms} - set(self.design.points))

    def outlier(self) -> dict[str, Any] | None:
        """The fault plan as the low-cost record states it; ``None`` without a fault."""
        if not self.low["outliers"]:
            return None
        o = self.low["outliers"][0]
        n = math.log2(o["growth"] ** o["rise"])
        peak = f"2^{n:.0f}" if n == int(n) else f"{o['growth'] ** o['rise']:g}"
        offset = o["start"] - self.low["point"]
        flags = {
            "whole": o.get("channel") is None,
            "instant": o["rise"] == 1,
            "held": o["hold"] > 0,
        }
        proj = o["module"].rpartition(".")[2]
        return (
            o | flags | {"offset": offset, "peak": peak, "proj": proj, "growth": f"{o['growth']:g}"}
        )

    def spec(self) -> dict[str, Any]:
        return self.low["arm_spec"]

    def options(self, path: str) -> str:
        return json.dumps(self.spec()[path], sort_keys=True)

    def faults(self) -> list[tuple[int, str, int | None]]:
        """(seed, unit, channel) the fault struck, per seed of the design."""
        out = []
        for s in self.design.seeds:
            for o in self.records[("low-cost", s, self.design.points[0])]["outliers"][:1]:
                out.append((s, unit_name(unit_of(o["module"])), o.get("channel")))
        return out

    def gap_at(self) -> dict[int, tuple[float, float]]:
        """The static gap (low-cost - BF16) at every evaluation step (95%)."""
        d = self.design
        return {
            e: paired(self.records, replace(d, horizon=e), "low-cost", "BF16") for e in self.evals
        }

    def bar(self) -> dict[str, Any]:
        """Issue 35's bar at the horizon: the gap resolved, every null holding 0 and reaching at
        most :data:`NULL_BAR` of it; per null its interval, reach and whether it fails."""
        gap, nulls = paired(self.records, self.design, "low-cost", "BF16"), []
        for null, twin in NULLS.items():
            if null in self.table_arms:
                pair = paired(self.records, self.design, null, twin)
                ratio = reach(pair) / abs(gap[0])
                fails = resolved(pair) or not ratio <= NULL_BAR
                nulls.append(
                    {"name": null.replace(" (1e-6)", ""), "pair": pair, "ratio": ratio}
                    | {"excludes": resolved(pair), "fails": fails}
                )
        ok = resolved(gap) and bool(nulls) and not any(n["fails"] for n in nulls)
        return {"gap": gap, "resolved": resolved(gap), "nulls": nulls, "passes": ok}

    def aside(self) -> dict[str, Any] | None:
        """What :func:`one_host` set aside: count, (seed, point)s, arms and hosts."""
        if not self.set_aside:
            return None
        where = len({(s, p) for _, s, p in self.set_aside})
        arms = sorted({a for a, _, _ in self.set_aside}, key=rank)
        hosts = sorted({machine(r) for r in self.set_aside.values()})
        return {"n": len(self.set_aside), "where": where, "arms": arms, "hosts": hosts}

    # -- arms, cost

    def formats(self) -> cost.Formats:
        s = self.spec()
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    def error_cost(self) -> cost.ErrorCost | None:
        return error_cost(self.src, self.formats().backend)

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`benchmarks.harness.cost.summarize_costs` of the design's arms, bounded by the
        trunk's schedule, the error term priced."""
        return cost.summarize_costs(
            self.records,
            self.design,
            self.formats(),
            arms=self.table_arms,
            schedule=SCHEDULE_END,
            error=self.error_cost(),
        )

    def priced(self) -> dict[str, Any]:
        """The formats priced and the error term's ``C`` (``borrowed``: not timed on this
        backend, the largest measured figure)."""
        e = self.error_cost()
        line = cost.assumptions(self.formats())[-1].removeprefix("Priced: ").removesuffix(".")
        c = None if e is None else f"{100 * e.share:.1f}%"
        return {"formats": line, "c": c, "borrowed": e is not None and e.source.startswith("not")}

    def arms_table(self) -> str:
        """Per arm: work, held-out - BF16, share of the gap closed (95% over seeds), diverged
        branches, the faulted unit's share, then the cost table's cells (the error term's
        cost, extra steps, reach, the speed-ups per hardware group)."""
        d, r = self.design, self.records
        lines = cost.cost_table(self.costs, horizon=self.horizon).splitlines()
        head, *rows = (x.strip("| ").split(" | ") for x in lines[:1] + lines[2:])
        cells = {row[0]: row[1:] for row in rows}
        header = ["arm", "recovered work", "held-out - BF16", "share of the gap closed"]
        header += ["diverged", "faulted unit's share of its unit-steps", *head[2:]]
        out = []
        for a in self.table_arms:
            c = cells.get(a, [pct(work(r, d, a))] + ["-"] * (len(head) - 2))
            row = [a, c[0], pm(paired(r, d, a, d.high)), pm(share_closed(r, d, a), 2)]
            out.append([*row, str(troubles(r, d, a)[1]), pct(on_fault(r, d, a)), *c[1:]])
        return markdown_table(header, out)

    # -- the pre-registered comparisons

    def budgets(self) -> list[int]:
        """The budgets of the GNMR+e arms recorded (a wgrad arm's ``3k`` is none), else the
        pre-registered one."""
        ks = {budget(a) for a in self.arms if a.startswith("GNMR+e ") and "wgrad" not in a}
        return sorted(k for k in ks if k) or [budget(preregistered.COMPARISONS[0].arm) or 4]

    def pair_design(self, arm: str, rival: str) -> Design | None:
        """The design's points on every seed with both arms at all of them, where that is more
        seeds than the design's (a power run)."""
        d = self.design
        if d is None:
            return None
        seeds = complete_seeds(self.records, [arm, rival], self.all_seeds(), d.points)
        return replace(d, seeds=tuple(seeds)) if len(seeds) > len(d.seeds) else d

    def not_run(self, arm: str) -> str | None:
        """Why a comparison's ``arm`` has no record in this regime (``None``: it has some)."""
        if any(k[0] == arm for k in self.records):
            return None
        backend = self.spec()["backend"] if self.low else None
        if arm.startswith("TE autoswitch") and backend not in (None, "fp8_emulated"):
            return f"not run: TE's rule runs on fp8_emulated's specs, this regime on {backend}"
        return f"not run in this regime ({arm} is not among its arms)"

    def preregistered(self) -> list[dict[str, Any]]:
        """The regime's family per budget (:func:`benchmarks.harness.preregistered.family`):
        per comparison the Bonferroni-adjusted interval and verdict over its own grid, the sign
        count, the tie reading and both arms' work; ``missing``: arms not in the design."""
        out = []
        for k in self.budgets():
            family = preregistered.family(self.name, k)
            for c in family:
                missing = [a for a in (c.arm, c.rival) if a not in self.table_arms]
                why = [w for w in map(self.not_run, (c.arm, c.rival)) if w is not None]
                row: dict[str, Any] = {"c": c, "missing": missing, "not_run": why[:1]}
                dc = self.pair_design(c.arm, c.rival)
                if not missing and dc:
                    diffs = per_seed(self.records, dc, c.arm, c.rival)
                    m, h, v = preregistered.verdict(diffs, len(family))
                    works = [work(self.records, dc, a) for a in (c.arm, c.rival)]
                    below, n, p = preregistered.sign_test(diffs)
                    gap = paired(self.records, dc, "low-cost", "BF16")[0]
                    tied = preregistered.reads_ties(self.name) and preregistered.tie(m, h, gap)
                    row |= {"mean": m, "half": h, "verdict": v, "work": works, "seeds": len(diffs)}
                    row |= {"spend": spend(*works), "below": below, "n": n, "p": p, "tie": tied}
                out.append(row)
        return out

    def verdict_rows(self) -> list[list[str]]:
        """The regime's rows of :func:`verdict_table` (one row when none of its arms ran)."""
        rows = self.preregistered()
        if rows and all(r["not_run"] for r in rows):
            return [[self.name, "all four", "-", "-", rows[0]["not_run"][0], "-", "-", "-"]]
        out = []
        for r in rows:
            name = f"{r['c'].arm} - {r['c'].rival}"
            if r["not_run"] or r["missing"]:
                why = r["not_run"][0] if r["not_run"] else f"waiting for {listing(r['missing'])}"
                out.append([self.name, name, "-", "-", why, "-", "-", "-"])
                continue
            half = "-" if math.isnan(r["half"]) else f"{r['half']:.4f}"
            word = r["verdict"] + (" (a tie)" if r["tie"] else "")
            signs = f"{r['below']} of {r['n']} (p = {r['p']:.3f})"
            works = f"{pct(r['work'][0])} / {pct(r['work'][1])}"
            out.append([self.name, name, f"{r['mean']:+.4f}", half, word, signs, works])
            out[-1].append(str(r["seeds"]))
        return out

    # -- beside another regime, the late rules, the loss oracle

    def beside(self) -> dict[str, Any] | None:
        """This regime beside :data:`COUNTERPART`'s on the design's seeds recorded by both on
        one host at every point (``table`` ``None`` under :data:`MIN_SEEDS` of them): each one's
        static gap, nulls and arms' shares of the gap, and the differences across the two,
        paired on each seed (95%; a share's by the delta method)."""
        name, d = COUNTERPART.get(self.name), self.design
        if name is None or d is None:
            return None
        other = FaultRegime(self.src, name)
        arms = [a for a in ("low-cost", "BF16", *NULLS, *BESIDE_ARMS) if a in self.table_arms]
        seeds = [
            s
            for s in complete_seeds(other.records, arms, d.seeds, d.points)
            if all(same_host(self.records, other.records, s, p) for p in d.points)
        ]
        if len(seeds) < MIN_SEEDS:
            return {"other": name, "table": None, "seeds": seeds}
        d, both = replace(d, seeds=tuple(seeds)), (self.records, other.records)
        merged = {
            (f"{t}:{a}", s, p): r
            for t, g in zip("ab", both, strict=True)
            for (a, s, p), r in g.items()
        }
        x, y = (per_seed(merged, d, f"{t}:low-cost", f"{t}:BF16") for t in "ab")
        gap = interval([u - v for u, v in zip(x, y, strict=True)])
        rows = [
            ["static gap (low-cost - BF16)", *(pm(paired(g, d, "low-cost", "BF16")) for g in both)]
        ]
        rows[0].append(pm(gap))
        for null, twin in NULLS.items():
            if null in arms:
                rows.append(
                    [f"{null} - {twin}", *(pm(paired(g, d, null, twin)) for g in both), "-"]
                )
        ours = [a for a in arms if a in BESIDE_ARMS]
        for arm in ours:
            shares = [pm(share_closed(g, d, arm), 2) for g in both]
            diff = pm(share_difference(*both, d, arm), 2)
            rows.append([f"share of the gap closed, {arm}", *shares, diff])
        for arm in ("low-cost", "BF16", *ours):
            rows.append(
                [f"held-out, {arm}", "-", "-", pm(paired(merged, d, f"a:{arm}", f"b:{arm}"))]
            )
        header = ["figure", self.name, name, f"{self.name} - {name}, paired"]
        return {"other": name, "table": markdown_table(header, rows), "seeds": seeds}

    def late(self) -> dict[str, Any] | None:
        """Per time rule in the design: the points where it runs the low-cost path throughout
        and the recovered work (%) where it acts; ``GNMR+e k - <rule>`` at the point that ends
        the schedule, on every seed with all table arms there (95%). ``None`` without one."""
        rules = [a for a in self.table_arms if a.startswith(LATE)]
        if not rules:
            return None
        point = SCHEDULE_END - self.horizon
        seeds = complete_seeds(self.records, self.table_arms, self.all_seeds(), [point])
        d = Design(tuple(seeds), (point,), self.horizon)
        acts = []
        for a in rules:
            by: dict[int, list[float]] = {}
            for (arm, _, p), r in self.records.items():
                if arm == a:
                    by.setdefault(p, []).append(cost.flops_share(r)[0])
            mean = {p: statistics.fmean(v) for p, v in sorted(by.items())}
            busy = [(p, f"{100 * w:.0f}%") for p, w in mean.items() if w > 0]
            acts.append({"arm": a, "idle": [p for p, w in mean.items() if w == 0], "busy": busy})
        ours = [f"{p} {k}" for k in self.budgets() for p in ("GNMR+e", "GNMR+e v2")]
        pairs = [
            (e, a, pm(paired(self.records, d, e, a)))
            for e in ours
            if e in self.table_arms and len(seeds) >= MIN_SEEDS
            for a in rules
        ]
        return {"point": point, "seeds": seeds, "acts": acts, "pairs": pairs}

    @cached_property
    def oracle(self) -> dict[str, Any] | None:
        """The loss oracle on its own grid: its share of the gap and work, ``<arm> - loss
        oracle k`` (95%), and how the faulted unit ranked among the single-unit gains."""
        oracles = sorted({a for a, _, _ in self.records if a.startswith("loss oracle ")}, key=rank)
        d = largest_design(self.records, [*oracles, "low-cost", "BF16"], self.horizon)
        if not oracles or d is None:
            return None
        r, rows = self.records, []
        for o in oracles:
            k = budget(o)
            for a in (f"GNMR+e {k}", f"GNMR+e v2 {k}", f"oracle {k}", f"random {k}"):
                if complete_seeds(r, [a], d.seeds, d.points) == list(d.seeds):
                    rows.append((a, o, pm(paired(r, d, a, o))))
        shares = [(o, pm(share_closed(r, d, o), 2), pct(work(r, d, o))) for o in oracles]
        return {"design": d, "shares": shares, "pairs": rows, "singles": singles(r, d)}


def same_host(a: Records, b: Records, seed: int, point: int) -> bool:
    """Whether two regimes' (seed, point) were read on one host (their BF16 branches')."""
    ra, rb = a.get(("BF16", seed, point)), b.get(("BF16", seed, point))
    return ra is not None and rb is not None and machine(ra) == machine(rb)


def share_difference(a: Records, b: Records, d: Design, arm: str) -> tuple[float, float]:
    """``share(a) - share(b)`` of ``arm``'s share of the static gap in two regimes on the same
    seeds, 95% by the delta method paired on each seed: each ``r = mean(x) / mean(g)``
    linearizes to the per-seed influence ``(x_s - r g_s) / mean(g)``; Student's interval on the
    per-seed difference of the two influences."""
    psi = []
    for records in (a, b):
        x, g = per_seed(records, d, d.low, arm), per_seed(records, d, d.low, d.high)
        mg = statistics.fmean(g)
        r = statistics.fmean(x) / mg
        psi.append((r, [(xs - r * gs) / mg for xs, gs in zip(x, g, strict=True)]))
    (ra, ia), (rb, ib) = psi
    if len(ia) < 2:
        return ra - rb, math.nan
    return ra - rb, interval([u - v for u, v in zip(ia, ib, strict=True)])[1]


def singles(records: Records, d: Design) -> dict[str, Any] | None:
    """Over the (seed, point) of ``d`` with every ``single <u>``: on how many the faulted unit
    had the largest single held-out gain over the low-cost arm, and per branch its rank."""
    ranks = []
    for s in d.seeds:
        for p in d.points:
            low = records[("low-cost", s, p)]
            units = range(len(low["unit_recovered"]))
            if not all((f"single {u}", s, p) in records for u in units):
                continue
            h = str(d.horizon)
            gain = [low["heldout"][h] - records[(f"single {u}", s, p)]["heldout"][h] for u in units]
            order = sorted(units, key=lambda u: (-gain[u], u))
            fault = unit_of(low["outliers"][0]["module"])
            ranks.append((s, p, unit_name(fault), order.index(fault) + 1, f"{gain[fault]:+.4f}"))
    if not ranks:
        return None
    top = sum(x[3] == 1 for x in ranks)
    return {"top": top, "n": len(ranks), "units": len(units), "ranks": ranks}


def verdict_table(regimes: Sequence[FaultRegime]) -> str:
    """Every regime's pre-registered comparisons, one row each; the regimes none of whose
    compared arms ran share one row."""
    header = ["regime", "comparison", "difference", "98.75% half-width", "verdict"]
    header += ["seeds below 0 (sign test p)", "work (arm / rival)", "seeds"]
    rows = [row for r in regimes if r.design for row in r.verdict_rows()]
    idle = [r for r in rows if r[1] == "all four"]
    if idle:
        why = idle[0][4].replace(" this regime", " these regimes").replace("its arms", "their arms")
        names = listing([f"`{r[0]}`" for r in idle])
        rows = [r for r in rows if r not in idle] + [
            [names, "all four", "-", "-", why, "-", "-", "-"]
        ]
    return markdown_table(header, rows)


def provenance_table(src: Source, names: Sequence[str]) -> str:
    """One row per records file and distinct provenance: the records, their commits (with how
    many each) and how the commit, the versions and the host are recorded."""
    rows = []
    for name in names:
        family, _, regime = name.removesuffix(".jsonl").rpartition("/")
        records = src.records(regime, family=family).values()
        groups: dict[str, Counter[str]] = {}
        for p in (r.get("provenance", {}) for r in records):
            groups.setdefault(describe(p), Counter())[p.get("commit", UNKNOWN)[:10]] += 1
        each = [
            f"{', '.join(f'{c} ({n})' for c, n in commits.items())}: "
            + text.lstrip("(").replace(")", "", 1)
            for text, commits in groups.items()
        ]
        rows.append([f"`{name}`", str(len(records)), " / ".join(each)])
    return markdown_table(["records file", "records", "commits: provenance"], rows)


def context(src: Source) -> dict[str, Any]:
    """The section's names: every fault regime with records, its verdict and provenance
    tables, the family's level and where the error term's cost was measured."""
    regimes = [r for r in (FaultRegime(src, n) for n in src.regimes(FAMILY)) if r.records]
    level = 1 - preregistered.FAMILY_ALPHA / len(preregistered.COMPARISONS)
    files = [f"{FAMILY}/{r.name}.jsonl" for r in regimes]
    measured = error_cost(src, "fp8_emulated")
    return {
        "faults": regimes,
        "fault_verdicts": verdict_table(regimes),
        "fault_provenance": provenance_table(src, files),
        "error_source": "not measured" if measured is None else measured.source,
        "prereg_level": f"{100 * level:g}%",
        "null_bar": f"{NULL_BAR:.2f}",
        "fpm": pm,
    }
