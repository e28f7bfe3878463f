"""The fault regimes' section (issue 35, ``results/faults/<regime>.jsonl``): per regime what
:class:`.branches.BranchRegime` gives and its outlier, late rules and loss oracle
(:meth:`FaultRegime.view`), every pre-registered comparison in one table, the records' provenance.
The rules: docs/benchmarks.md#sweep-faults."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

from benchmarks.harness import cost, designs, preregistered
from benchmarks.harness.branch_stats import Design, paired, share_closed
from benchmarks.harness.markdown import markdown_table
from benchmarks.report.branches import NULL_BAR, SCHEDULE_END, BranchRegime, budget
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import listing, percent, pm

FAMILY = "faults"
LATE = ("NVIDIA late", "late fwd")
"""Name prefixes of the time rules."""
COLUMNS = ("recovered work", "held-out - {high}", "share of the gap closed", "diverged")
COLUMNS += ("faulted unit's share of its unit-steps", "error term's cost")
COLUMNS += ("extra steps to match BF16", "behind BF16 at the schedule's end")
COLUMNS += ("reaches BF16's final loss (branches, by evaluation step)", "speed-up*")
"""The arms table's columns (:meth:`.branches.BranchRegime.arms_table`)."""


class FaultRegime(BranchRegime):
    """One fault regime's records and the figures of its section beyond the arms table."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY)

    def outlier(self) -> dict[str, Any] | None:
        """The fault plan as the low-cost record states it (``peak`` as a power of 2 where it is
        one) and the unit (and channel) it struck per seed of the design."""
        if not self.low["outliers"]:
            return None
        o, d = self.low["outliers"][0], self.design
        n = math.log2(o["growth"] ** o["rise"])
        peak = f"2^{n:.0f}" if n == int(n) else f"{o['growth'] ** o['rise']:g}"
        struck = []
        for s in d.seeds:
            for x in self.records[("low-cost", s, d.points[0])]["outliers"][:1]:
                ch = "" if x.get("channel") is None else f" c{x['channel']}"
                struck.append(f"{designs.unit_name(designs.unit_of(x['module']))}{ch} ({s})")
        return o | {
            "whole": o.get("channel") is None,
            "instant": o["rise"] == 1,
            "offset": o["start"] - self.low["point"],
            "peak": peak,
            "proj": o["module"].rpartition(".")[2],
            "growth": f"{o['growth']:g}",
            "struck": struck,
        }

    def budgets(self) -> list[int]:
        """The budgets of the GNMR+e arms recorded (a wgrad arm's ``3k`` is none), else the
        pre-registered one."""
        ks = {budget(a) for a in self.arms if a.startswith("GNMR+e ") and "wgrad" not in a}
        return sorted(k for k in ks if k) or [budget(preregistered.COMPARISONS[0].arm) or 4]

    def pair_design(self, arm: str, rival: str) -> Design:
        """The design's points on every seed with both arms at all of them, where that is more
        seeds than the design's (a power run)."""
        d = self.design
        seeds = designs.complete_seeds(self.records, [arm, rival], self.seeds, d.points)
        return replace(d, seeds=tuple(seeds)) if len(seeds) > len(d.seeds) else d

    def not_run(self, arm: str) -> str | None:
        """Why a comparison's ``arm`` has no record in this regime (``None``: it has some)."""
        if any(k[0] == arm for k in self.records):
            return None
        backend = self.formats.backend if self.low else None
        if arm.startswith("TE autoswitch") and backend not in (None, "fp8_emulated"):
            return f"not run: TE's rule runs on fp8_emulated's specs, this regime on {backend}"
        return f"not run in this regime ({arm} is not among its arms)"

    @cached_property
    def preregistered(self) -> list[dict[str, Any]]:
        """Per comparison of the regime's families (:func:`preregistered.family`), per budget, its
        :func:`comparison` (``why``: why it has none: an arm not run, or waiting), the tie
        reading and both arms' work."""
        out = []
        for k in self.budgets():
            family = preregistered.family(self.name, k)
            for c in family:
                why = [w for w in map(self.not_run, (c.arm, c.rival)) if w]
                missing = [a for a in (c.arm, c.rival) if a not in self.table_arms]
                if why or missing:
                    why = why or [f"waiting for {listing(missing)}"]
                    out.append({"c": c, "arm": c.arm, "rival": c.rival, "why": why[0]})
                    continue
                dc = self.pair_design(c.arm, c.rival)
                gap = paired(self.records, dc, "low-cost", "BF16")[0]
                gap_ = gap if preregistered.reads_ties(self.name) else None
                row = designs.comparison(self.records, dc, c.arm, c.rival, len(family), gap_)
                works = [percent(designs.work(self.records, dc, a)) for a in (c.arm, c.rival)]
                out.append(
                    row | {"c": c, "arm": c.arm, "rival": c.rival, "why": None} | {"works": works}
                )
        return out

    def verdict_rows(self) -> list[list[str]]:
        """The regime's rows of :func:`verdict_table`."""
        out = []
        for r in self.preregistered:
            name = f"{r['arm']} - {r['rival']}"
            if r["why"]:
                out.append([self.name, name, "-", "-", r["why"], "-", "-", "-"])
                continue
            out.append([self.name, name, f"{r['mean']:+.4f}", r["half"], r["word"], r["signs"]])
            out[-1] += [" / ".join(r["works"]), str(r["seeds"])]
        return out

    def late(self) -> dict[str, Any] | None:
        """Per time rule in the design: the points where it runs the low-cost path throughout
        and the recovered work where it acts; ``GNMR+e k - <rule>`` at the point that ends the
        schedule, on every seed with all table arms there (95%)."""
        rules = [a for a in self.table_arms if a.startswith(LATE)]
        if not rules:
            return None
        point = SCHEDULE_END - self.horizon
        seeds = designs.complete_seeds(self.records, self.table_arms, self.seeds, [point])
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
        ours = [e for e in ours if e in self.table_arms and len(seeds) >= designs.MIN_SEEDS]
        pairs = [f"{e} - {a} {pm(paired(self.records, d, e, a))}" for e in ours for a in rules]
        return {"point": point, "seeds": len(seeds), "acts": acts, "pairs": pairs}

    def oracle(self) -> dict[str, Any] | None:
        """The loss oracle on its own grid: its share of the gap and work, ``<arm> - loss
        oracle k`` (95%), and how the faulted unit ranked among the single-unit gains."""
        oracles = {a for a, _, _ in self.records if a.startswith("loss oracle ")}
        oracles = sorted(oracles, key=self.rank)
        d = designs.largest_design(self.records, [*oracles, "low-cost", "BF16"], self.horizon)
        if not oracles or d is None:
            return None
        r, pairs = self.records, []
        for o in oracles:
            k = budget(o)
            for a in (f"GNMR+e {k}", f"GNMR+e v2 {k}", f"oracle {k}", f"random {k}"):
                if designs.complete_seeds(r, [a], d.seeds, d.points) == list(d.seeds):
                    pairs.append(f"{a} - {o} {pm(paired(r, d, a, o))}")
        shares = [
            (o, pm(share_closed(r, d, o), 2), percent(designs.work(r, d, o))) for o in oracles
        ]
        return {"design": d, "shares": shares, "pairs": pairs, "singles": designs.singles(r, d)}

    def view(self) -> dict[str, Any]:
        """The names ``templates/faults.md.j2`` words for this regime."""
        v: dict[str, Any] = {"name": self.name, "design": self.design, "n": len(self.records)}
        if self.design is None:
            return v
        f, e = self.formats, self.error
        options = [
            ", ".join(f"{k}={x}" for k, x in sorted(o.items())) for o in (f.low_cost, f.recovery)
        ]
        aside = self.set_aside
        return v | {
            "low_cost": options[0],
            "recovery": None if options[1] == "format=bf16" else options[1],
            "backend": None if f.backend == "fp8_emulated" else f.backend,
            "borrowed": f"{100 * e.share:.1f}%" if e and e.source.startswith("not") else None,
            "outlier": self.outlier(),
            "progress": designs.progress(self.records, self.design, self.table_arms),
            "seeds": len(self.seeds),
            "left": sorted(
                {p for a, _, p in self.records if a in self.arms} - {*self.design.points}
            ),
            "waiting": self.waiting,
            "arms": len(self.table_arms),
            "aside": aside
            and {
                "n": len(aside),
                "where": len({k[1:] for k in aside}),
                "arms": sorted({a for a, _, _ in aside}, key=self.rank),
                "hosts": sorted({designs.machine(r) for r in aside.values()}),
            },
            "bar": self.bar,
            "table": self.arms_table(COLUMNS),
            "late": self.late(),
            "oracle": self.oracle(),
        }


def verdict_table(regimes: Sequence[FaultRegime]) -> str:
    """Every regime's pre-registered comparisons, one row each; the regimes none of whose
    compared arms ran share one row."""
    header = ["regime", "comparison", "difference", "98.75% half-width", "verdict"]
    header += ["seeds below 0 (sign test p)", "work (arm / rival)", "seeds"]
    rows, idle = [], []
    for r in (r for r in regimes if r.design):
        ran = [p for p in r.preregistered if not (p["why"] or "").startswith("not run")]
        if ran or not r.preregistered:
            rows += r.verdict_rows()
        else:
            idle.append(r)
    if idle:
        why = idle[0].preregistered[0]["why"].replace("this regime", "these regimes")
        names = listing([f"`{r.name}`" for r in idle])
        rows.append([names, "all four", "-", "-", why.replace("its arms", "their arms")])
        rows[-1] += ["-"] * 3
    return markdown_table(header, rows)


def context(src: Source) -> dict[str, Any]:
    """The section's names: every fault regime with records (``fault_regimes``: the objects,
    ``faults``: their views), the verdict and provenance tables, the family's level and where
    the error term's cost was measured."""
    regimes = [r for r in (FaultRegime(src, n) for n in src.regimes(FAMILY)) if r.records]
    level = 1 - preregistered.FAMILY_ALPHA / len(preregistered.COMPARISONS)
    measured = error_cost(src, "fp8_emulated")
    return {
        "fault_regimes": regimes,
        "faults": [r.view() for r in regimes],
        "fault_verdicts": verdict_table(regimes),
        "fault_provenance": src.records_table([r.file for r in regimes]),
        "error_source": "not measured" if measured is None else measured.source,
        "prereg_level": f"{100 * level:g}%",
        "null_bar": f"{NULL_BAR:.2f}",
    }
