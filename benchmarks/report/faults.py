"""The fault regimes' section (issue 35): each regime's branch records
(``results/faults/<regime>.jsonl``), the design they complete, and what ``templates/faults.md.j2``
shows of them: the estimator's noise, the arms (exploratory, 95%), the four pre-registered
comparisons (:mod:`benchmarks.harness.preregistered`; one whose arm a regime never ran is marked
so, not waited for), the regime beside its :data:`COUNTERPART` (issue 43), the arms at the branch
point that ends the trunk's schedule, the loss oracle's subset and the cost at matched loss
(:mod:`benchmarks.harness.cost`).

**The design.** Every figure pairs arms on the same (seed, point) and averages a seed's points
(:mod:`benchmarks.harness.branch_stats`), so a table needs each of its arms at every (seed,
point) of one seeds x points grid. While a sweep runs, arms have different seeds: a table takes
the largest grid (most branches per arm, then most seeds) on which all its arms have a record
(:func:`largest_design`). An arm that would leave it under :data:`MIN_SEEDS` seeds (no interval)
when the two static arms alone have more waits outside it, named as in progress
(:func:`choose_arms`). Arms run only on part of the grid by design (``loss oracle k`` and its
``single <u>`` inputs) get a table of their own grid (:func:`oracle_subset`). A pre-registered
comparison pairs its two arms on the design's points over every seed that has both there
(:meth:`FaultRegime.pair_design`): a power run adds seeds for the compared arms only. No torch:
the report computes from the records.

**One host per branch point.** The same commit trains other bits on another CPU, so a trunk
rebuilt on another host is another trunk, and two arms of one (seed, point) recorded on two hosts
did not start from the same checkpoint. Every (seed, point) is read on one host, the host of its
BF16 branch (:func:`one_host`); the other host's records there are set aside and counted, and a
regime beside another pairs only the (seed, point) both recorded on one host.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from itertools import combinations
from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import (
    SPIKES_VS,
    Design,
    Records,
    paired,
    per_seed,
    share_closed,
    spike_difference,
    troubles,
)
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.provenance import UNKNOWN
from benchmarks.harness.stats import interval, plus_minus
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import listing, ordinal, resolved

FAMILY = "faults"
"""The records' folder under ``results/`` (``Regime.family`` of the fault regimes)."""

NULLS = {"null BF16 (1e-6)": "BF16", "null low-cost (1e-6)": "low-cost"}
NULLS["low-cost (SR seed 1)"] = "low-cost"
"""Each null control and the arm it is paired with (the SR seed only in stochastic regimes)."""

SUBSET = ("loss oracle ", "single ")
"""Name prefixes of the arms run on part of the grid only (:mod:`benchmarks.sweep.loss_oracle`)."""

LATE = ("NVIDIA late", "late fwd")
"""Name prefixes of the time rules, which act only near the end of the trunk's schedule."""

ORDER = ("random", "GNMR", "GNMR+e", "GNMR+e v2", "e-only", "GNMR+e lean", "TE autoswitch")
ORDER += ("oracle", "loss oracle", "random wgrad", "GNMR+e wgrad")
"""The budgeted policies (``<policy> <k>``), in the tables' order within a budget."""

FIXED = ("low-cost", "BF16", *NULLS, "NVIDIA last", "TE autoswitch", *LATE)
"""The tables' order of the unbudgeted arms (by name prefix)."""

SCHEDULE_END = 400
"""The trunk's schedule (``Instrument.trunk_steps``): a branch from ``SCHEDULE_END - horizon``
ends it, the one place a run has the late rules' window."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A layer's units in the records' order (``benchmarks.harness.model.PROJECTIONS``)."""

MIN_SEEDS = 2
"""The fewest seeds that give an interval."""

COUNTERPART = {"outlier_torchao_tensorwise": "outlier_fp8_tensor"}
"""A regime reported beside another that has the same trunks, seeds, branch points and outlier
(issue 43: torchao's real casts beside the emulation), paired across the two on each (seed,
point)."""

