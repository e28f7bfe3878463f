"""One branch regime's records as the fault, FP4 and paper sections read them (arms branched from
shared trunk checkpoints, paired on (seed, point) against the recovery arm): :class:`BranchRegime`
gives the records kept on one host, the design, the noise bar, the arms table of the columns a
section names and the provenance row; the analysis is :mod:`benchmarks.harness`'s. No torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

from benchmarks.harness import cost, designs
from benchmarks.harness.branch_stats import Design, paired, share_closed, troubles
from benchmarks.harness.markdown import markdown_table
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import percent, pm, resolved

SUBSET = ("loss oracle ", "single ")
"""Name prefixes of the arms run on part of the grid only (no design of their own)."""
ORDER = ("random", "GNMR", "GNMR+e", "GNMR+e v2", "e-only", "GNMR+e lean", "TE autoswitch")
ORDER += ("oracle", "loss oracle", "random wgrad", "GNMR+e wgrad")
FIXED = ("low-cost", "recovery", "null recovery", "null low-cost", "NVIDIA last", "TE autoswitch")
FIXED += ("NVIDIA late", "late fwd")
"""The tables' order: the unbudgeted arms by role prefix, then per budget the policies."""
SCHEDULE_END = 400
"""The trunk's schedule: a branch from ``SCHEDULE_END - horizon`` ends it (the late rules act)."""
NULL_BAR = 1 / 3
"""Issue 35's bar: each null's interval holds 0 and reaches at most this share of the gap."""
CLI = "python -m benchmarks.sweep.branches"


def nulls(high: str) -> dict[str, str]:
    """Each null control and the arm it pairs with (the SR seed only in stochastic regimes)."""
    low = {"null low-cost (1e-6)": "low-cost", "low-cost (SR seed 1)": "low-cost"}
    return {f"null {high} (1e-6)": high} | low


def budget(arm: str) -> int | None:
    """``k`` of a budgeted arm (``GNMR+e v2 4``: 4), else ``None``."""
    head, _, tail = arm.rpartition(" ")
    return int(tail) if head in ORDER and tail.isdigit() else None


def role(arm: str, high: str) -> str:
    """The arm's name with the recovery arm's replaced by ``recovery``."""
    return "recovery" if arm == high else arm.replace(f"null {high} ", "null recovery ")


def rank(arm: str, high: str = "BF16") -> tuple[int, int, int, str]:
    """The tables' order, total (ties by name: no set's iteration order reaches the document):
    the unbudgeted arms by the first prefix of :data:`FIXED` their role has, then by budget,
    policy."""
    k, arm = budget(arm), role(arm, high)
    if k is not None:
        return 1, k, ORDER.index(arm.rpartition(" ")[0]), arm
    first = [i for i, p in enumerate(FIXED) if arm.startswith(p)]
    return 0, first[0] if first else len(FIXED), 0, arm


Cell = Callable[["BranchRegime", str], str]
More = Mapping[str, Callable[[str], str]]
COLUMNS: dict[str, Cell] = {
    "recovered work": lambda g, a: percent(designs.work(g.records, g.design, a)),
    "held-out - {high}": lambda g, a: pm(paired(g.records, g.design, a, g.high)),
    "share of the gap closed": lambda g, a: pm(share_closed(g.records, g.design, a), 2),
    "loss spikes": lambda g, a: str(troubles(g.records, g.design, a)[0]),
    "diverged": lambda g, a: str(troubles(g.records, g.design, a)[1]),
    "faulted unit's share of its unit-steps": lambda g, a: percent(
        designs.on_fault(g.records, g.design, a)
    ),
}
"""The arms table's own columns by header; the cost model's (``error term's cost``, ``extra steps
to match BF16``, ...) are :func:`benchmarks.harness.cost.cost_rows`'s, and ``speed-up`` is one
column per group of hardware models (:meth:`BranchRegime.groups`)."""


