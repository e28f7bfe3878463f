"""The FP4 section's data (issue 24): the FP4 sweeps' reports (``results/sweep_fp4_*.json``) and
the branch records behind them (``results/fp4/<regime>.jsonl``), as tables ``templates/fp4.md.j2``
prints: per regime one arms table of its largest design (quality, loss spikes, cost at matched
loss), one table of every design's comparisons, the stress's budget curve, the step-time runs.
The instrument, the arms and the cost model: docs/benchmarks.md#sweep-fp4, #branch-estimator and
#cost-at-matched-loss."""

from __future__ import annotations

from dataclasses import asdict
from functools import cached_property
from typing import Any

from benchmarks.harness import cost
from benchmarks.harness.branch_stats import GAP, SPIKE, Design, spike_figures, verdict
from benchmarks.harness.designs import reach
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import plus_minus
from benchmarks.report import words
from benchmarks.report.error_cost import error_cost
from benchmarks.report.faults import NULL_BAR
from benchmarks.report.source import Source
from benchmarks.report.words import resolved

MAIN = ("sweep_fp4_nvfp4", "sweep_fp4_mxfp4", "sweep_fp4_fp4_tensor")
"""Each regime's largest design (5 seeds x 4 branch points): its arms table."""
SMALL = ("sweep_fp4_mxfp4_p100-250", "sweep_fp4_fp4_tensor_k2-4-7_p100-250")
"""The 2-point designs run first (the stress's at budgets 2, 4 and 7): their comparisons."""
STEP = "sweep_fp4_step_time_nvfp4"
NULLS = (
    "null BF16 (1e-6) - BF16",
    "null low-cost (1e-6) - low-cost",
    "low-cost (SR seed 1) - low-cost",
)
POLICIES = ("GNMR+e", "random", "oracle", "GNMR")
CLI = "python -m benchmarks.sweep.branches"


class Sweep:
    """One FP4 sweep's report and the branch records behind it."""

    def __init__(self, src: Source, name: str) -> None:
        self.src, self.name, self.r = src, name, src.json(name)
        self.regime: str = self.r["regime"]
        self.design = Design(tuple(self.r["seeds"]), tuple(self.r["points"]), self.r["horizon"])
        self.records = src.records(self.regime)
        self.summary: dict[str, dict[str, Any]] = self.r["summary"]
        if self.r.get("spike_rule") != asdict(SPIKE):  # written before the rule: count again
            self.summary = {
                a: {**row, **spike_figures(self.records, self.design, a)}
                for a, row in self.summary.items()
            }

    @property
    def label(self) -> str:
        d = self.design
        return f"{self.regime}, {len(d.seeds)} x {len(d.points)}"

    @property
    def budgets(self) -> list[int]:
        return sorted(int(a.split()[1]) for a in self.summary if a.startswith("random "))

    def spec(self, arm: str = "low-cost") -> dict[str, Any]:
        return self.records[(arm, self.design.seeds[0], self.design.points[0])]["arm_spec"]

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`benchmarks.harness.cost.summarize_costs` of the design's arms."""
        s = self.spec()
        formats = cost.Formats(s["backend"], s["low_cost"], s["recovery"])
        return cost.summarize_costs(
            self.records,
            self.design,
            formats,
            arms=list(self.summary),
            schedule=self.r["instrument"]["trunk_steps"],
            error=error_cost(self.src, formats.backend),
        )

    def bar(self) -> dict[str, Any]:
        """The static gap (and after the earlier evaluation), each null's interval and reach as
        a share of the gap, and whether the nulls hold 0 within ``NULL_BAR`` of it."""
        gap, nulls = self.r["noise"][GAP], []
        for key in NULLS:
            if key in self.r["noise"]:
                pair = self.r["noise"][key]
                ok = not resolved(pair) and reach(pair) / abs(gap[0]) <= NULL_BAR
                name = key.split(" - ")[0].replace(" (1e-6)", "").removeprefix("null ")
                name = name.replace("low-cost (SR seed 1)", "SR seed 1")
                nulls.append({"name": name, "pair": plus_minus(pair), "ok": ok})
                nulls[-1]["reach"] = f"{reach(pair) / abs(gap[0]):.2f}"
        after = [(k.split()[3], plus_minus(p)) for k, p in self.r["noise"].items() if "after" in k]
        passes = resolved(gap) and all(n["ok"] for n in nulls)
        return {"gap": plus_minus(gap), "after": after, "nulls": nulls, "passes": passes}

    def arms_table(self) -> str:
        """One row per policy and the low-cost path (the reference, BF16, is the zero of each
        column): quality, spikes, cost at matched loss per group of hardware whose speed-ups
        differ (a model that prices no arm is left out)."""
        groups = cost.priced_groups(self.costs)
        header = ["arm", "recovered unit-steps", "held-out - BF16", "share of the gap closed"]
        header += ["loss spikes", "extra steps to match BF16"]
        header += [f"speed-up, {', '.join(g)}" for g in groups] + ["units recovered most"]
        rows = []
        for arm, r in self.summary.items():
            if arm == "BF16" or any(arm == n.split(" - ")[0] for n in NULLS):
                continue
            c = self.costs[arm]
            cells = [arm, f"{100 * r['unit_steps']:.1f}%", plus_minus(r["vs_bf16"])]
            cells += [plus_minus(r["closed"], 2), str(r["spikes"])]
            cells.append(cost.cell(c["extra_steps"], c["extra_steps_note"], 1))
            cells += [cost.speed_cell(c, g[0]) for g in groups]
            picks = self.r.get("picks", {}).get(arm, [])[:4]
            cells.append(", ".join(f"{u} {100 * x:.0f}%" for u, x in picks) or "-")
            rows.append(cells)
        return markdown_table(header, rows)

    def unpriced(self) -> list[str]:
        """``Hopper n/a (no FP4 GEMMs)`` of each hardware model that prices no arm."""
        priced = {hw for g in cost.priced_groups(self.costs) for hw in g}
        first = next(iter(self.costs.values()))["hardware"]
        return [f"{hw} {first[hw]['note']}" for hw in cost.HARDWARE if hw not in priced]

    def command(self) -> str:
        """The command that ran this design (its budgets; its branch points when not all)."""
        cmd = f"{CLI} --regime {self.regime} --budgets {','.join(map(str, self.budgets))}"
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
        (s.regime, b, verdict(s.r["comparisons"][f"GNMR+e {b} - random {b}"]))
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
    files = {f"{n}.json": f"`{s.command()}`" for n, s in sw.items()}
    files |= {f"fp4/{s.regime}.jsonl": "(the sweeps above)" for s in main}
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