BESIDE_ARMS = ("GNMR+e 4", "random 4", "NVIDIA last-4", "oracle 4")
"""The arms whose shares of the static gap the two regimes' table sets side by side."""

NULL_BAR = 1 / 3
"""Issue 35's bar: each null's interval holds 0 and reaches at most this share of the gap."""


# -- names ------------------------------------------------------------------------------------


def budget(arm: str) -> int | None:
    """``k`` of a budgeted arm (``GNMR+e v2 4``: 4), else ``None``."""
    head, _, tail = arm.rpartition(" ")
    return int(tail) if head in ORDER and tail.isdigit() else None


def rank(arm: str) -> tuple[int, int, int, str]:
    """The tables' order: the unbudgeted arms (:data:`FIXED`), then by budget and policy; ties
    (arms sharing a prefix of :data:`FIXED`) by name, so the order never depends on a set's
    iteration order (string hashes differ between processes)."""
    k = budget(arm)
    if k is not None:
        return 1, k, ORDER.index(arm.rpartition(" ")[0]), arm
    if arm in FIXED:
        return 0, FIXED.index(arm), 0, arm
    first = [i for i, p in enumerate(FIXED) if arm.startswith(p)]
    return 0, first[0] if first else len(FIXED), 0, arm


def unit_of(module: str) -> int:
    """The unit index of ``model.layers.<L>.<block>.<proj>`` in the records' order."""
    parts = module.split(".")
    return int(parts[2]) * len(PROJECTIONS) + PROJECTIONS.index(parts[-1])


def unit_name(u: int) -> str:
    """``L3.down`` for unit 27."""
    layer, j = divmod(u, len(PROJECTIONS))
    return f"L{layer}.{PROJECTIONS[j].removesuffix('_proj')}"


def pm(pair: Sequence[float] | None, digits: int = 4) -> str:
    """``+0.0031 +- 0.0011``; ``+0.0031 (one seed)`` without a half-width; ``-`` for none."""
    if pair is not None and math.isnan(pair[1]):
        return f"{pair[0]:+.{digits}f} (one seed)"
    return plus_minus(pair, digits)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


# -- one host per branch point ---------------------------------------------------------------

REFERENCE = "BF16"
"""The arm whose host a (seed, point) is read on (every figure pairs with it or its trunk)."""


def machine(record: dict[str, Any]) -> str:
    """The host a record was trained on, as its provenance states it (CPU model and the ISA
    torch dispatched to); ``not recorded`` without one."""
    h = record.get("provenance", {}).get("host")
    return f"{h['cpu']}, ISA {h['isa']}" if isinstance(h, dict) else UNKNOWN


def one_host(records: Records) -> tuple[Records, Records]:
    """(kept, set aside): per (seed, point), the records trained on the host of its
    :data:`REFERENCE` branch (without one, the host with the most records there, ties by
    name) are kept, the others set aside."""
    hosts: dict[tuple[int, int], dict[str, int]] = {}
    for (_arm, s, p), r in records.items():
        counts = hosts.setdefault((s, p), {})
        counts[machine(r)] = counts.get(machine(r), 0) + 1
    chosen = {}
    for (s, p), counts in hosts.items():
        ref = records.get((REFERENCE, s, p))
        best = sorted(counts, key=lambda h: (-counts[h], h))[0]
        chosen[(s, p)] = machine(ref) if ref is not None else best
    kept: Records = {}
    aside: Records = {}
    for key, r in records.items():
        (kept if machine(r) == chosen[(key[1], key[2])] else aside)[key] = r
    return kept, aside


def same_host(a: Records, b: Records, seed: int, point: int) -> bool:
    """Whether two regimes' (seed, point) were read on one host (their BF16 branches')."""
    ra, rb = a.get((REFERENCE, seed, point)), b.get((REFERENCE, seed, point))
    return ra is not None and rb is not None and machine(ra) == machine(rb)


