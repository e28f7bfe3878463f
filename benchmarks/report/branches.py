"""One branch regime's records as the fault, FP4 and paper sections read them (arms branched from
shared trunk checkpoints, paired on (seed, point) against the recovery arm): :class:`BranchRegime`
gives the records kept on one host, the design, the noise bar, the arms table of the columns a
section names and the provenance row; the analysis is :mod:`benchmarks.harness`'s. No torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import Any

from benchmarks.harness import cost, designs
from benchmarks.harness.branch_figures import NULL_BAR as NULL_BAR
from benchmarks.harness.branch_figures import budget as budget
from benchmarks.harness.branch_figures import noise_bar, nulls, rank
from benchmarks.harness.branch_figures import role as role
from benchmarks.harness.branch_stats import Design, paired, share_closed, troubles
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import percent, pm, table

__all__ = ["NULL_BAR", "SCHEDULE_END", "BranchRegime", "budget", "nulls", "rank", "role"]
SUBSET = ("loss oracle ", "single ")
"""Name prefixes of the arms run on part of the grid only (no design of their own)."""
SCHEDULE_END = 400
"""The trunk's schedule: a branch from ``SCHEDULE_END - horizon`` ends it (the late rules act)."""
CLI = "python -m benchmarks.sweep.branches"
Cell = Callable[[str], str | None]


class BranchRegime:
    """One regime's records (on one host per branch point), its design (the one given, else the
    largest with enough seeds: :func:`.designs.choose_arms`), its tables and its records file."""

    def __init__(
        self,
        src: Source,
        name: str,
        family: str,
        schedule: int = SCHEDULE_END,
        design: Design | None = None,
    ) -> None:
        self.src, self.name, self.family, self.schedule = src, name, family, schedule
        self.file, self.command = f"{family}/{name}.jsonl", f"`{CLI} --regime {name}`"
        self.records, self.set_aside = designs.one_host(src.records(name, family=family))
        self.high = designs.recovery_arm(self.records) or "BF16"
        self.rank = partial(rank, high=self.high)
        self.arms = sorted(
            {a for a, _, _ in self.records if not a.startswith(SUBSET)}, key=self.rank
        )
        self.low = next((r for k, r in self.records.items() if k[0] == "low-cost"), None)
        self.evals = sorted(int(e) for e in self.low["heldout"]) if self.low else []
        self.horizon = self.evals[-1] if self.evals else 0
        self.seeds = list(dict.fromkeys(s for a, s, _ in self.records if a in self.arms))
        self.design, self.table_arms = design, list(self.arms)
        self.waiting = [] if design else list(self.arms)
        if design is None and self.low is not None and self.high in self.arms:
            self.design, self.table_arms, self.waiting = designs.choose_arms(
                self.records, self.arms, self.horizon, self.high
            )

    @cached_property
    def formats(self) -> cost.Formats:
        s = self.low["arm_spec"]
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    @cached_property
    def error(self) -> cost.ErrorCost | None:
        """The error term's cost on this backend (:func:`.error_cost.error_cost`)."""
        return error_cost(self.src, self.formats.backend)

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`.cost.summarize_costs` of the design's arms, bounded by the trunk's schedule."""
        args = self.records, self.design, self.formats
        return cost.summarize_costs(
            *args, arms=self.table_arms, schedule=self.schedule, error=self.error
        )

    @cached_property
    def bar(self) -> dict[str, Any]:
        """:func:`.branch_figures.noise_bar` over the design's arms, intervals and reach as text."""
        b = noise_bar(self.records, self.design, self.high, self.table_arms)
        text = [n | {"pair": pm(n["pair"]), "reach": f"{n['reach']:.2f}"} for n in b["nulls"]]
        return b | {"gap": pm(b["gap"]), "nulls": text}

    def groups(self, unpriced: bool = False) -> list[tuple[str, ...]]:
        """The speed-up columns: groups of hardware models with the same cells, those that
        price an arm (``unpriced``: every group)."""
        return (cost.hardware_groups if unpriced else cost.priced_groups)(self.costs)

    def unpriced(self) -> list[str]:
        """``Hopper n/a (no FP4 GEMMs)``: the hardware models that price no arm, by note."""
        priced = {hw for g in self.groups() for hw in g}
        first = next(iter(self.costs.values()))["hardware"]
        notes: dict[str, list[str]] = {}
        for hw in (h for h in cost.HARDWARE if h not in priced):
            notes.setdefault(first[hw]["note"], []).append(hw)
        return [f"{', '.join(hws)} {note}" for note, hws in notes.items()]

    def columns(
        self, names: Sequence[str], more: Mapping[str, Cell] | None = None
    ) -> list[tuple[str, Cell]]:
        """(header, an arm's cell) per column of ``names``: :data:`COLUMNS`, ``more``, the cost
        model's (``None`` where it has no such column: ``behind BF16 at the schedule's end``
        where no branch ends the schedule); ``speed-up``: one per group of :meth:`groups`
        (``speed-up*``: every group)."""
        more, (head, rows) = more or {}, cost.cost_rows(self.costs, horizon=self.horizon)
        by = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
        out: list[tuple[str, Cell]] = []
        for c in names:
            if c.startswith("speed-up"):
                for g in self.groups(c[-1] == "*"):
                    out.append((f"speed-up, {', '.join(g)}", partial(self.speed, g[0])))
            else:
                own: Cell | None = more.get(c) or (
                    partial(COLUMNS[c], self) if c in COLUMNS else None
                )
                out.append((c.format(high=self.high), own or partial(_cost_cell, by, c)))
        return out

    def speed(self, hw: str, arm: str) -> str:
        """The arm's speed-up at matched loss on ``hw`` (``-``: outside the design)."""
        return cost.speed_cell(self.costs[arm], hw) if arm in self.costs else "-"

    def arms_table(
        self,
        columns: Sequence[str],
        arms: Sequence[str] | None = None,
        more: Mapping[str, Cell] | None = None,
    ) -> str:
        """One row per arm (default: the design's), its name first, then :meth:`columns`."""
        cols = self.columns(columns, more)
        arms = self.table_arms if arms is None else arms
        return table([{"arm": a} | {h: f(a) for h, f in cols} for a in arms])


COLUMNS: dict[str, Callable[[BranchRegime, str], str]] = {
    "recovered work": lambda g, a: percent(designs.work(g.records, g.design, a)),
    "held-out - {high}": lambda g, a: pm(paired(g.records, g.design, a, g.high)),
    "share of the gap closed": lambda g, a: pm(share_closed(g.records, g.design, a), 2),
    "loss spikes": lambda g, a: str(troubles(g.records, g.design, a)[0]),
    "diverged": lambda g, a: str(troubles(g.records, g.design, a)[1]),
    "faulted unit's share of its unit-steps": lambda g, a: percent(
        designs.on_fault(g.records, g.design, a)
    ),
}
"""The arms table's own columns by header (``{high}``: the recovery arm); the cost model's are
:func:`benchmarks.harness.cost.cost_rows`'s; ``speed-up`` is one per group of hardware models."""


def _cost_cell(by: Mapping[str, Mapping[str, str]], column: str, arm: str) -> str | None:
    """The arm's cell of a cost model's ``column`` (``None``: no such column)."""
    return by[arm].get(column)
