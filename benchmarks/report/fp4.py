"""The FP4 section (issue 24): per sweep report (``results/sweep_fp4_*.json``) its regime's arms
table on the report's design (:class:`.branches.BranchRegime`), every design's comparisons, the
stress's budget curve, the step-time runs. Methods: docs/benchmarks.md#sweep-fp4."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.branch_stats import Design, verdict
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import plus_minus
from benchmarks.report import words
from benchmarks.report.branches import CLI, BranchRegime, nulls
from benchmarks.report.source import Source
from benchmarks.report.words import resolved

MAIN = ("sweep_fp4_nvfp4", "sweep_fp4_mxfp4", "sweep_fp4_fp4_tensor")
"""Each regime's largest design (5 seeds x 4 branch points): its arms table."""
SMALL = ("sweep_fp4_mxfp4_p100-250", "sweep_fp4_fp4_tensor_k2-4-7_p100-250")
"""The 2-point designs run first (the stress's at budgets 2, 4 and 7): their comparisons."""
STEP = "sweep_fp4_step_time_nvfp4"
POLICIES = ("GNMR+e", "random", "oracle", "GNMR")
COLUMNS = ("recovered work", "held-out - {high}", "share of the gap closed", "loss spikes")
COLUMNS += ("extra steps to match BF16", "speed-up", "units recovered most")
"""The arms table's columns (:meth:`.branches.BranchRegime.arms_table`)."""


class Sweep(BranchRegime):
    """One FP4 sweep's report (``r``) and the branch records behind it, on the report's design."""

    def __init__(self, src: Source, name: str) -> None:
        r = src.json(name)
        d = Design(tuple(r["seeds"]), tuple(r["points"]), r["horizon"])
        super().__init__(src, r["regime"], "fp4", r["instrument"]["trunk_steps"], d)
        self.r, self.summary = r, r["summary"]
        self.table_arms = list(self.summary)

    @property
    def label(self) -> str:
        d = self.design
        return f"{self.name}, {len(d.seeds)} x {len(d.points)}"

    @property
    def budgets(self) -> list[int]:
        return sorted(int(a.split()[1]) for a in self.summary if a.startswith("random "))

    def after(self) -> list[tuple[str, str]]:
        """The static gap at the earlier evaluation (steps, interval)."""
        return [(k.split()[3], plus_minus(p)) for k, p in self.r["noise"].items() if "after" in k]

    def picks(self, arm: str) -> str:
        """The units the arm recovered most (the report's picks)."""
        picks = self.r.get("picks", {}).get(arm, [])[:4]
        return ", ".join(f"{u} {100 * x:.0f}%" for u, x in picks) or "-"

    def table(self) -> str:
        """The arms table: the policies and the low-cost path (BF16, the zero, and the nulls
        left out)."""
        arms = [a for a in self.summary if a != "BF16" and a not in nulls("BF16")]
        return self.arms_table(COLUMNS, arms, {"units recovered most": self.picks})

    @property
    def command(self) -> str:
        """The command that ran this design (its budgets; its branch points when not all)."""
        cmd = f"{CLI} --regime {self.name} --budgets {','.join(map(str, self.budgets))}"
        if self.design.points != tuple(self.r["instrument"]["points"]):
            cmd += f" --points {','.join(map(str, self.design.points))}"
        return cmd

    def diverged(self) -> int:
        return sum(r["diverged"] for r in self.summary.values())


def _cell(s: Sweep, name: str) -> str:
    pair = s.r["comparisons"].get(name)
    if pair is None:
        return "-"
    v = verdict(pair)
    return plus_minus(pair) + (f" **{v}**" if resolved(pair) else "")


def comparisons(sweeps: list[Sweep]) -> str:
    """Every comparison of every design, one row each, one column per design."""
    names = list(dict.fromkeys(n for s in sweeps for n in s.r["comparisons"]))
    names.sort(key=lambda n: int(n.split(" - ")[0].split()[-1]))
    header = ["comparison", *(s.label for s in sweeps)]
    return markdown_table(header, [[n, *(_cell(s, n) for s in sweeps)] for n in names])


def budget_curve(s: Sweep) -> str:
    """Share of the gap closed (unit-step share) per policy and budget."""
    rows = []
    for p in POLICIES:
        cells = [p]
        for k in s.budgets:
            r = s.summary[f"{p} {k}"]
            cells.append(f"{plus_minus(r['closed'], 2)} ({100 * r['unit_steps']:.1f}%)")
        rows.append(cells)
    return markdown_table(["policy", *(f"k = {k}" for k in s.budgets)], rows)


def in_short(sw: dict[str, Sweep]) -> dict[str, Any]:
    """The FP4 verdicts at NVIDIA's budget that the summary words (``fp4_short.md.j2``)."""
    nv, mx, st = (sw[n] for n in MAIN)
    k = 4

    def closed(s: Sweep, arm: str) -> str:
        return words.pct(s.summary[arm]["closed"])

    measurable = [
        (a, closed(mx, a))
        for a, r in mx.summary.items()
        if a not in ("low-cost", "BF16", "first+last")
        and "null" not in a
        and r["closed"][0] > 0
        and resolved(r["closed"])
    ]
    vs_random = [
        (s.name, b, verdict(s.r["comparisons"][f"GNMR+e {b} - random {b}"]))
        for s in (*sw.values(),)
        for b in s.budgets
    ]
    return {
        "k": k,
        "units": nv.records[("low-cost", *nv.design.seeds[:1], *nv.design.points[:1])]["unit_steps"]
        // nv.design.horizon,
        "nv": closed(nv, f"GNMR+e {k}"),
        "nv_last": verdict(nv.r["comparisons"][f"GNMR+e {k} - NVIDIA last-{k}"]),
        "st": closed(st, f"GNMR+e {k}"),
        "st_last": verdict(st.r["comparisons"][f"GNMR+e {k} - NVIDIA last-{k}"]),
        "mx": measurable,
        "mx_beats_e": [
            a
            for a, _ in measurable
            if verdict(mx.r["comparisons"].get(f"GNMR+e {k} - {a}", [0, 1])) == "worse"
        ],
        "vs_random": [x for x in vs_random if x[2] != "not resolved"],
        "seeds": len(nv.design.seeds),
    }


def context(src: Source) -> dict[str, Any]:
    """The FP4 section's names."""
    sw = {n: Sweep(src, n) for n in (*MAIN, *SMALL)}
    main = [sw[n] for n in MAIN]
    step = src.json(STEP) if src.has(f"{STEP}.json") else None
    if step:
        step["within"] = all(r["vs_nvidia"] <= step["target"] for r in step["runs"])
    files = {f"{n}.json": f"`{s.command}`" for n, s in sw.items()}
    files |= {s.file: "(the sweeps above)" for s in main}
    if step:
        files[f"{STEP}.json"] = f"`{CLI} --step-time --regime nvfp4`"
    return {
        "fp4": {
            "main": main,
            "comparisons": comparisons([*main, *(sw[n] for n in SMALL)]),
            "curve": sw[SMALL[1]],
            "curve_table": budget_curve(sw[SMALL[1]]),
            "step": step,
            "step_name": STEP,
            "files": src.provenance_table(files),
            "diverged": sum(s.diverged() for s in sw.values()),
            "by_unit_steps": any(
                c["flops_from_unit_steps"] for s in main for c in s.costs.values()
            ),
        },
        "fp4_short": in_short(sw),
    }