# -- the design ---------------------------------------------------------------------------------


def complete_seeds(
    records: Records, arms: Sequence[str], seeds: Sequence[int], points: Sequence[int]
) -> list[int]:
    """The seeds of ``seeds`` with a record of every arm at every point of ``points``."""
    return [s for s in seeds if all((a, s, p) in records for a in arms for p in points)]


def largest_design(records: Records, arms: Sequence[str], horizon: int) -> Design | None:
    """The seeds x points grid with a record of every arm of ``arms``, largest by branches per
    arm and then by seeds (points: any subset of those recorded); ``None`` when there is none."""
    seeds = list(dict.fromkeys(s for a, s, _ in records if a in arms))
    points = sorted({p for a, _, p in records if a in arms})
    best: tuple[int, int] = (0, 0)
    design = None
    for n in range(len(points), 0, -1):
        for pts in combinations(points, n):
            got = complete_seeds(records, arms, seeds, pts)
            if (len(got) * n, len(got)) > best:
                best, design = (len(got) * n, len(got)), Design(tuple(got), pts, horizon)
    return design


def choose_arms(
    records: Records, arms: Sequence[str], horizon: int, high: str = "BF16"
) -> tuple[Design | None, list[str], list[str]]:
    """(design, the arms in it, the arms waiting): while the design of all ``arms`` has fewer
    than :data:`MIN_SEEDS` seeds and the two static arms (low-cost and ``high``, the recovery
    path on every unit) alone have that many, the arm with the fewest records leaves it (ties:
    the last in the tables' order). The design names ``high`` as its recovery arm."""
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


# -- per-arm figures ------------------------------------------------------------------------------


def work(records: Records, d: Design, arm: str) -> float:
    """Mean share of the linear-layer work on the recovery path (``flops_recovered``)."""
    keys = [(arm, s, p) for s in d.seeds for p in d.points]
    return statistics.fmean(cost.flops_share(records[k])[0] for k in keys)


def on_fault(records: Records, d: Design, arm: str) -> float | None:
    """Mean over branches that recovered anything: the share of the arm's recovered unit-steps
    spent on the faulted unit (``None``: nothing recovered, or no per-unit counts)."""
    shares = []
    for s in d.seeds:
        for p in d.points:
            r = records[(arm, s, p)]
            if r.get("unit_recovered") and r["recovered_unit_steps"] and r.get("outliers"):
                u = unit_of(r["outliers"][0]["module"])
                shares.append(r["unit_recovered"][u] / r["recovered_unit_steps"])
    return statistics.fmean(shares) if shares else None


ARMS_HEADER = ["arm", "recovered work", "held-out - BF16", "held-out - low-cost"]
ARMS_HEADER += ["share of the static gap closed", SPIKES_VS, "diverged"]
ARMS_HEADER += ["faulted unit's share of its recovered unit-steps"]


def arm_row(records: Records, d: Design, arm: str) -> list[str]:
    """One row of :data:`ARMS_HEADER`: paired figures over ``d``'s seeds (95%, exploratory)."""
    spikes = None if arm == d.low else spike_difference(records, d, arm)
    return [
        arm,
        pct(work(records, d, arm)),
        pm(paired(records, d, arm, d.high)),
        pm(paired(records, d, arm, d.low)),
        pm(share_closed(records, d, arm), 2),
        pm(spikes, 1),
        str(troubles(records, d, arm)[1]),
        pct(on_fault(records, d, arm)),
    ]


def arms_table(records: Records, d: Design, arms: Sequence[str]) -> str:
    return markdown_table(ARMS_HEADER, [arm_row(records, d, a) for a in arms])


# -- one regime -----------------------------------------------------------------------------------