class BranchRegime:
    """One regime's records (on one host per branch point), its design and its tables."""

    def __init__(
        self,
        src: Source,
        name: str,
        family: str,
        schedule: int = SCHEDULE_END,
        design: Design | None = None,
    ) -> None:
        self.src, self.name, self.family, self.schedule = src, name, family, schedule
        self.records, self.set_aside = designs.one_host(src.records(name, family=family))
        self.high = designs.recovery_arm(self.records) or "BF16"
        arms = {a for a, _, _ in self.records if not a.startswith(SUBSET)}
        self.arms = sorted(arms, key=self.rank)
        self.low = next((r for k, r in self.records.items() if k[0] == "low-cost"), None)
        self.evals = sorted(int(e) for e in self.low["heldout"]) if self.low else []
        self.horizon = self.evals[-1] if self.evals else 0
        self.seeds = list(dict.fromkeys(s for a, s, _ in self.records if a in self.arms))
        self.design, self.table_arms, self.waiting = design, list(self.arms), []
        if design is None:
            self.waiting = list(self.arms)
            if self.low is not None and self.high in arms:
                self.design, self.table_arms, self.waiting = designs.choose_arms(
                    self.records, self.arms, self.horizon, self.high
                )

    def rank(self, arm: str) -> tuple[int, int, int, str]:
        """:func:`rank` with this regime's recovery arm."""
        return rank(arm, self.high)

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
        """:func:`benchmarks.harness.cost.summarize_costs` of the design's arms, bounded by the
        trunk's schedule, the error term priced."""
        return cost.summarize_costs(
            self.records,
            self.design,
            self.formats,
            arms=self.table_arms,
            schedule=self.schedule,
            error=self.error,
        )

    @cached_property
    def bar(self) -> dict[str, Any]:
        """Issue 35's bar at the horizon: the gap resolved, every null in the design holding 0
        and reaching at most :data:`NULL_BAR` of it (``nulls``: name, interval, reach / gap)."""
        gap = paired(self.records, self.design, "low-cost", self.high)
        out = []
        for null, ref in nulls(self.high).items():
            if null in self.table_arms:
                pair = paired(self.records, self.design, null, ref)
                ratio = designs.reach(pair) / abs(gap[0]) if gap[0] else float("inf")
                fails = resolved(pair) or not ratio <= NULL_BAR
                out.append({"name": null.replace(" (1e-6)", ""), "pair": pm(pair)})
                out[-1] |= {"reach": f"{ratio:.2f}", "fails": fails, "excludes": resolved(pair)}
        passes = resolved(gap) and bool(out) and not any(n["fails"] for n in out)
        return {"gap": pm(gap), "resolved": resolved(gap), "nulls": out, "passes": passes}

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

    @cached_property
    def cost_cells(self) -> dict[str, dict[str, str]]:
        """Per arm its cells of :func:`benchmarks.harness.cost.cost_rows` by header."""
        head, rows = cost.cost_rows(self.costs, horizon=self.horizon)
        return {r[0]: dict(zip(head, r, strict=True)) for r in rows}

    def cells(self, arm: str, columns: Sequence[str], more: More | None = None) -> list[str]:
        """The arm's cells of ``columns`` (:data:`COLUMNS`, ``more``, the cost model's; one per
        group of :meth:`groups` for ``speed-up``, ``speed-up*``: every group)."""
        out, costs, more = [], self.cost_cells.get(arm, {}), more or {}
        for c in columns:
            if c.startswith("speed-up"):
                r = self.costs.get(arm)
                out += [cost.speed_cell(r, g[0]) if r else "-" for g in self.groups(c[-1] == "*")]
            elif c in more:
                out.append(more[c](arm))
            else:
                out.append(COLUMNS[c](self, arm) if c in COLUMNS else costs.get(c, "-"))
        return out

    def arms_table(
        self, columns: Sequence[str], arms: Sequence[str] | None = None, more: More | None = None
    ) -> str:
        """One row per arm (default: the design's), its name first, then ``columns`` (headers:
        ``{high}`` is the reference arm; a cost column no arm has is left out: ``behind BF16 at
        the schedule's end`` where no branch ends the schedule)."""
        have = {*COLUMNS, *(more or {}), *(h for r in self.cost_cells.values() for h in r)}
        columns = [c for c in columns if c in have or c.startswith("speed-up")]
        head = ["arm"]
        for c in columns:
            if c.startswith("speed-up"):
                head += [f"speed-up, {', '.join(g)}" for g in self.groups(c[-1] == "*")]
            else:
                head.append(c.format(high=self.high))
        arms = self.table_arms if arms is None else arms
        return markdown_table(head, [[a, *self.cells(a, columns, more)] for a in arms])

    @property
    def file(self) -> str:
        """The records file under ``results/``."""
        return f"{self.family}/{self.name}.jsonl"

    @property
    def command(self) -> str:
        """The command that writes the records file."""
        return f"`{CLI} --regime {self.name}`"
