"""The FP4 section (issue 24): per sweep report (``results/sweep_fp4_*.json``) its regime's arms
table on the report's design (:class:`.branches.BranchRegime`), every design's comparisons, the
stress's budget curve, the step-time runs. Methods: docs/benchmarks.md#sweep-fp4."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.branch_figures import fp4_budgets, fp4_verdicts
from benchmarks.harness.branch_stats import Design, verdict
from benchmarks.report.branches import CLI, BranchRegime, nulls
from benchmarks.report.source import Source
from benchmarks.report.words import pct, pm, resolved, table

MAIN = ("sweep_fp4_nvfp4", "sweep_fp4_mxfp4", "sweep_fp4_fp4_tensor")
"""Each regime's largest design (5 seeds x 4 branch points): its arms table."""
SMALL = ("sweep_fp4_mxfp4_p100-250", "sweep_fp4_fp4_tensor_k2-4-7_p100-250")
"""The 2-point designs run first (the stress's at budgets 2, 4 and 7): their comparisons."""
STEP = "sweep_fp4_step_time_nvfp4"
POLICIES = ("GNMR+e", "random", "oracle", "GNMR")
COLUMNS = ["recovered work", "held-out - {high}", "share of the gap closed", "loss spikes"]
COLUMNS += ["extra steps to match BF16", "speed-up", "units recovered most"]
K = 4
"""NVIDIA's budget (its last-layers rule keeps 4 of the 28 units in BF16): the summary's."""


class Sweep(BranchRegime):
    """One FP4 sweep's report (``r``) and the branch records behind it, on the report's design;
    its command names its budgets (and its branch points when not all)."""

    def __init__(self, src: Source, name: str) -> None:
        r = src.json(name)
        d = Design(tuple(r["seeds"]), tuple(r["points"]), r["horizon"])
        super().__init__(src, r["regime"], "fp4", r["instrument"]["trunk_steps"], d)
        self.r, self.summary, self.table_arms = r, r["summary"], list(r["summary"])
        self.label, self.budgets = f"{self.name}, {len(d.seeds)} x {len(d.points)}", fp4_budgets(r)
        opts = f"--regime {self.name} --budgets {','.join(map(str, self.budgets))}"
        if d.points != tuple(r["instrument"]["points"]):
            opts += f" --points {','.join(map(str, d.points))}"
        self.command = f"`{CLI} {opts}`"
        # the static gap at the earlier evaluation: (steps, interval)
        self.after = [(k.split()[3], pm(p)) for k, p in r["noise"].items() if "after" in k]

    def table(self) -> str:
        """The arms table (:data:`COLUMNS`): the policies and the low-cost path (BF16 and the
        nulls left out), with the units each policy recovered most (the report's picks)."""
        arms = [a for a in self.summary if a != "BF16" and a not in nulls("BF16")]
        picks = {
            a: ", ".join(f"{u} {100 * x:.0f}%" for u, x in p[:4])
            for a, p in self.r.get("picks", {}).items()
        }
        return self.arms_table(COLUMNS, arms, {COLUMNS[-1]: lambda a: picks.get(a) or "-"})

    def compared(self, name: str) -> str:
        """A comparison's interval, its verdict in bold where resolved (``-``: not run here)."""
        pair = self.r["comparisons"].get(name)
        return pm(pair) + (f" **{verdict(pair)}**" if pair and resolved(pair) else "")

    def closed(self, k: int, policy: str) -> str:
        """The policy's share of the gap closed at budget ``k`` (its unit-step share)."""
        r = self.summary[f"{policy} {k}"]
        return f"{pm(r['closed'], 2)} ({100 * r['unit_steps']:.1f}%)"


def in_short(sw: dict[str, Sweep]) -> dict[str, Any]:
    """:func:`.branch_figures.fp4_verdicts` at :data:`K`, shares as text, with the units and
    seeds of NVFP4's design: what the summary words (``fp4_short.md.j2``)."""
    nv, mx, st = (sw[n] for n in MAIN)
    v = fp4_verdicts(nv.r, mx.r, st.r, K, [s.r for s in sw.values()])
    return v | {
        "k": K,
        "units": nv.low["unit_steps"] // nv.design.horizon,
        "seeds": len(nv.design.seeds),
        "nv": pct(v["nv"]),
        "st": pct(v["st"]),
        "mx": [(a, pct(p)) for a, p in v["mx"].items()],
    }


def context(src: Source) -> dict[str, Any]:
    """The FP4 section's names: the sweeps, the comparisons of every design (one column each),
    the stress's budget curve, the step-time runs and the files."""
    sw = {n: Sweep(src, n) for n in (*MAIN, *SMALL)}
    main, curve = [sw[n] for n in MAIN], sw[SMALL[1]]
    names = list(dict.fromkeys(n for s in sw.values() for n in s.r["comparisons"]))
    names.sort(key=lambda n: int(n.split(" - ")[0].split()[-1]))
    compared = [{"comparison": n} | {s.label: s.compared(n) for s in sw.values()} for n in names]
    closed = [
        {"policy": p} | {f"k = {k}": curve.closed(k, p) for k in curve.budgets} for p in POLICIES
    ]
    step = src.json(STEP) if src.has(f"{STEP}.json") else None
    files = {f"{n}.json": s.command for n, s in sw.items()}
    files |= {s.file: "(the sweeps above)" for s in main}
    if step:
        step["within"] = all(r["vs_nvidia"] <= step["target"] for r in step["runs"])
        files[f"{STEP}.json"] = f"`{CLI} --step-time --regime nvfp4`"
    return {
        "fp4": {
            "main": main,
            "comparisons": table(compared),
            "curve": curve,
            "curve_table": table(closed),
            "step": step,
            "files": src.provenance_table(files),
            "diverged": sum(r["diverged"] for s in sw.values() for r in s.summary.values()),
            "by_unit_steps": any(
                c["flops_from_unit_steps"] for s in main for c in s.costs.values()
            ),
        },
        "fp4_short": in_short(sw),
    }