class FaultRegime:
    """One fault regime's records and the figures of its part of the section."""

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

    @property
    def design(self) -> Design | None:
        return self.chosen[0]

    @property
    def table_arms(self) -> list[str]:
        return self.chosen[1]

    @property
    def waiting(self) -> list[str]:
        return self.chosen[2]

    def progress(self) -> list[tuple[int, list[str]]]:
        return progress(self.records, self.design, self.table_arms) if self.design else []

    def all_seeds(self) -> list[int]:
        """The seeds of the table arms' records (the loss oracle's left out)."""
        return list(dict.fromkeys(s for a, s, _ in self.records if a in self.arms))

    def all_points(self) -> list[int]:
        return sorted({p for a, _, p in self.records if a in self.arms})

    def outlier(self) -> dict[str, Any] | None:
        """The fault plan, as the low-cost record states it (module and channel vary by seed);
        ``None`` for a regime without a fault (uniform damage: the wgrad-only FP4 rows)."""
        if not self.low["outliers"]:
            return None
        o = self.low["outliers"][0]
        peak = o["growth"] ** o["rise"]
        n = math.log2(peak)
        shown = f"2^{n:.0f}" if n == int(n) else f"{peak:g}"
        return {**o, "offset": o["start"] - self.low["point"], "peak": shown}

    def spec(self) -> dict[str, Any]:
        return self.low["arm_spec"]

    def options(self, path: str) -> str:
        """A path's options (``low_cost``, ``recovery``) as JSON, as the arms' records state
        them."""
        return json.dumps(self.spec()[path], sort_keys=True)

    def faults(self) -> list[tuple[int, str, int | None]]:
        """(seed, unit, channel) the fault struck, per seed of the design (the unit drawn from
        the seed; the window opens ``offset`` steps after each branch point)."""
        out = []
        for s in self.design.seeds:
            struck = self.records[("low-cost", s, self.design.points[0])]["outliers"]
            if not struck:
                continue
            o = struck[0]
            out.append((s, unit_name(unit_of(o["module"])), o.get("channel")))
        return out

    # -- noise

    def noise(self) -> dict[str, dict[int, tuple[float, float]]]:
        """Per figure (the static gap, each null in the design) per evaluation step: the paired
        mean and 95% half-width over seeds."""
        d, out = self.design, {}
        pairs = [("low-cost", "BF16")] + [(n, r) for n, r in NULLS.items() if n in self.table_arms]
        for a, b in pairs:
            at = {e: paired(self.records, replace(d, horizon=e), a, b) for e in self.evals}
            out[f"{a} - {b}"] = at
        return out

    def noise_table(self) -> str:
        """The static gap and each null at every evaluation, with the nulls' ``|null| / gap``:
        the farthest their 95% interval reaches from 0 (``|mean| + half-width``) over the
        gap's mean at the same step."""
        noise = self.noise()
        gap = noise["low-cost - BF16"]
        header = ["figure"]
        for e in self.evals:
            header += [f"after {e} steps", f"\\|null\\| / gap, {e}"]
        rows = []
        for name, by in noise.items():
            cells = [name if name != "low-cost - BF16" else "static gap (low-cost - BF16)"]
            for e in self.evals:
                ratio = "-" if by is gap else f"{reach(by[e]) / abs(gap[e][0]):.2f}"
                cells += [pm(by[e]), ratio]
            rows.append(cells)
        return markdown_table(header, rows)

    def bar(self) -> dict[str, Any]:
        """Issue 35's bar at the horizon: the gap resolved, every null holding 0 and reaching
        at most :data:`NULL_BAR` of it. ``failing``: (null, why) of those that do not."""
        noise = self.noise()
        gap = noise.pop("low-cost - BF16")[self.horizon]
        failing, ratios = [], []
        for name, by in noise.items():
            pair = by[self.horizon]
            ratios.append(reach(pair) / abs(gap[0]))
            if resolved(pair):
                failing.append((name, "its interval excludes 0"))
            elif not ratios[-1] <= NULL_BAR:
                failing.append((name, f"its interval reaches {ratios[-1]:.2f} times the gap"))
        return {
            "gap": gap,
            "resolved": resolved(gap),
            "nulls": list(noise),
            "failing": failing,
            "worst": max(ratios, default=math.nan),
            "passes": resolved(gap) and bool(noise) and not failing,
        }

    # -- arms

    def arms_table(self) -> str:
        return arms_table(self.records, self.design, self.table_arms)

    def budgets(self) -> list[int]:
        """The budgets of the GNMR+e arms recorded (in the design or waiting), else the
        pre-registered one; a wgrad-only arm's ``3k`` is not a budget of its own."""
        gnmr = [a for a in self.arms if a.startswith("GNMR+e ") and "wgrad" not in a]
        ks = sorted({budget(a) for a in gnmr if budget(a)})
        return ks or [budget(preregistered.COMPARISONS[0].arm)]

    def pair_design(self, arm: str, rival: str) -> Design | None:
        """A pre-registered comparison's own grid: the design's points on every seed with both
        arms at all of them (a power run adds seeds for the compared arms only), or the design
        where that has as many seeds."""
        d = self.design
        if d is None:
            return None
        seeds = complete_seeds(self.records, [arm, rival], self.all_seeds(), d.points)
        return replace(d, seeds=tuple(seeds)) if len(seeds) > len(d.seeds) else d

    def not_run(self, arm: str) -> str | None:
        """Why a pre-registered comparison's ``arm`` has no record at all in this regime
        (``None`` when it has some: a sweep in progress waits for it)."""
        if any(k[0] == arm for k in self.records):
            return None
        backend = self.spec()["backend"] if self.low else None
        if arm.startswith("TE autoswitch") and backend not in (None, "fp8_emulated"):
            return f"not run: TE's rule runs on fp8_emulated's specs, this regime on {backend}"
        return f"not run in this regime ({arm} is not among its arms)"

    def preregistered(self) -> list[dict[str, Any]]:
        """The four comparisons per budget (the regime's family, :func:`benchmarks.harness.
        preregistered.family`): per-seed paired differences over the comparison's own grid
        (:meth:`pair_design`), with :func:`benchmarks.harness.preregistered.verdict`'s
        Bonferroni-adjusted interval, the sign count (``below`` of ``n`` seeds negative, its
        two-sided ``p``), the tie reading (:func:`~benchmarks.harness.preregistered.tie`, against
        the static gap on the same grid) and both arms' recovered work; ``missing``: the arms not
        in the design yet."""
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
                    row |= {"mean": m, "half": h, "verdict": v, "work": works}
                    row |= {"spend": spend(*works), "seeds": len(diffs)}
                    below, n, p = preregistered.sign_test(diffs)
                    gap = paired(self.records, dc, "low-cost", "BF16")[0]
                    ties = preregistered.reads_ties(self.name)
                    tied = ties and preregistered.tie(m, h, gap)
                    row |= {"below": below, "n": n, "p": p, "tie": tied}
                out.append(row)
        return out

    def preregistered_table(self) -> str:
        header = ["comparison", "question", "mean difference", "98.75% half-width", "verdict"]
        header += ["seeds below 0 (sign test p)", "recovered work (arm / rival)", "seeds"]
        rows = []
        for r in self.preregistered():
            c, name = r["c"], f"{r['c'].arm} - {r['c'].rival}"
            if r["not_run"]:
                rows.append([name, c.question, "-", "-", r["not_run"][0], "-", "-", "-"])
                continue
            if r["missing"]:
                rows.append([name, c.question, "-", "-", f"waiting for {listing(r['missing'])}"])
                rows[-1] += ["-", "-", "-"]
                continue
            half = "-" if math.isnan(r["half"]) else f"{r['half']:.4f}"
            works = f"{pct(r['work'][0])} / {pct(r['work'][1])}"
            verdict = r["verdict"] + (" (a tie)" if r["tie"] else "")
            signs = f"{r['below']} of {r['n']} (p = {r['p']:.3f})"
            row = [name, c.question, f"{r['mean']:+.4f}", half, verdict, signs, works]
            rows.append([*row, str(r["seeds"])])
        return markdown_table(header, rows)

    # -- beside another regime

    def beside(self) -> dict[str, Any] | None:
        """This regime beside :data:`COUNTERPART`'s on this design's seeds and points (the
        counterpart's records of the same (seed, point), which start from the same trunk
        checkpoint): each one's static gap, nulls and arms' shares of the gap (95%), and the
        differences across the two, paired on each seed (exploratory), on the design's seeds
        that the counterpart has at every point on the same host (:func:`same_host`): its
        ``table`` is ``None`` below :data:`MIN_SEEDS` of them. ``None`` without a
        counterpart."""
        name, d = COUNTERPART.get(self.name), self.design
        if name is None or d is None:
            return None
        other = FaultRegime(self.src, name)
        arms = [a for a in ("low-cost", "BF16", *NULLS, *BESIDE_ARMS) if a in self.table_arms]
        hosts = [
            s
            for s in complete_seeds(other.records, arms, d.seeds, d.points)
            if all(same_host(self.records, other.records, s, p) for p in d.points)
        ]
        if len(hosts) < MIN_SEEDS:
            return {"other": name, "table": None, "shares": {}, "seeds": hosts}
        d = replace(d, seeds=tuple(hosts))
        merged = {
            (f"{t}:{a}", s, p): r
            for t, g in (("a", self), ("b", other))
            for (a, s, p), r in g.records.items()
        }
        rows = [_beside_gap(self.records, other.records, merged, d)]
        for null, twin in NULLS.items():
            if null in arms:
                cells = [pm(paired(g.records, d, null, twin)) for g in (self, other)]
                rows.append([f"{null} - {twin}", *cells, "-"])
        shares = {}
        for arm in arms:
            if arm in BESIDE_ARMS:
                pair = [share_closed(g.records, d, arm) for g in (self, other)]
                diff = share_difference(self.records, other.records, d, arm)
                shares[arm] = {"here": pair[0], "there": pair[1], "difference": diff}
                cells = [pm(x, 2) for x in (*pair, diff)]
                rows.append([f"share of the gap closed, {arm}", *cells])
        for arm in ("low-cost", "BF16", *(a for a in arms if a in BESIDE_ARMS)):
            diff = paired(merged, d, f"a:{arm}", f"b:{arm}")
            rows.append([f"held-out, {arm}", "-", "-", pm(diff)])
        header = ["figure", self.name, name, f"{self.name} - {name}, paired"]
        table = markdown_table(header, rows)
        return {"other": name, "table": table, "shares": shares, "seeds": list(d.seeds)}

    def aside(self) -> dict[str, Any] | None:
        """What :func:`one_host` set aside: the count, the (seed, point) it touched and the
        hosts (``None`` when every record is on its branch point's host)."""
        if not self.set_aside:
            return None
        where = sorted({(s, p) for _, s, p in self.set_aside})
        arms = sorted({a for a, _, _ in self.set_aside}, key=rank)
        hosts = sorted({machine(r) for r in self.set_aside.values()})
        return {"n": len(self.set_aside), "where": where, "arms": arms, "hosts": hosts}

    # -- where the late rules act

    @cached_property
    def late_design(self) -> Design | None:
        """The design's arms at the branch point whose branches end the schedule, on every seed
        that has them all there."""
        point = SCHEDULE_END - self.horizon
        seeds = complete_seeds(self.records, self.table_arms, self.all_seeds(), [point])
        return Design(tuple(seeds), (point,), self.horizon) if seeds else None

    def late_arms(self) -> list[str]:
        return [a for a in self.table_arms if a.startswith(LATE)]

    def late_table(self) -> str:
        return arms_table(self.records, self.late_design, self.table_arms)

    def late_pairs(self) -> list[tuple[str, str, tuple[float, float]]]:
        """``GNMR+e k - <late rule>`` at the late point (95%, exploratory)."""
        es = [f"{p} {k}" for k in self.budgets() for p in ("GNMR+e", "GNMR+e v2")]
        d, ours = self.late_design, [e for e in es if e in self.table_arms]
        return [(e, a, paired(self.records, d, e, a)) for e in ours for a in self.late_arms()]

    def acts(self, arm: str) -> list[tuple[int, float]]:
        """(point, mean recovered work over every record there) of a time rule."""
        by: dict[int, list[float]] = {}
        for (a, _, p), r in self.records.items():
            if a == arm:
                by.setdefault(p, []).append(cost.flops_share(r)[0])
        return [(p, statistics.fmean(v)) for p, v in sorted(by.items())]

    # -- the loss oracle, cost

    @cached_property
    def oracle(self) -> dict[str, Any] | None:
        return oracle_subset(self.records, self.table_arms, self.horizon)

    def formats(self) -> cost.Formats:
        s = self.spec()
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    def error_cost(self) -> cost.ErrorCost | None:
        """The error term's measured cost for this regime's backend (:mod:`.error_cost`)."""
        return error_cost(self.src, self.formats().backend)

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`benchmarks.harness.cost.summarize_costs` of the design's arms, bounded by the
        trunk's schedule (:data:`SCHEDULE_END`), the error term priced."""
        d, arms = self.design, self.table_arms
        return cost.summarize_costs(
            self.records,
            d,
            self.formats(),
            arms=arms,
            schedule=SCHEDULE_END,
            error=self.error_cost(),
        )

    def cost_table(self) -> str:
        return cost.cost_table(self.costs, horizon=self.horizon)

    def priced(self) -> str:
        """The formats priced and at what rates (the last of the cost model's assumption lines
        when given the formats), and the error term's cost ``C`` with its source."""
        line = cost.assumptions(self.formats(), self.horizon, self.evals[0])[-1]
        e = self.error_cost()
        c = "not known" if e is None else f"{100 * e.share:.1f}% ({e.source})"
        return f"{line.removesuffix('.')}; the error term's C = {c}"


