"""The FP4 section's data (issue 24): one FP4 sweep's report (``results/sweep_fp4_*.json``) and
the branch records behind it (``results/fp4/<regime>.jsonl``), as ``templates/fp4.md.j2`` reads
them, and the figures the template derives from several of them."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from functools import cached_property
from typing import Any

from benchmarks.harness import cost
from benchmarks.harness.branch_stats import (
    GAP,
    SPIKE,
    Design,
    per_seed,
    spike_figures,
    verdict,
)
from benchmarks.harness.stats import t95
from benchmarks.report.error_cost import error_cost
from benchmarks.report.source import Source
from benchmarks.report.words import listing, resolved, span

CONTROLS = ("low-cost", "BF16", "null BF16 (1e-6)", "null low-cost (1e-6)", "low-cost (SR seed 1)")
"""The arms that are not precision policies: the two static paths and the null controls."""

NULLS = {  # noise figure -> its name in the bullet
    "null BF16 (1e-6) - BF16": "BF16",
    "null low-cost (1e-6) - low-cost": "low-cost",
    "low-cost (SR seed 1) - low-cost": "SR seed 1",
}

CLI = ".venv/bin/python -m benchmarks.sweep.fp4"

POLICIES = ("GNMR+e", "GNMR", "random", "oracle")
"""The budgeted policies, named ``<policy> <k>``."""

NAMES = {
    "nv": "sweep_fp4_nvfp4",
    "mx": "sweep_fp4_mxfp4_p100-250",
    "mx_all": "sweep_fp4_mxfp4",
    "st": "sweep_fp4_fp4_tensor_k2-4-7_p100-250",
    "st_all": "sweep_fp4_fp4_tensor",
}
"""The section's sweeps by the name the template gives them."""


