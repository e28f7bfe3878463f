"""The paper's experiments on the branch estimator (issue 35 item 2, ``results/paper/``): per
regime (:class:`.branches.BranchRegime`, the reference its recovery arm) and budget the claim's
verdict (docs/benchmarks.md#sweep-paper-regimes), and every arm against the recovery arm with
its speed-up at matched loss, one column group per regime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_figures import paper_verdicts
from benchmarks.harness.branch_stats import spike_difference, troubles
from benchmarks.harness.markdown import markdown_table
from benchmarks.report.branches import COLUMNS, SCHEDULE_END, BranchRegime, rank, role
from benchmarks.report.source import Source
from benchmarks.report.words import pct, pm, resolved, table

FAMILY = "paper"
"""The records' folder under ``results/`` (``Regime.family`` of the paper regimes)."""
SCHEDULES = {"paper_act_quant": 300, "paper_lora_int8": 200}
"""The trunk's schedule where it is not :data:`.branches.SCHEDULE_END` (it bounds the extra
steps; ``tests/benchmarks/test_cost_bounds.py`` checks them against the regimes)."""
CLAIMS = {
    "paper_act_quant": "1. activation-quantization stress: GNMR moving a few units to 8 bits "
    "reaches the 8-bit perplexity where static low-bit activations do not",
    "paper_fp6_fp8": "2. dynamic FP6 to FP8: GNMR tracks fixed FP8's loss at the FP6 cost",
    "paper_lora_int8": "3. LoRA with INT8: GNMR reaches BF16 quality where INT8 alone does not",
}
"""The paper's claims, short (docs/algorithm.md#paper-experiments), by the regime testing them."""
GENERIC = "GNMR moving a few units to the recovery path reaches its loss"
HEADER = ["experiment", "the paper's claim", "design", "static gap (low-cost - recovery arm)"]
HEADER += ["nulls (reach / gap)", "arm", "share of the gap closed", "- recovery arm"]
HEADER += ["- low-cost", "verdict", "controls' shares closed (exploratory)"]


class PaperRegime(BranchRegime):
    """One paper regime's records (maybe none yet), its design and its rows of the tables."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY, SCHEDULES.get(name, SCHEDULE_END))

    def verdicts(self) -> list[dict[str, Any]]:
        """:func:`.branch_figures.paper_verdicts` of this regime, one per budget."""
        return paper_verdicts(self.records, self.design, self.arms, self.table_arms)

    def row(self, v: dict[str, Any] | None) -> list[str]:
        """A row of the verdict table: the design (``not run yet``, ``no design yet``), the
        static gap, the nulls and the verdict ``v`` on one budget (``None``: none yet)."""
        d, design = self.design, f"no design yet ({len(self.records)} records)"
        if d:
            design = f"{len(d.seeds)} of {len(self.seeds)} seeds x {len(d.points)} points, "
            design += f"{d.horizon} steps"
        design = design if self.records else "not run yet"
        head = [f"`{self.name}`", CLAIMS.get(self.name, GENERIC), design]
        if v is None:
            return [*head, *["-"] * 6, "not yet", "-"]
        nulls = [f"{n['name']} {n['pair']} ({n['reach']})" for n in self.bar["nulls"]]
        shown = v["share"] is not None and v["word"] != "not at this scale"
        controls = "; ".join(f"{a} {pct(p)}" for a, p in v["controls"]) if shown else "-"
        head += [f"{self.bar['gap']} ({self.high})", "; ".join(nulls) or "none in the design"]
        figures = [pct(v["share"]), pm(v["vs_high"]), pm(v["vs_low"])]
        return [*head, v["arm"], *figures, f"**{v['word']}**", controls]

    def cost_notes(self) -> list[str]:
        """Why the hardware models without a speed-up column price no arm (grouped by note),
        and the error term's cost per step ``C`` (docs/benchmarks.md#cost-at-matched-loss)."""
        e = self.error
        c = "not known" if e is None else f"{100 * e.share:.1f}%"
        if e and e.source.startswith("not timed"):
            c += " (not timed on this backend: the largest measured)"
        return [*self.unpriced(), f"C {c}"]


def arms_table(regimes: Sequence[PaperRegime]) -> str:
    """Every arm (by :func:`role`) of every regime with a design; per regime its held-out loss
    minus the recovery arm's (recovered work) and its speed-ups (``-``: no such arm)."""
    roles = sorted({role(a, g.high) for g in regimes for a in g.table_arms}, key=rank)
    rows: list[dict[str, str | None]] = [{"arm": r} for r in roles]
    for g in regimes:
        arm, key = {role(a, g.high): a for a in g.table_arms}, f"`{g.name}`: - {{high}} (work)"
        work = {
            key: lambda a, g=g: (
                f"{COLUMNS['held-out - {high}'](g, a)} ({COLUMNS['recovered work'](g, a)})"
            )
        }
        for head, cell in g.columns([key, "speed-up"], work):
            for r, row in zip(roles, rows, strict=True):
                row[head] = cell(arm[r]) if r in arm else "-"
    return table(rows)


def regimes(src: Source) -> list[PaperRegime]:
    """The paper's experiments in the order of their claims, then any other regime with records."""
    names = sorted({*CLAIMS, *src.regimes(FAMILY)}, key=lambda n: (n not in CLAIMS, n))
    return [PaperRegime(src, n) for n in names]


def context(src: Source) -> dict[str, Any]:
    """The section's names: the verdict table, the arms table, the cost notes, the arms waiting
    for seeds, the arms whose loss spikes minus low-cost's exclude 0, and the files."""
    every = regimes(src)
    ran = [g for g in every if g.design is not None]
    none: list[dict[str, Any] | None] = [None]
    rows = [g.row(v) for g in every for v in (g.verdicts() if g.design else []) or none]
    files = {g.file: g.command for g in every if g.records}
    spikes = [
        f"{a} {pm(p, 1)}"
        for g in ran
        for a in g.table_arms
        if a != "low-cost" and resolved(p := spike_difference(g.records, g.design, a))
    ]
    return {
        "paper_branch": {
            "verdicts": markdown_table(HEADER, rows),
            "arms": arms_table(ran) if ran else "",
            "unpriced": [(g.name, g.cost_notes()) for g in ran],
            "waiting": [(g.name, g.waiting) for g in ran if g.waiting],
            "spikes": spikes,
            "diverged": sum(troubles(g.records, g.design, a)[1] for g in ran for a in g.table_arms),
            "files": src.provenance_table(files) if files else "",
        }
    }