def _beside_gap(a: Records, b: Records, merged: Records, d: Design) -> list[str]:
    """The row of the two regimes' static gaps and their difference per seed (95%)."""
    ga, gb = (paired(r, d, "low-cost", "BF16") for r in (a, b))
    x = per_seed(merged, d, "a:low-cost", "a:BF16")
    y = per_seed(merged, d, "b:low-cost", "b:BF16")
    diff = interval([u - v for u, v in zip(x, y, strict=True)])
    return ["static gap (low-cost - BF16)", pm(ga), pm(gb), pm(diff)]


def share_difference(a: Records, b: Records, d: Design, arm: str) -> tuple[float, float]:
    """``share(a) - share(b)`` of ``arm``'s share of the static gap
    (:func:`~benchmarks.harness.branch_stats.share_closed`) in two regimes on the same seeds,
    with a 95% half-width by the delta method paired on each seed: each share
    ``r = mean(x) / mean(g)`` linearizes to the per-seed influence ``(x_s - r g_s) / mean(g)``,
    and the interval is Student's on the per-seed difference of the two influences."""
    psi = []
    for records in (a, b):
        x, g = per_seed(records, d, d.low, arm), per_seed(records, d, d.low, d.high)
        mg = statistics.fmean(g)
        r = statistics.fmean(x) / mg
        psi.append((r, [(xs - r * gs) / mg for xs, gs in zip(x, g, strict=True)]))
    (ra, ia), (rb, ib) = psi
    n = len(ia)
    if n < 2:
        return ra - rb, math.nan
    half = interval([u - v for u, v in zip(ia, ib, strict=True)])[1]
    return ra - rb, half


