"""The paper's experiments on the branch estimator (issue 35 item 2, ``results/paper/``): per
regime (:class:`.branches.BranchRegime`, the reference its recovery arm) and budget the claim's
verdict (docs/benchmarks.md#sweep-paper-regimes), and every arm against the recovery arm with
its speed-up at matched loss, one column pair per regime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness.branch_stats import share_closed, spike_difference, troubles
from benchmarks.harness.designs import verdict
from benchmarks.harness.markdown import markdown_table
from benchmarks.report import words
from benchmarks.report.branches import SCHEDULE_END, BranchRegime, budget, rank, role
from benchmarks.report.source import Source

FAMILY = "paper"
"""The records' folder under ``results/`` (``Regime.family`` of the paper regimes)."""
LOW = "low-cost"
SCHEDULES = {"paper_act_quant": 300, "paper_lora_int8": 200}
"""The trunk's schedule where it is not :data:`.branches.SCHEDULE_END` (it bounds the extra
steps; ``tests/benchmarks/test_cost_bounds.py`` checks them against the regimes)."""
CONTROLS = ("NVIDIA last", "random", "GNMR+e", "oracle")
"""The policies whose shares stand beside GNMR's verdict (by name prefix)."""
CLAIMS = {
    "paper_act_quant": "1. activation-quantization stress: GNMR moving a few units to 8 bits "
    "reaches the 8-bit perplexity where static low-bit activations do not",
    "paper_fp6_fp8": "2. dynamic FP6 to FP8: GNMR tracks fixed FP8's loss at the FP6 cost",
    "paper_lora_int8": "3. LoRA with INT8: GNMR reaches BF16 quality where INT8 alone does not",
}
"""The paper's claims, short (docs/algorithm.md#paper-experiments), by the regime testing them."""
GENERIC = "GNMR moving a few units to the recovery path reaches its loss"


class PaperRegime(BranchRegime):
    """One paper regime's records (maybe none yet), its design and its rows of the tables."""

    def __init__(self, src: Source, name: str) -> None:
        super().__init__(src, name, FAMILY, SCHEDULES.get(name, SCHEDULE_END))

    def design_cell(self) -> str:
        """``5 of 5 seeds x 3 points, 50 steps`` (``not run yet`` without records)."""
        d, seeds = self.design, {s for _, s, _ in self.records}
        if not self.records:
            return "not run yet"
        if d is None:
            return f"no design yet ({len(self.records)} records)"
        return f"{len(d.seeds)} of {len(seeds)} seeds x {len(d.points)} points, {d.horizon} steps"

    def nulls(self) -> str:
        """Each null in the design: its interval and its reach over the static gap."""
        cells = [f"{n['name']} {n['pair']} ({n['reach']})" for n in self.bar["nulls"]]
        return "; ".join(cells) or "none in the design"

    def verdicts(self) -> list[dict[str, Any]]:
        """Per budget of the paper's ``GNMR k`` recorded: :func:`verdict` (``not yet`` outside the
        design), with ``controls``: the shares closed of :data:`CONTROLS` at that budget."""
        out, d, arms = [], self.design, self.table_arms
        for k in sorted({k for a in self.arms if a.startswith("GNMR ") and (k := budget(a))}):
            arm, nvidia = f"GNMR {k}", CONTROLS[0]
            v = verdict(self.records, d, arm) if arm in arms else {"arm": arm, "word": "not yet"}
            beside = [a for a in arms if a.startswith(nvidia) or (budget(a) == k and a != arm)]
            v["controls"] = [(a, share_closed(self.records, d, a)) for a in beside]
            out.append({"share": None, "vs_high": None, "vs_low": None} | v)
        return out

    def verdict_rows(self) -> list[list[str]]:
        """One row per :meth:`verdicts` (one ``not yet`` row without a design or a GNMR arm)."""
        head = [f"`{self.name}`", CLAIMS.get(self.name, GENERIC), self.design_cell()]
        vs = self.verdicts() if self.design else []
        if not vs:
            return [[*head, *["-"] * 6, "not yet", "-"]]
        gap = f"{self.bar['gap']} ({self.high})"
        rows = []
        for v in vs:
            shown = v["share"] is not None and v["word"] != "not at this scale"
            beside = "; ".join(f"{a} {words.pct(p)}" for a, p in v["controls"]) if shown else "-"
            rows.append([*head, gap, self.nulls(), v["arm"], words.pct(v["share"])])
            rows[-1] += [words.pm(v["vs_high"]), words.pm(v["vs_low"]), f"**{v['word']}**", beside]
        return rows

    def priced(self) -> tuple[str, ...] | None:
        """The first group of hardware models that prices an arm (the table's column), if any."""
        return next(iter(self.groups()), None)

    def cost_notes(self) -> list[str]:
        """Why the hardware models outside the table's column price no arm (grouped by note),
        and the error term's cost per step ``C`` (docs/benchmarks.md#cost-at-matched-loss)."""
        e = self.error
        c = "not known" if e is None else f"{100 * e.share:.1f}%"
        if e and e.source.startswith("not timed"):
            c += " (not timed on this backend: the largest measured)"
        return [*self.unpriced(), f"C {c}"]

    def role_cells(self, r: str) -> list[str]:
        """The arm of role ``r``: held-out - the recovery arm (work), speed-up (if priced)."""
        arm = next((a for a in self.table_arms if role(a, self.high) == r), None)
        if arm is None:
            return ["-"] * (2 if self.priced() else 1)
        diff, work, *speed = self.cells(arm, ["held-out - {high}", "recovered work", "speed-up"])
        return [f"{diff} ({work})", *speed[:1]]

    def spikes(self) -> list[str]:
        """The arms whose loss spikes minus low-cost's exclude 0 (per seed, 95%)."""
        d = self.design
        pairs = {a: spike_difference(self.records, d, a) for a in self.table_arms if a != LOW}
        return [f"{a} {words.pm(p, 1)}" for a, p in pairs.items() if words.resolved(p)]


