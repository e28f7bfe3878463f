"""The fault regimes' section (issue 35, ``results/faults/<regime>.jsonl``): per regime what
:class:`.branches.BranchRegime` gives, its outlier, late rules and loss oracle
(:meth:`FaultRegime.view`; :mod:`benchmarks.harness.fault_figures`), and every pre-registered
comparison in one table (:func:`verdict_table`). The rules: docs/benchmarks.md#sweep-faults."""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

from benchmarks.harness import designs, fault_figures, preregistered
from benchmarks.harness.branch_stats import paired
from benchmarks.harness.markdown import markdown_table
from benchmarks.report.branches import NULL_BAR, SCHEDULE_END, BranchRegime, budget
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import listing

FAMILY = "faults"
COLUMNS = ["recovered work", "held-out - {high}", "share of the gap closed", "diverged"]
COLUMNS += ["faulted unit's share of its unit-steps", "error term's cost"]
COLUMNS += ["extra steps to match BF16", "behind BF16 at the schedule's end"]
COLUMNS += ["reaches BF16's final loss (branches, by evaluation step)", "speed-up*"]
"""The arms table's columns (:meth:`.branches.BranchRegime.arms_table`)."""


class FaultRegime(BranchRegime):
    """One fault regime's records and the figures of its section beyond the arms table."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY)

    def budgets(self) -> list[int]:
        """The budgets of the GNMR+e arms recorded (a wgrad arm's ``3k`` is none), else 4."""
        ks = {budget(a) for a in self.arms if a.startswith("GNMR+e ") and "wgrad" not in a}
        return sorted(k for k in ks if k) or [4]

    def why(self, *arms: str) -> str | None:
        """Why a comparison of ``arms`` has no figure: an arm not run in this regime (TE's rule
        off its backend), or waiting for seeds; ``None``: it has one."""
        backend = self.formats.backend if self.low else None
        for a in (a for a in arms if not any(k[0] == a for k in self.records)):
            if a.startswith("TE autoswitch") and backend not in (None, "fp8_emulated"):
                return f"not run: TE's rule runs on fp8_emulated's specs, this regime on {backend}"
            return f"not run in this regime ({a} is not among its arms)"
        missing = [a for a in arms if a not in self.table_arms]
        return f"waiting for {listing(missing)}" if missing else None

    @cached_property
    def preregistered(self) -> list[dict[str, Any]]:
        """Per comparison of the regime's family at each budget: :meth:`why` it has no figure, else
        :func:`designs.comparison` over :func:`designs.pair_design` (a tie read against the static
        gap where the regime reads ties); ``cells``: its row of the verdict table."""
        out, d0 = [], self.design
        assert d0 is not None  # read only where the regime has a design
        for k in self.budgets():
            family = preregistered.family(self.name, k)
            for c in family:
                why, cells = self.why(c.arm, c.rival), [self.name, f"{c.arm} - {c.rival}"]
                row: dict[str, Any] = {"arm": c.arm, "rival": c.rival, "why": why}
                if why:
                    out.append(row | {"cells": [*cells, "-", "-", why, "-", "-"]})
                    continue
                d = designs.pair_design(self.records, d0, self.seeds, c.arm, c.rival)
                gap = paired(self.records, d, "low-cost", "BF16")[0]
                gap_ = gap if preregistered.reads_ties(self.name) else None
                row |= designs.comparison(self.records, d, c.arm, c.rival, len(family), gap_)
                cells += [f"{row['mean']:+.4f}", row["half"], row["word"], row["signs"]]
                out.append(row | {"cells": [*cells, str(row["seeds"])]})
        return out

    @cached_property
    def outlier(self) -> dict[str, Any] | None:
        """The fault plan as the low-cost record states it (``peak`` as a power of 2 where it is
        one, ``offset``: its first step in the branch) and per seed of the design the unit (and
        channel) it struck."""
        if not (self.low and self.low["outliers"] and self.design):
            return None
        o: dict[str, Any] = self.low["outliers"][0]
        n, d = math.log2(o["growth"] ** o["rise"]), self.design
        struck = []
        for s in d.seeds:
            x = self.records[("low-cost", s, d.points[0])]["outliers"][0]
            ch = "" if x.get("channel") is None else f" c{x['channel']}"
            struck.append(f"{designs.unit_name(designs.unit_of(x['module']))}{ch} ({s})")
        return o | {
            "peak": f"2^{n:.0f}" if n == int(n) else f"{o['growth'] ** o['rise']:g}",
            "offset": o["start"] - self.low["point"],
            "proj": o["module"].rpartition(".")[2],
            "struck": struck,
        }

    def view(self) -> dict[str, Any]:
        """The names ``templates/faults.md.j2`` words for this regime (``r``: the regime)."""
        d, f, e, aside, rec = self.design, self.formats, self.error, self.set_aside, self.records
        if d is None:
            return {"r": self}
        low, high = (
            ", ".join(f"{k}={x}" for k, x in sorted(o.items())) for o in (f.low_cost, f.recovery)
        )
        ours = [f"{p} {k}" for k in self.budgets() for p in ("GNMR+e", "GNMR+e v2")]
        arms = sorted({a for a, _, _ in aside}, key=self.rank)
        hosts = sorted({designs.machine(r) for r in aside.values()})
        return {
            "r": self,
            "low_cost": low,
            "recovery": None if high == "format=bf16" else high,
            "backend": None if f.backend == "fp8_emulated" else f.backend,
            "borrowed": e.share if e and e.source.startswith("not") else None,
            "progress": designs.progress(rec, d, self.table_arms),
            "left": sorted({p for a, _, p in rec if a in self.arms} - {*d.points}),
            "aside": aside and {"where": len({k[1:] for k in aside}), "arms": arms, "hosts": hosts},
            "table": self.arms_table(COLUMNS),
            "late": fault_figures.late(rec, self.table_arms, ours, SCHEDULE_END, self.horizon),
            "oracle": fault_figures.oracle(rec, self.horizon, self.rank),
        }


def verdict_table(regimes: list[FaultRegime]) -> str:
    """Every regime's pre-registered comparisons, one row each; the regimes none of whose
    compared arms ran share one row."""
    rows, idle = [], []
    for r in (r for r in regimes if r.design):
        if r.preregistered and all(str(p["why"]).startswith("not run") for p in r.preregistered):
            idle.append(r)
        else:
            rows += [p["cells"] for p in r.preregistered]
    if idle:
        why = idle[0].preregistered[0]["why"].replace("this regime", "these regimes")
        names = listing([f"`{r.name}`" for r in idle])
        rows.append([names, "all four", "-", "-", why.replace("its arms", "their arms"), "-", "-"])
    head = ["regime", "comparison", "difference", "98.75% half-width", "verdict"]
    return markdown_table([*head, "seeds below 0 (sign test p)", "seeds"], rows)


def context(src: Source) -> dict[str, Any]:
    """The section's names: every fault regime with records (``fault_regimes``: the objects,
    ``faults``: their views), the verdict and provenance tables, the family's level and where
    the error term's cost was measured."""
    regimes = [r for r in (FaultRegime(src, n) for n in src.regimes(FAMILY)) if r.records]
    measured, n = error_cost(src, "fp8_emulated"), len(preregistered.COMPARISONS)
    return {
        "fault_regimes": regimes,
        "faults": [r.view() for r in regimes],
        "fault_verdicts": verdict_table(regimes),
        "fault_provenance": src.provenance_table([r.file for r in regimes]),
        "error_source": "not measured" if measured is None else measured.source,
        "prereg_level": f"{100 * (1 - preregistered.FAMILY_ALPHA / n):g}%",
        "null_bar": NULL_BAR,
    }