def reach(pair: Sequence[float]) -> float:
    """How far a null's 95% interval reaches from 0: ``|mean| + half-width``."""
    return abs(pair[0]) + (0.0 if math.isnan(pair[1]) else pair[1])


def spend(a: float, b: float) -> str:
    """``a``'s recovered work against ``b``'s in words: ``the same work`` within a tenth of the
    larger (or both under 0.5%), else ``more work`` / ``less work``."""
    if abs(a - b) <= 0.1 * max(a, b) or max(a, b) < 0.005:
        return "the same work"
    return "more work" if a > b else "less work"


# -- the loss oracle's subset -------------------------------------------------------------------


def oracle_subset(records: Records, arms: Sequence[str], horizon: int) -> dict[str, Any] | None:
    """The ``loss oracle k`` arms on their own grid, with every table arm recorded there:
    the design, its table, ``GNMR+e k - loss oracle k`` and the like (95%), and the single-unit
    gains (``single <u>``) of each branch; ``None`` when no loss oracle ran."""
    oracles = sorted({a for a, _, _ in records if a.startswith("loss oracle ")}, key=rank)
    if not oracles:
        return None
    d = largest_design(records, [*oracles, "low-cost", "BF16"], horizon)
    if d is None:
        return None
    rest = [a for a in arms if complete_seeds(records, [a], d.seeds, d.points) == list(d.seeds)]
    rows = sorted([*rest, *oracles], key=rank)
    pairs = []
    for o in oracles:
        k = budget(o)
        for a in (f"GNMR+e {k}", f"GNMR+e v2 {k}", f"oracle {k}", f"random {k}"):
            if a in rest:
                pairs.append((a, o, paired(records, d, a, o)))
    table = arms_table(records, d, rows)
    return {"design": d, "table": table, "pairs": pairs, "singles": singles(records, d)}


