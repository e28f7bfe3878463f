"""The FP4 section (issue 24): per sweep report (``results/sweep_fp4_*.json``) its regime's arms
table on the report's design (:class:`.branches.BranchRegime`), every design's comparisons, the
stress's budget curve, the step-time runs. Methods: docs/benchmarks.md#sweep-fp4."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.branch_stats import Design, verdict
from benchmarks.harness.designs import above
from benchmarks.report.branches import CLI, BranchRegime, nulls
from benchmarks.report.source import Source
from benchmarks.report.words import pct, pm, resolved, table

MAIN = ("sweep_fp4_nvfp4", "sweep_fp4_mxfp4", "sweep_fp4_fp4_tensor")
"""Each regime's largest design (5 seeds x 4 branch points): its arms table."""
SMALL = ("sweep_fp4_mxfp4_p100-250", "sweep_fp4_fp4_tensor_k2-4-7_p100-250")
"""The 2-point designs run first (the stress's at budgets 2, 4 and 7): their comparisons."""
STEP = "sweep_fp4_step_time_nvfp4"
POLICIES = ("GNMR+e", "random", "oracle", "GNMR")
COLUMNS: tuple[str, ...] = (
    "recovered work",
    "held-out - {high}",
    "share of the gap closed",
    "loss spikes",
)
COLUMNS += ("extra steps to match BF16", "speed-up", "units recovered most")
"""The arms table's columns (:meth:`.branches.BranchRegime.arms_table`)."""
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
        self.label = f"{self.name}, {len(d.seeds)} x {len(d.points)}"
        self.budgets = sorted(int(a.split()[1]) for a in self.summary if a.startswith("random "))
        opts = [f"--budgets {','.join(map(str, self.budgets))}"]
        if d.points != tuple(r["instrument"]["points"]):
            opts.append(f"--points {','.join(map(str, d.points))}")
        self.command = f"`{CLI} --regime {self.name} {' '.join(opts)}`"
        # the static gap at the earlier evaluation: (steps, interval)
        self.after = [(k.split()[3], pm(p)) for k, p in r["noise"].items() if "after" in k]

    def table(self) -> str:
        """The arms table: the policies and the low-cost path (BF16 and the nulls left out), with
        the units each policy recovered most (the report's picks)."""
        arms = [a for a in self.summary if a != "BF16" and a not in nulls("BF16")]
        picks = {
            a: ", ".join(f"{u} {100 * x:.0f}%" for u, x in p[:4])
            for a, p in self.r.get("picks", {}).items()
        }
        return self.arms_table(COLUMNS, arms, {COLUMNS[-1]: lambda a: picks.get(a) or "-"})

    def compared(self, name: str) -> str:
        """A comparison's interval, its verdict in bold where resolved (``-``: not run here)."""
        pair = self.r["comparisons"].get(name)
        word = f" **{verdict(pair)}**" if pair and resolved(pair) else ""
        return pm(pair) + word

    def closed(self, k: int, policy: str) -> str:
        """The policy's share of the gap closed at budget ``k`` (its unit-step share)."""
        r = self.summary[f"{policy} {k}"]
        return f"{pm(r['closed'], 2)} ({100 * r['unit_steps']:.1f}%)"


def in_short(sw: dict[str, Sweep]) -> dict[str, Any]:
    """The FP4 verdicts at NVIDIA's budget that the summary words (``fp4_short.md.j2``): GNMR+e's
    share of the gap closed and its verdict against NVIDIA's rule in NVFP4 (``nv``) and the
    stress (``st``); MXFP4's arms whose share lies above 0 and whether GNMR+e loses to one; and
    GNMR+e against random at every budget where that is resolved."""
    (nv, mx, st), e = (sw[n] for n in MAIN), f"GNMR+e {K}"
    shares = {a: r["closed"] for a, r in mx.summary.items() if "null" not in a}
    mx_arms = [
        a for a, p in shares.items() if a not in ("low-cost", "BF16", "first+last") and above(p)
    ]
    vs = [
        (s.name, k, s.compared(f"GNMR+e {k} - random {k}")) for s in sw.values() for k in s.budgets
    ]
    return {
        "k": K,
        "units": nv.low["unit_steps"] // nv.design.horizon,
        "nv": pct(nv.summary[e]["closed"]),
        "nv_last": verdict(nv.r["comparisons"][f"{e} - NVIDIA last-{K}"]),
        "st": pct(st.summary[e]["closed"]),
        "st_last": verdict(st.r["comparisons"][f"{e} - NVIDIA last-{K}"]),
        "mx": [(a, pct(shares[a])) for a in mx_arms],
        "mx_beats_e": any(mx.compared(f"{e} - {a}").endswith("**worse**") for a in mx_arms),
        "vs_random": [(n, k, c.split("**")[1]) for n, k, c in vs if "**" in c],
        "seeds": len(nv.design.seeds),
    }


def context(src: Source) -> dict[str, Any]:
    """The FP4 section's names: the sweeps, the comparisons of every design (one column each),
    the stress's budget curve, the step-time runs and the files."""
    sw = {n: Sweep(src, n) for n in (*MAIN, *SMALL)}
    main, curve = [sw[n] for n in MAIN], sw[SMALL[1]]
    names = list(dict.fromkeys(n for s in sw.values() for n in s.r["comparisons"]))
    names.sort(key=lambda n: int(n.split(" - ")[0].split()[-1]))
    step = src.json(STEP) if src.has(f"{STEP}.json") else None
    files = {f"{n}.json": s.command for n, s in sw.items()}
    files |= {s.file: "(the sweeps above)" for s in main}
    if step:
        step["within"] = all(r["vs_nvidia"] <= step["target"] for r in step["runs"])
        files[f"{STEP}.json"] = f"`{CLI} --step-time --regime nvfp4`"
    return {
        "fp4": {
            "main": main,
            "comparisons": table(
                [{"comparison": n} | {s.label: s.compared(n) for s in sw.values()} for n in names]
            ),
            "curve": curve,
            "curve_table": table(
                [
                    {"policy": p} | {f"k = {k}": curve.closed(k, p) for k in curve.budgets}
                    for p in POLICIES
                ]
            ),
            "step": step,
            "files": src.provenance_table(files),
            "diverged": sum(r["diverged"] for s in sw.values() for r in s.summary.values()),
            "by_unit_steps": any(
                c["flops_from_unit_steps"] for s in main for c in s.costs.values()
            ),
        },
        "fp4_short": in_short(sw),
    }