def arms_table(regimes: Sequence[PaperRegime]) -> str:
    """Every arm (by :func:`role`) of every regime with a design, a column pair per regime."""
    header = ["arm"]
    for g in regimes:
        header.append(f"`{g.name}`: - {g.high} (work)")
        if g.priced():
            header.append(f"speed-up, {', '.join(g.priced())}")
    roles = sorted({role(a, g.high) for g in regimes for a in g.table_arms}, key=rank)
    rows = [[r, *(c for g in regimes for c in g.role_cells(r))] for r in roles]
    return markdown_table(header, rows)


def regimes(src: Source) -> list[PaperRegime]:
    """The paper's experiments in the order of their claims, then any other regime with records."""
    names = sorted({*CLAIMS, *src.regimes(FAMILY)}, key=lambda n: (n not in CLAIMS, n))
    return [PaperRegime(src, n) for n in names]


def context(src: Source) -> dict[str, Any]:
    """The section's names: the verdict table, the arms table and what they rest on."""
    every = regimes(src)
    ran = [g for g in every if g.design is not None]
    header = ["experiment", "the paper's claim", "design", "static gap (low-cost - recovery arm)"]
    header += ["nulls (reach / gap)", "arm", "share of the gap closed", "- recovery arm"]
    header += ["- low-cost", "verdict", "controls' shares closed (exploratory)"]
    rows = [row for g in every for row in g.verdict_rows()]
    files = {g.file: g.command for g in every if g.records}
    return {
        "paper_branch": {
            "verdicts": markdown_table(header, rows),
            "arms": arms_table(ran) if ran else "",
            "unpriced": [(g.name, g.cost_notes()) for g in ran],
            "waiting": [(g.name, g.waiting) for g in ran if g.waiting],
            "spikes": [s for g in ran for s in g.spikes()],
            "diverged": sum(troubles(g.records, g.design, a)[1] for g in ran for a in g.table_arms),
            "files": src.provenance_table(files) if files else "",
        }
    }
