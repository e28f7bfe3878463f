"""One FP4 sweep's report (``results/sweep_fp4_*.json``) and the branch records behind it
(``results/fp4/<regime>.jsonl``), as RESULTS.md's FP4 section reads them; how its prose names
the arms."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from benchmarks.harness.branch_stats import GAP, Design
from benchmarks.results_md.source import Source
from benchmarks.results_md.words import listing, resolved

CONTROLS = ("low-cost", "BF16", "null BF16 (1e-6)", "null low-cost (1e-6)", "low-cost (SR seed 1)")
"""The arms that are not precision policies: the two static paths and the null controls."""

NULLS = {  # noise figure -> its name in the bullet
    "null BF16 (1e-6) - BF16": "BF16",
    "null low-cost (1e-6) - low-cost": "low-cost",
    "low-cost (SR seed 1) - low-cost": "SR seed 1",
}

CLI = ".venv/bin/python -m benchmarks.sweep.fp4"


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
        self.summary: dict[str, dict[str, Any]] = self.r["summary"]

    @cached_property
    def records(self) -> dict[tuple[str, int, int], dict[str, Any]]:
        return self.src.records(self.regime)

    @cached_property
    def design(self) -> Design:
        return Design(tuple(self.seeds), tuple(self.points), self.horizon)

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
    def late(self) -> int:
        """The steps of NVIDIA's late switch: the n of ``NVIDIA late-n``."""
        return int(self.arm("NVIDIA late").rpartition("-")[2])

    @cached_property
    def units(self) -> int:
        """Projection units of the model: a branch's unit-steps over its steps."""
        r = self.records[("low-cost", self.seeds[0], self.points[0])]
        return r["unit_steps"] // self.horizon

    def spec(self, arm: str) -> dict[str, Any]:
        """The arm's specification, as its first branch record has it."""
        return self.records[(arm, self.seeds[0], self.points[0])]["arm_spec"]

    @property
    def gap(self) -> list[float]:
        return self.r["noise"][GAP]

    def gap_after(self) -> tuple[int, list[float]] | None:
        """(steps, static gap) at the earlier evaluation of the branches, when there is one."""
        for name, pair in self.r["noise"].items():
            if name.startswith("static gap after"):
                return int(name.split()[3]), pair
        return None

    def closed(self, arm: str) -> list[float]:
        return self.summary[arm]["closed"]

    def share(self, arm: str) -> str:
        """The arm's share of unit-steps on the recovery path, ``14.3``."""
        return f"{100 * self.summary[arm]['unit_steps']:.1f}"

    def spikes(self, arm: str) -> int:
        return self.summary[arm]["spikes"]

    def comp(self, a: str, b: str) -> list[float]:
        return self.r["comparisons"][f"{a} - {b}"]

    def fp4_arms(self, k: int | None = None) -> list[str]:
        """Arms with some unit-steps on FP4 (at budget ``k`` and the controls, when given)."""
        arms = [a for a in self.summary if self.summary[a]["unit_steps"] < 1]
        if k is not None:
            arms = [a for a in arms if not a[-1].isdigit() or a.endswith(f" {k}") or "-" in a]
        return arms

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

    def branches(self) -> int:
        return len(self.summary) * len(self.seeds) * len(self.points)

    def process_hours(self) -> float:
        """Wall time of the design's branches, summed over the processes that ran them."""
        return (
            sum(
                self.records[(a, s, p)]["wall_s"]
                for a in self.summary
                for s in self.seeds
                for p in self.points
            )
            / 3600
        )

    def command(self) -> str:
        """The command that ran this design (its budgets; its branch points when not all)."""
        cmd = f"{CLI} --regime {self.regime} --budgets {','.join(map(str, self.budgets))}"
        if self.points != self.inst["points"]:
            cmd += f" --points {','.join(map(str, self.points))}"
        return cmd

    def picks(self, arm: str, top: int | None = None) -> list[tuple[str, float]]:
        return [(u, x) for u, x in self.r["picks"].get(arm, [])][:top]


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


def sweeps(src: Source) -> dict[str, Sweep]:
    names = {
        "nvfp4": "sweep_fp4_nvfp4",
        "mxfp4": "sweep_fp4_mxfp4_p100-250",
        "mxfp4 all": "sweep_fp4_mxfp4",
        "stress": "sweep_fp4_fp4_tensor_k2-4-7_p100-250",
        "stress all": "sweep_fp4_fp4_tensor",
    }
    return {key: Sweep(src, name) for key, name in names.items()}
