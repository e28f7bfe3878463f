"""One branch regime as the fault, FP4 and paper sections read it (arms branched from shared trunk
checkpoints, paired on (seed, point)): :class:`BranchRegime`: its records on one host, design, noise
bar, arms table and records file; the analysis is :mod:`benchmarks.harness`'s. No torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import Any

from benchmarks.harness import cost, designs
from benchmarks.harness.branch_figures import NULL_BAR, budget, noise_bar, nulls, rank, role
from benchmarks.harness.branch_stats import Design, Records, paired, share_closed, troubles
from benchmarks.report.overhead import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import percent, pm, table

__all__ = ["NULL_BAR", "SCHEDULE_END", "BranchRegime", "budget", "nulls", "rank", "role"]
SCHEDULE_END = 400
"""The trunk's schedule: a branch from ``SCHEDULE_END - horizon`` ends it (the late rules act)."""
CLI = "python -m benchmarks.sweep.branches"
Cell = Callable[[str], str | None]
More = Mapping[str, Cell] | None
Arms = Sequence[str] | None


class BranchRegime:
    """One regime's records (on one host per branch point), its design (the one given, else the
    largest with enough seeds: :func:`.designs.choose_arms`), its tables and its records file."""

    def __init__(
        self, src: Source, name: str, family: str, end: int = SCHEDULE_END, d: Design | None = None
    ) -> None:
        self.src, self.name, self.family, self.schedule = src, name, family, end
        self.file, self.command = f"{family}/{name}.jsonl", f"`{CLI} --regime {name}`"
        self.records, self.set_aside = designs.one_host(src.records(name, family=family))
        self.high = designs.recovery_arm(self.records) or "BF16"
        self.rank = partial(rank, high=self.high)
        # the arms run on part of the grid only have no design of their own
        part = ("loss oracle ", "single ")
        self.arms = sorted({a for a, _, _ in self.records if not a.startswith(part)}, key=self.rank)
        self.low = next((r for k, r in self.records.items() if k[0] == "low-cost"), None)
        self.horizon = max(map(int, self.low["heldout"])) if self.low else 0
        self.seeds = list(dict.fromkeys(s for a, s, _ in self.records if a in self.arms))
        self.design, self.table_arms = d, list(self.arms)
        self.waiting = [] if d else list(self.arms)
        if d is None and self.low is not None and self.high in self.arms:
            self.design, self.table_arms, self.waiting = designs.choose_arms(
                self.records, self.arms, self.horizon, self.high
            )

    @cached_property
    def formats(self) -> cost.Formats:
        s = self.low["arm_spec"]
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    @cached_property
    def error(self) -> cost.ErrorCost | None:
        """The error term's cost on this backend (:func:`.overhead.error_cost`)."""
        return error_cost(self.src, self.formats.backend)

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`.cost.summarize_costs` of the design's arms, bounded by the trunk's schedule."""
        d, arms, end = self.design, self.table_arms, self.schedule
        return cost.summarize_costs(
            self.records, d, self.formats, arms=arms, schedule=end, error=self.error
        )

    @cached_property
    def bar(self) -> dict[str, Any]:
        """:func:`.branch_figures.noise_bar` over the design's arms, intervals and reach as text."""
        b = noise_bar(self.records, self.design, self.high, self.table_arms)
        text = [n | {"pair": pm(n["pair"]), "reach": f"{n['reach']:.2f}"} for n in b["nulls"]]
        return b | {"gap": pm(b["gap"]), "nulls": text}

    def unpriced(self) -> list[str]:
        """``Hopper n/a (no FP4 GEMMs)``: each group of hardware models that prices no arm, with
        its note (:func:`.cost.hardware_groups`: the same cells for every arm)."""
        groups, priced = cost.hardware_groups(self.costs), cost.priced_groups(self.costs)
        first = next(iter(self.costs.values()))["hardware"]
        return [f"{', '.join(g)} {first[g[0]]['note']}" for g in groups if g not in priced]

    def columns(self, names: Sequence[str], more: More = None) -> list[tuple[str, Cell]]:
        """(header, an arm's cell) per column of ``names``: ``more``'s, :data:`COLUMNS`' or the cost
        model's (:func:`.cost.cost_rows`; ``None`` where it has no such column: ``behind BF16 at
        the schedule's end`` where no branch ends the schedule); ``speed-up``: one per group of
        hardware models that prices an arm (``speed-up*``: every group)."""
        head, rows = cost.cost_rows(self.costs, horizon=self.horizon)
        # the cost model's speed-up columns are named as ours
        head = [h.replace(" at matched loss", "") for h in head]
        by = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
        own = {c: partial(f, self.records, self.design, self.high) for c, f in COLUMNS.items()}

        def cell(c: str) -> Cell:
            if c not in {*(more or {}), *own, *cost.DETAILS} and not c.startswith("speed-up"):
                raise KeyError(f"{self.name}: no column {c!r}")  # misspelt, not merely empty
            return (more or {}).get(c) or own.get(c) or (lambda a: by[a].get(c))

        heads = []
        for c in names:
            hw = (cost.hardware_groups if c[-1] == "*" else cost.priced_groups)(self.costs)
            heads += [f"speed-up, {', '.join(g)}" for g in hw] if c.startswith("speed-up") else [c]
        return [(c.format(high=self.high), cell(c)) for c in heads]

    def arms_table(self, columns: Sequence[str], arms: Arms = None, more: More = None) -> str:
        """One row per arm (default: the design's), its name first, then :meth:`columns`."""
        cols = self.columns(columns, more)
        arms = self.table_arms if arms is None else arms
        return table([{"arm": a} | {h: f(a) for h, f in cols} for a in arms])


COLUMNS: dict[str, Callable[[Records, Design, str, str], str]] = {
    "recovered work": lambda r, d, h, a: percent(designs.work(r, d, a)),
    "held-out - {high}": lambda r, d, h, a: pm(paired(r, d, a, h)),
    "share of the gap closed": lambda r, d, h, a: pm(share_closed(r, d, a), 2),
    "loss spikes": lambda r, d, h, a: str(troubles(r, d, a)[0]),
    "diverged": lambda r, d, h, a: str(troubles(r, d, a)[1]),
    "faulted unit's share of its unit-steps": lambda r, d, h, a: percent(designs.on_fault(r, d, a)),
}
"""The arms table's own columns: header (``{high}``: the recovery arm) to cell (records, design,
recovery arm, arm)."""
