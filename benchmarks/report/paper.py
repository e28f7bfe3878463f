"""The paper-experiment section's data (issue 8): the three experiments of :mod:`benchmarks.paper`,
read from ``results/act_quant.json``, ``fp6_fp8.json`` and ``lora_int8.json``, as
``templates/paper.md.j2`` reads them; their tables and target lines are
:mod:`benchmarks.harness.verdicts`'s."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from benchmarks.harness.arms import ArmResult
from benchmarks.harness.verdicts import SEED_EXCEEDANCE, TIME_RATIO, TOLERANCE, table, targets
from benchmarks.report.source import Source

EXPERIMENTS = ("act_quant", "fp6_fp8", "lora_int8")
REFERENCE = {"act_quant": "full", "fp6_fp8": "full", "lora_int8": "recovery"}
"""The policy of the arm each experiment's losses are relative to (as its command prints them)."""


class Experiment:
    """One experiment's JSON file: its set-up, arms and results."""

    def __init__(self, src: Source, name: str, number: int) -> None:
        self.name, self.number = name, number
        self.r: dict[str, Any] = src.json(name)
        self.setup: dict[str, Any] = self.r["setup"]
        self.arms = {a["name"]: a for a in self.r["arms"]}
        self.results = [ArmResult(**r) for r in self.r["results"]]
        self.by = {r.name: r for r in self.results}

    def first(self, policy: str) -> str:
        """The first arm of ``policy``."""
        return next(r.name for r in self.results if r.policy == policy)

    @cached_property
    def gnmr(self) -> str:
        return self.first("gnmr")

    @cached_property
    def reference(self) -> str:
        return self.first(REFERENCE[self.name])

    @cached_property
    def low(self) -> str:
        """The static arm on GNMR's low-cost path."""
        want = self.arms[self.gnmr]["low_cost"]
        return next(
            r.name
            for r in self.results
            if r.policy == "static" and self.arms[r.name]["low_cost"] == want
        )

    def rel(self, arm: str) -> float:
        """Held-out loss over the reference arm's, minus 1."""
        return self.by[arm].heldout_loss / self.by[self.reference].heldout_loss - 1

    def ratio(self, arm: str, to: str | None = None) -> float:
        """Median step time over the static low-cost arm's (or ``to``'s)."""
        return self.by[arm].step_ms / self.by[to or self.low].step_ms

    @property
    def units(self) -> int:
        return self.by[self.gnmr].units

    @property
    def budget(self) -> int:
        return self.by[self.gnmr].max_active

    def tight(self) -> list[str]:
        """GNMR arms with thresholds of their own (``controller`` overrides alpha)."""
        return [n for n, a in self.arms.items() if "alpha" in (a.get("controller") or {})]

    def statics(self) -> list[str]:
        """The arms with one path everywhere (static and recovery)."""
        return [r.name for r in self.results if r.policy in ("static", "recovery")]

    def table(self) -> str:
        """The table the command prints (and its target lines, where it prints them)."""
        text = table(self.results, self.reference, self.low)
        if self.name != "fp6_fp8":
            text += "\n\n" + targets(self.results, self.reference, self.low, self.gnmr)
        return text

    def hurt(self) -> list[str]:
        """The static arms worse than the reference by more than the tolerance."""
        return [n for n in self.statics() if self.rel(n) > TOLERANCE]

    def kept(self) -> list[float]:
        """The recovery rates (%) of the arms that keep many units on the recovery path."""
        return [100 * self.by[n].recovery_rate for n in (*self.tight(), self.first("first_last"))]

    @property
    def gnmr_fast(self) -> bool:
        """Whether GNMR's step time is within the target of the low-cost arm's."""
        return self.ratio(self.gnmr) <= TIME_RATIO

    @property
    def low_use(self) -> bool:
        """Whether GNMR's recovery rate is below half its budget."""
        return self.by[self.gnmr].recovery_rate < self.budget / self.units / 2

    @property
    def low_worse(self) -> bool:
        """Whether the static low-cost arm is worse than the reference by more than the
        tolerance."""
        return self.rel(self.low) > TOLERANCE

    @property
    def within(self) -> bool:
        """Whether GNMR is within the tolerance of the reference."""
        return abs(self.rel(self.gnmr)) <= TOLERANCE


def context(src: Source) -> dict[str, Any]:
    """The paper section's names: the three experiments and the targets of issue 8."""
    ex = [Experiment(src, name, i) for i, name in enumerate(EXPERIMENTS, 1)]
    tight = {n for e in ex for n in e.tight()}
    return {
        "ex": ex,
        "exceedances": [
            100 * r.exceedance_rate for e in ex for r in e.results if r.name not in tight
        ],
        "TIME_RATIO": TIME_RATIO,
        "TOLERANCE": TOLERANCE,
        "SEED_EXCEEDANCE": SEED_EXCEEDANCE,
    }
