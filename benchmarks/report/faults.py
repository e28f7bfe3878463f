"""The fault regimes' section (issue 35, ``results/faults/``): per regime its arms table, outlier,
late rules and loss oracle (:meth:`FaultRegime.view`), and every pre-registered comparison, one
row each (:func:`verdicts`). The rules: docs/benchmarks.md#sweep-faults."""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

from benchmarks.harness import designs, fault_figures, preregistered
from benchmarks.report.branches import NULL_BAR, SCHEDULE_END, BranchRegime, budget
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import listing

FAMILY = "faults"
LEVEL = f"{100 * (1 - preregistered.FAMILY_ALPHA / len(preregistered.COMPARISONS)):g}%"
"""The pre-registered comparisons' Bonferroni-adjusted level, four per regime."""
COLUMNS = ["recovered work", "held-out - {high}", "share of the gap closed", "diverged"]
COLUMNS += ["faulted unit's share of its unit-steps", "error term's cost"]
COLUMNS += ["extra steps to match BF16", "behind BF16 at the schedule's end"]
COLUMNS += ["reaches BF16's final loss (branches, by evaluation step)", "speed-up*"]


class FaultRegime(BranchRegime):
    """One fault regime's records and the figures of its section beyond the arms table."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY)

    def budgets(self) -> list[int]:
        """The GNMR+e arms' budgets (a wgrad arm's ``3k`` is none), else the pre-registered one."""
        ks = {budget(a) for a in self.arms if a.startswith("GNMR+e ") and "wgrad" not in a}
        return sorted(k for k in ks if k) or [budget(preregistered.COMPARISONS[0].arm) or 4]

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
        """Per comparison of the regime's family at each budget: :meth:`why` it has no figure,
        else :func:`.fault_figures.verdict` (ties read where the regime reads them)."""
        out, ties = [], preregistered.reads_ties(self.name)
        for k in self.budgets():
            family = preregistered.family(self.name, k)
            for c in family:
                why, n = self.why(c.arm, c.rival), len(family)
                args = self.records, self.design, self.seeds, c.arm, c.rival, n, ties
                row = {"name": self.name, "arm": c.arm, "rival": c.rival, "why": why}
                out.append(row if why else row | fault_figures.verdict(*args))  # type: ignore[arg-type]
        return out

    @cached_property
    def outlier(self) -> dict[str, Any] | None:
        """The fault plan as the low-cost record states it (``peak`` as a power of 2 where it is
        one, ``offset`` and ``window``: its first and last steps in the branch) and ``struck``:
        per seed of the design (seed, the unit's name, the channel)."""
        if not (self.low and self.low["outliers"] and self.design):
            return None
        o: dict[str, Any] = self.low["outliers"][0]
        peak, start = o["growth"] ** o["rise"], o["start"] - self.low["point"]
        struck = fault_figures.struck(self.records, self.design)
        return o | {
            "peak": f"2^{math.log2(peak):.0f}" if math.log2(peak).is_integer() else f"{peak:g}",
            "offset": start,
            "window": (start, start + o["rise"] + o["hold"] - 1),
            "proj": o["module"].rpartition(".")[2],
            "struck": [(s, designs.unit_name(u), c) for s, u, c in struck],
        }

    def view(self) -> dict[str, Any]:
        """The names ``templates/faults.md.j2`` words for this regime (``r``: the regime)."""
        d, f, e, aside, rec = self.design, self.formats, self.error, self.set_aside, self.records
        if d is None:
            return {"r": self}
        low, high = ([f"{k}={x}" for k, x in sorted(o.items())] for o in (f.low_cost, f.recovery))
        ours = [f"{p} {k}" for k in self.budgets() for p in ("GNMR+e", "GNMR+e v2")]
        return {
            "r": self,
            "low_cost": low,
            "recovery": None if high == ["format=bf16"] else high,
            "backend": None if f.backend == "fp8_emulated" else f.backend,
            "borrowed": e.share if e and e.source.startswith("not") else None,
            "progress": designs.progress(rec, d, self.table_arms),
            "left": sorted({p for a, _, p in rec if a in self.arms} - {*d.points}),
            "aside_arms": sorted({a for a, _, _ in aside}, key=self.rank),
            "aside_at": len({k[1:] for k in aside}),
            "hosts": sorted({designs.machine(r) for r in aside.values()}),
            "table": self.arms_table(COLUMNS),
            "late": fault_figures.late(rec, self.table_arms, ours, SCHEDULE_END, self.horizon),
            "oracle": fault_figures.oracle(rec, self.horizon, self.rank),
        }


def verdicts(regimes: list[FaultRegime]) -> list[dict[str, Any]]:
    """Every pre-registered comparison of the regimes with a design; the regimes none of whose
    compared arms ran share one row, its ``arm`` ``all four``."""
    rows = [r.preregistered for r in regimes if r.design]
    idle = [p for p in rows if p and all(str(c["why"]).startswith("not run") for c in p)]
    out = [c for p in rows if p not in idle for c in p]
    if idle:
        names, why = listing([f"`{p[0]['name']}`" for p in idle]), idle[0][0]["why"]
        why = why.replace("this regime", "these regimes").replace("its arms", "their arms")
        out.append({"name": names, "arm": "all four", "rival": None, "why": why})
    return out


def regimes(src: Source) -> list[FaultRegime]:
    """Every fault regime with records (built once: the top reads them too)."""
    every = (FaultRegime(src, n) for n in src.regimes(FAMILY))
    return src.once(FAMILY, lambda: [r for r in every if r.records])


def context(src: Source) -> dict[str, Any]:
    """The section's names: every fault regime's view, the verdict rows and provenance table,
    the family's level and where the error term's cost was measured."""
    every, measured = regimes(src), error_cost(src, "fp8_emulated")
    return {
        "faults": [r.view() for r in every],
        "fault_verdicts": verdicts(every),
        "fault_provenance": src.provenance_table([r.file for r in every]),
        "error_source": "not measured" if measured is None else measured.source,
        "prereg_level": LEVEL,
        "null_bar": NULL_BAR,
    }