def singles(records: Records, d: Design) -> list[dict[str, Any]]:
    """Per (seed, point) of ``d`` with every ``single <u>``: the unit of largest held-out gain
    over the low-cost arm, that gain, and the faulted unit's rank among the units."""
    out = []
    for s in d.seeds:
        for p in d.points:
            low = records[("low-cost", s, p)]
            units = len(low["unit_recovered"])
            if not all((f"single {u}", s, p) in records for u in range(units)):
                continue
            h = [records[(f"single {u}", s, p)]["heldout"][str(d.horizon)] for u in range(units)]
            gain = [low["heldout"][str(d.horizon)] - x for x in h]
            order = sorted(range(units), key=lambda u: (-gain[u], u))
            fault = unit_of(low["outliers"][0]["module"])
            best, where = order[0], ordinal(order.index(fault) + 1)
            out.append({"seed": s, "point": p, "best": unit_name(best), "gain": gain[best]})
            out[-1] |= {"fault": unit_name(fault), "rank": where, "units": units}
    return out


def context(src: Source) -> dict[str, Any]:
    """The section's names: every fault regime with records, the cost model's assumptions and
    the pre-registered family's level."""
    regimes = [r for r in (FaultRegime(src, n) for n in src.regimes(FAMILY)) if r.records]
    evals = next((r.evals for r in regimes if len(r.evals) > 1), [25, 50])
    level = 1 - preregistered.FAMILY_ALPHA / len(preregistered.COMPARISONS)
    return {
        "faults": regimes,
        "fault_evals": evals,
        "fault_assumptions": cost.assumptions(None, evals[-1], evals[0], SCHEDULE_END),
        "prereg_level": f"{100 * level:g}%",
        "family_size": len(preregistered.COMPARISONS),
        "schedule_end": SCHEDULE_END,
        "null_bar": NULL_BAR,
        "fpm": pm,
    }