class Sweep:
    """One report of an FP4 sweep (``results/<name>.json``) and the branch records behind it."""

    def __init__(self, src: Source, name: str) -> None:
        self.src, self.name = src, name
        self.r: dict[str, Any] = src.json(name)
        self.regime: str = self.r["regime"]
        self.seeds: list[int] = self.r["seeds"]
        self.points: list[int] = self.r["points"]
        self.horizon: int = self.r["horizon"]
        self.inst: dict[str, Any] = self.r["instrument"]
        self.summary: dict[str, dict[str, Any]] = self._counted(self.r["summary"])
        self.noise: dict[str, list[float]] = self.r["noise"]
        self.gap: list[float] = self.noise[GAP]
        k = self.k
        self.e, self.gnmr, self.rand, self.oracle = (f"{p} {k}" for p in POLICIES)
        self.last, self.late = self.arm("NVIDIA last"), self.arm("NVIDIA late")

    @cached_property
    def records(self) -> dict[tuple[str, int, int], dict[str, Any]]:
        return self.src.records(self.regime)

    def _counted(self, summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The summary with its loss spikes counted by the current rule (:data:`SPIKE`): as
        stored when the report was written under it, else counted again from the branch records
        (a report written before the rule was recorded counted the steps whose gap to BF16
        exceeded 0.1 nats)."""
        if self.r.get("spike_rule") == asdict(SPIKE):
            return summary
        d = Design(tuple(self.seeds), tuple(self.points), self.horizon)
        return {arm: {**row, **spike_figures(self.records, d, arm)} for arm, row in summary.items()}

    @property
    def budgets(self) -> list[int]:
        return sorted(int(a.split()[1]) for a in self.summary if a.startswith("random "))

    def arm(self, prefix: str) -> str:
        """The one arm whose name starts with ``prefix`` (``NVIDIA last``: ``NVIDIA last-4``)."""
        (name,) = [a for a in self.summary if a.startswith(prefix)]
        return name

    @property
    def k(self) -> int:
        """NVIDIA's budget: the k of ``NVIDIA last-k``."""
        return int(self.arm("NVIDIA last").rpartition("-")[2])

    @property
    def late_steps(self) -> int:
        """The steps of NVIDIA's late switch: the n of ``NVIDIA late-n``."""
        return int(self.late.rpartition("-")[2])

    @cached_property
    def units(self) -> int:
        """Projection units of the model: a branch's unit-steps over its steps."""
        r = self.records[("low-cost", self.seeds[0], self.points[0])]
        return r["unit_steps"] // self.horizon

    def spec(self, arm: str) -> dict[str, Any]:
        """The arm's specification, as its first branch record has it."""
        return self.records[(arm, self.seeds[0], self.points[0])]["arm_spec"]

    def options(self) -> str:
        return json.dumps(self.spec("low-cost")["low_cost"])

    def formats(self) -> cost.Formats:
        """The backend and the two paths' options, as the low-cost arm's records state them."""
        s = self.spec("low-cost")
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    @cached_property
    def costs(self) -> dict[str, dict[str, Any]]:
        """:func:`benchmarks.harness.cost.summarize_costs` of the design's arms."""
        d = Design(tuple(self.seeds), tuple(self.points), self.horizon)
        return cost.summarize_costs(
            self.records,
            d,
            self.formats(),
            arms=list(self.summary),
            schedule=self.inst["trunk_steps"],
            error=error_cost(self.src, self.formats().backend),
        )

    def cost_table(self) -> str:
        """The cost at matched loss of every arm, per hardware (:mod:`benchmarks.harness.cost`)."""
        return cost.cost_table(self.costs, horizon=self.horizon)

    def unit_step_costs(self) -> bool:
        """Whether any branch's FLOP share fell back to its unit-step share (no
        ``flops_recovered``: records written before it existed)."""
        return any(r["flops_from_unit_steps"] for r in self.costs.values())

    def priced(self) -> str:
        """The formats priced and at what rates (the cost model's last assumption line)."""
        line = cost.assumptions(self.formats(), self.horizon, self.early_eval)[-1]
        e = error_cost(self.src, self.formats().backend)
        c = "not known" if e is None else f"{100 * e.share:.1f}% ({e.source})"
        return f"{line[0].lower()}{line[1:].removesuffix('.')}; the error term's C = {c}"

    @property
    def early_eval(self) -> int:
        """The held-out measurement before the horizon (the cost model's local rate)."""
        return max(e for e in self.inst["evals"] if e < self.horizon)

    def gap_after(self) -> tuple[int, list[float]] | None:
        """(steps, static gap) at the earlier evaluation of the branches, when there is one."""
        for name, pair in self.noise.items():
            if name.startswith("static gap after"):
                return int(name.split()[3]), pair
        return None

    def nulls(self) -> list[tuple[str, list[float]]]:
        """(name, interval) of the null controls this sweep ran."""
        return [(word, self.noise[key]) for key, word in NULLS.items() if key in self.noise]

    def closed(self, arm: str) -> list[float]:
        return self.summary[arm]["closed"]

    def share(self, arm: str) -> str:
        """The arm's share of unit-steps on the recovery path, ``14.3``."""
        return f"{100 * self.summary[arm]['unit_steps']:.1f}"

    def spikes(self, arm: str) -> int:
        return self.summary[arm]["spikes"]

    def troubles(self) -> int:
        """Loss spikes and divergences of all arms together."""
        return sum(r["spikes"] + r["diverged"] for r in self.summary.values())

    def comp(self, a: str, b: str) -> list[float]:
        return self.r["comparisons"][f"{a} - {b}"]

    def fp4_arms(self, k: int | None = None) -> list[str]:
        """Arms with some unit-steps on FP4 (at budget ``k`` and the controls, when given)."""
        arms = [a for a in self.summary if self.summary[a]["unit_steps"] < 1]
        if k is not None:
            arms = [a for a in arms if not a[-1].isdigit() or a.endswith(f" {k}") or "-" in a]
        return arms

    def calmer(self, arm: str) -> bool:
        """Whether ``arm`` has fewer loss spikes than all-FP4, resolved per seed."""
        pair = self.summary[arm]["spikes_vs_low_cost"]
        return pair is not None and verdict(pair) == "better"

    def spike_differences(self) -> list[tuple[str, list[float]]]:
        """(arm, interval) of every arm whose loss spikes per seed differ resolvedly from
        all-FP4's (:func:`~benchmarks.harness.branch_stats.spike_difference`)."""
        pairs = [(a, r["spikes_vs_low_cost"]) for a, r in self.summary.items()]
        return [(a, p) for a, p in pairs if p is not None and resolved(p)]

    def steps(self) -> int:
        """Training steps of one arm's branches together."""
        return len(self.seeds) * len(self.points) * self.horizon

    def tightest(self, arm: str, k: int) -> bool:
        """Whether ``arm``'s interval against BF16 is the narrowest of the FP4 arms at ``k``."""
        half = self.summary[arm]["vs_bf16"][1]
        return half == min(self.summary[a]["vs_bf16"][1] for a in self.fp4_arms(k))

    def lowest_curve(self) -> bool:
        """Whether GNMR+e ends lowest of the budgeted policies at every budget."""
        return all(
            self.summary[f"GNMR+e {k}"]["vs_bf16"][0]
            == min(self.summary[f"{p} {k}"]["vs_bf16"][0] for p in POLICIES)
            for k in self.budgets
        )

    def measurable(self) -> list[str]:
        """Policies at NVIDIA's budget (``first+last`` spends half the unit-steps) whose share
        of the static gap closed is resolved above 0."""
        return [
            a
            for a in self.summary
            if a not in (*CONTROLS, "first+last")
            and self.closed(a)[0] > 0
            and resolved(self.closed(a))
        ]

    def resolved_comparisons(self) -> list[tuple[str, str, list[float]]]:
        """(a, b, interval) of every resolved comparison ``a - b``."""
        return [(*n.split(" - "), p) for n, p in self.r["comparisons"].items() if resolved(p)]

    def grouped(self, a: str, others: Sequence[str]) -> dict[str, list[tuple[str, list[float]]]]:
        """``a`` against each of ``others``, grouped by verdict in the order they first occur."""
        groups: dict[str, list[tuple[str, list[float]]]] = {}
        for b in others:
            groups.setdefault(verdict(self.comp(a, b)), []).append((b, self.comp(a, b)))
        return groups

    def split(self, a: str, others: Sequence[str]) -> tuple[list[Any], list[Any]]:
        """``a`` against each of ``others`` as (b, interval): (the resolved, the rest)."""
        pairs = [(b, self.comp(a, b)) for b in others]
        return [x for x in pairs if resolved(x[1])], [x for x in pairs if not resolved(x[1])]

    def vs_random(self, policy: str) -> list[list[float]]:
        """``<policy> k - random k`` at every budget."""
        return [self.comp(f"{policy} {k}", f"random {k}") for k in self.budgets]

    def agrees_with(self, other: Sweep) -> bool:
        """Whether every comparison both sweeps made has the same verdict in both."""
        theirs = other.r["comparisons"]
        both = [n for n in self.r["comparisons"] if n in theirs]
        return all(verdict(self.r["comparisons"][n]) == verdict(theirs[n]) for n in both)

    def diverged(self) -> int:
        return sum(r["diverged"] for r in self.summary.values())

    @property
    def gamma_e(self) -> float:
        """GNMR+e's ``gamma`` at NVIDIA's budget."""
        return self.spec(self.e)["controller"]["gamma"]

    def held_share(self, *arms: str) -> str:
        """The span of the share of unit-steps the top 4 units held, over ``arms`` (``94-96%``)."""
        return span([100 * sum(x for _, x in self.picks(a, 4)) for a in arms], ".0f", "%")

    def median_other_half(self, name: str) -> float:
        """The median half-width of the comparisons other than ``name``."""
        return statistics.median(p[1] for n, p in self.r["comparisons"].items() if n != name)

    def branches(self) -> int:
        return len(self.summary) * len(self.seeds) * len(self.points)

    def process_hours(self) -> float:
        """Wall time of the design's branches, summed over the processes that ran them."""
        keys = itertools.product(self.summary, self.seeds, self.points)
        return sum(self.records[k]["wall_s"] for k in keys) / 3600

    def command(self) -> str:
        """The command that ran this design (its budgets; its branch points when not all)."""
        cmd = f"{CLI} --regime {self.regime} --budgets {','.join(map(str, self.budgets))}"
        if self.points != self.inst["points"]:
            cmd += f" --points {','.join(map(str, self.points))}"
        return cmd

    def picks(self, arm: str, top: int | None = None) -> list[tuple[str, float]]:
        return [(u, x) for u, x in self.r["picks"].get(arm, [])][:top]

    def top_units(self, arm: str) -> list[str]:
        """The 4 units ``arm`` recovered most, sorted by name (to compare two arms' sets)."""
        return sorted(u for u, _ in self.picks(arm, 4))

    def kinds(self, arm: str) -> list[str]:
        """The kinds of projection (``k``, ``q``) ``arm`` recovered, most first."""
        return list(dict.fromkeys(u.partition(".")[2] for u, _ in self.picks(arm)))

    def seeds_needed(self, a: str, b: str) -> dict[str, float] | None:
        """How many seeds (``n``) would resolve ``a - b`` if its mean (``m``) and per-seed
        spread (``sd``) held: the least n with ``t95(n-1) sd / sqrt(n) < |m|``."""
        if resolved(self.comp(a, b)):
            return None
        design = Design(tuple(self.seeds), tuple(self.points), self.horizon)
        diffs = per_seed(self.records, design, a, b)
        m, sd = abs(statistics.fmean(diffs)), statistics.stdev(diffs)
        for n in range(2, 1000):
            if (half := t95(n - 1) * sd / math.sqrt(n)) < m:
                return {"n": n, "m": m, "sd": sd, "t": t95(n - 1), "half": half}
        return None

    def early(self) -> dict[str, Any] | None:
        """first+last against all-FP4 at the first branch point, when it lost in half the
        seeds or more: the point, how many seeds it lost, of how many, by up to how much."""
        p = self.points[0]
        first = Design(tuple(self.seeds), (p,), self.horizon)  # a seed's mean of one point: itself
        diffs = per_seed(self.records, first, "first+last", "low-cost")
        lost = [d for d in diffs if d > 0]
        if len(lost) * 2 < len(diffs):
            return None
        return {"point": p, "lost": len(lost), "of": len(diffs), "most": max(lost)}


def label(arm: str) -> str:
    """How the prose names an arm."""
    if arm.startswith("NVIDIA last"):
        return "NVIDIA's last-layers rule"
    if arm.startswith("NVIDIA late"):
        return "NVIDIA's late switch"
    if arm.startswith("random "):
        return f"random-{arm.split()[1]}"
    if arm.startswith("oracle "):
        return "the gradient-gap oracle"
    return {"low-cost": "all-FP4", "first+last": "Megatron's first+last"}.get(arm, arm)


def unit_words(names: Sequence[str]) -> str:
    """``L0.v``, ``L0.o`` as ``layer 0's v and o projections``."""
    layers: dict[str, list[str]] = {}
    for n in names:
        layer, _, proj = n.partition(".")
        layers.setdefault(layer[1:], []).append(proj)
    return listing([f"layer {i}'s {listing(p)} projections" for i, p in layers.items()])


SELECTION_SWEEPS = ("act_quant", "fp6_fp8", "outlier", "delayed")
"""The whole-run selection sweeps whose static-gap intervals measure a whole run's noise."""


def context(src: Source) -> dict[str, Any]:
    """The FP4 section's names: the five sweeps, the whole-run intervals, the step-time file."""
    sw = {key: Sweep(src, name) for key, name in NAMES.items()}
    whole = [src.json(f"sweep_{r}") for r in SELECTION_SWEEPS]
    halves = [w["static_gap"][1] for w in whole]
    nv = sw["nv"]
    bf16_null = nv.noise["null BF16 (1e-6) - BF16"][1]
    step = "sweep_fp4_step_time_nvfp4"
    return {
        "cost_sweeps": [nv, sw["mx_all"], sw["st_all"], sw["st"]],
        "cost_assumptions": cost.assumptions(
            None, nv.horizon, nv.early_eval, nv.inst["trunk_steps"]
        ),
        **sw,
        "sweeps": list(sw.values()),
        "CLI": CLI,
        "whole_halves": halves,
        "whole_steps": [w["setup"]["steps"] for w in whole],
        "whole_to_null": 10 ** round(math.log10(min(halves) / bf16_null)),
        "against_random": [
            (s, k)
            for s in sw.values()
            for k in s.budgets
            if resolved(s.comp(f"GNMR+e {k}", f"random {k}"))
        ],
        "step": src.json(step) if src.has(f"{step}.json") else None,
        "step_name": step,
        "files": [f"{s.name}.json" for s in sw.values()]
        + [f"fp4/{r}.jsonl" for r in ("nvfp4", "mxfp4", "fp4_tensor")],
    }
