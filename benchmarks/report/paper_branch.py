"""The paper's experiments on the branch estimator (issue 35, ``results/paper/``): per regime and
budget the claim's verdict (docs/benchmarks.md#sweep-paper-regimes), and every arm against the
recovery arm with its speed-up at matched loss, one column group per regime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_figures import paper_verdicts
from benchmarks.harness.branch_stats import spike_difference, troubles
from benchmarks.report.branches import SCHEDULE_END, BranchRegime, rank, role
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
TIMED = " (not timed on this backend: the largest measured)"


class PaperRegime(BranchRegime):
    """One paper regime's records (maybe none yet), its design and its rows of the tables."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY, SCHEDULES.get(name, SCHEDULE_END))
        self.claim = CLAIMS.get(name, GENERIC)

    def verdicts(self) -> list[dict[str, Any]]:
        """:func:`.branch_figures.paper_verdicts` of this regime, one per budget."""
        return paper_verdicts(self.records, self.design, self.arms, self.table_arms)

    def worded(self, v: dict[str, Any]) -> dict[str, Any]:
        """The verdict ``v`` on one budget with its figures as text (the controls' shares: ``-``
        where the arm's own share is none or no gap is resolved)."""
        shown = v["share"] is not None and v["word"] != "not at this scale"
        controls = "; ".join(f"{a} {pct(p)}" for a, p in v["controls"]) if shown else "-"
        figures = {"share": pct(v["share"]), "vs_high": pm(v["vs_high"]), "vs_low": pm(v["vs_low"])}
        return v | figures | {"controls": controls}

    def cost_notes(self) -> list[str]:
        """:meth:`unpriced` and the error term's cost per step ``C``
        (docs/benchmarks.md#cost-at-matched-loss)."""
        e = self.error
        c = "not known" if e is None else f"{100 * e.share:.1f}%"
        return [*self.unpriced(), f"C {c}{TIMED if e and e.source.startswith('not timed') else ''}"]


def arms_table(regimes: Sequence[PaperRegime]) -> str:
    """Every arm (by :func:`role`) of every regime with a design; per regime its held-out loss
    minus the recovery arm's (recovered work) and its speed-ups (``-``: no such arm)."""
    roles = sorted({role(a, g.high) for g in regimes for a in g.table_arms}, key=rank)
    rows: list[dict[str, str | None]] = [{"arm": r} for r in roles]
    for g in regimes:
        arm, key = {role(a, g.high): a for a in g.table_arms}, f"`{g.name}`: - {{high}} (work)"
        (_, held), (_, work) = g.columns(["held-out - {high}", "recovered work"])
        both = {key: lambda a, h=held, w=work: f"{h(a)} ({w(a)})"}
        for head, cell in g.columns([key, "speed-up"], both):
            head = head if head.startswith("`") else f"`{g.name}`: {head}"  # one column per regime
            for row in rows:
                row[head] = cell(arm[r]) if (r := str(row["arm"])) in arm else "-"
    return table(rows)


def regimes(src: Source) -> list[PaperRegime]:
    """The paper's experiments in the order of their claims, then any other regime with records
    (built once: the top reads them too)."""
    names = sorted({*CLAIMS, *src.regimes(FAMILY)}, key=lambda n: (n not in CLAIMS, n))
    return src.once(FAMILY, lambda: [PaperRegime(src, n) for n in names])


def context(src: Source) -> dict[str, Any]:
    """The section's names: the verdict table's rows, the arms table, the cost notes, the arms
    waiting for seeds, the arms whose loss spikes minus low-cost's exclude 0, and the files."""
    every = regimes(src)
    ran = [g for g in every if g.design is not None]
    none: list[dict[str, Any] | None] = [None]
    files = {g.file: g.command for g in every if g.records}
    pairs = [(a, spike_difference(g.records, g.design, a)) for g in ran for a in g.table_arms]
    spikes = [f"{a} {pm(p, 1)}" for a, p in pairs if a != "low-cost" and resolved(p)]
    return {
        "paper_branch": {
            "rows": [
                (g, v and g.worded(v)) for g in every for v in (g.design and g.verdicts()) or none
            ],
            "arms": arms_table(ran) if ran else "",
            "unpriced": [(g.name, g.cost_notes()) for g in ran],
            "waiting": [(g.name, g.waiting) for g in ran if g.waiting],
            "spikes": spikes,
            "diverged": sum(troubles(g.records, g.design, a)[1] for g in ran for a in g.table_arms),
            "files": src.provenance_table(files) if files else "",
        }
    }
