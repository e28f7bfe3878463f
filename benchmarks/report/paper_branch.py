"""The seed's experiments on the branch estimator (issue 35 item 2): each regime of the ``seed``
family (``results/paper/<regime>.jsonl``) on its largest complete design, as the fault regimes
are read (:mod:`.faults`), its noise, its arms, the cost at matched loss
(:mod:`benchmarks.harness.cost`) and a plain verdict beside the seed's own claim
(docs/algorithm.md#paper-experiments). No torch: every figure comes from the records.

**The recovery arm** is the static gap's upper end: the arm whose ``arm_spec`` runs the
``recovery`` policy on every unit and is not a null (``8-bit``, ``FP8``, ``BF16``); its null is
``null <arm> (1e-6)``, and the formats are the records' ``arm_spec``.

**The verdict**, per budget ``k`` on the seed's own policy (``GNMR k``), from 95% intervals over
seeds at the horizon, the first rule that applies:

- *not yet*: one seed (no interval), or ``GNMR k`` is not in the design;
- *not at this scale*: the static gap (low-cost - recovery arm) does not lie above 0: there is
  nothing to recover;
- *the opposite*: ``GNMR k`` - low-cost lies above 0 (recovering makes it worse);
- *reproduced*: GNMR's share of the static gap closed lies above 0.5 and ``GNMR k`` - the
  recovery arm holds 0 or lies below it;
- *partly*: the share lies above 0 (not above 0.5, or GNMR stays above the recovery arm);
- *not reproduced*: the share's interval reaches 0.

The controls' shares (NVIDIA's last-layers rule, random-k, GNMR+e, the gradient-gap oracle) are
given beside it without a verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from benchmarks.harness import cost
from benchmarks.harness.branch_stats import (
    SPIKES_VS,
    Design,
    Records,
    paired,
    share_closed,
    spike_difference,
    troubles,
)
from benchmarks.harness.markdown import markdown_table
from benchmarks.report.error_cost import error_cost
from benchmarks.report.faults import (
    SCHEDULE_END,
    choose_arms,
    pct,
    pm,
    progress,
    reach,
    work,
)
from benchmarks.report.source import Source
from benchmarks.report.words import listing

FAMILY = "paper"
"""The records' folder under ``results/`` (``Regime.family`` of the paper regimes)."""

LOW = "low-cost"
LOW_NULL = "null low-cost (1e-6)"

ORDER = ("random", "GNMR", "GNMR+e", "oracle")
"""The budgeted policies (``<policy> <k>``), in the tables' order within a budget."""

SCHEDULES = {"paper_act_quant": 300, "paper_lora_int8": 200}
"""The trunk's schedule of the seed regimes whose ``Instrument.trunk_steps`` is not the fault
regimes' (:data:`benchmarks.report.faults.SCHEDULE_END`), which bounds the cost model's extra
steps (``tests/benchmarks/test_cost_bounds.py`` checks them against the regimes)."""

CONTROLS = ("NVIDIA last", "random", "GNMR+e", "oracle")
"""The policies whose shares stand beside GNMR's verdict (by name prefix)."""

REPRODUCED = 0.5
"""The share of the static gap GNMR's interval must lie above for *reproduced*."""


@dataclass(frozen=True)
class Claim:
    """One of the seed's experiments: its number, title, section and claim in words."""

    number: int
    title: str
    anchor: str
    text: str


CLAIMS = {
    "paper_act_quant": Claim(
        1,
        "activation-quantization stress",
        "docs/algorithm.md#activation-quantization-stress",
        "static low-bit saved activations fail or end at high perplexity, and GNMR moving a few "
        "units to 8 bits reaches the 8-bit perplexity",
    ),
    "paper_fp6_fp8": Claim(
        2,
        "dynamic FP6 to FP8 pretraining",
        "docs/algorithm.md#dynamic-fp6-to-fp8-pretraining",
        "GNMR tracks the fixed 8-bit loss curve with the low-cost path's cost",
    ),
    "paper_lora_int8": Claim(
        3,
        "LoRA fine-tuning with INT8",
        "docs/algorithm.md#lora-fine-tuning-with-int8",
        "GNMR reaches BF16 quality where INT8 alone does not",
    ),
}
"""The seed's claims (docs/algorithm.md#paper-experiments) by the regime that tests them."""

GENERIC = "GNMR moving a few units to the recovery path reaches the recovery path's loss"
"""The claim of a seed regime not in :data:`CLAIMS`."""


# -- names --------------------------------------------------------------------------------------


def budget(arm: str) -> int | None:
    """``k`` of a budgeted arm (``GNMR+e 4``: 4), else ``None``."""
    head, _, tail = arm.rpartition(" ")
    return int(tail) if head in ORDER and tail.isdigit() else None


def recovery_arm(records: Records) -> str | None:
    """The arm running the recovery path on every unit (not a null), as the records name it."""
    names = {
        a
        for (a, _, _), r in records.items()
        if r.get("arm_spec", {}).get("policy") == "recovery" and not a.startswith("null ")
    }
    return min(names) if names else None


def fixed_order(high: str) -> tuple[str, ...]:
    """The tables' order of the unbudgeted arms (by name prefix)."""
    return (LOW, high, f"null {high} (1e-6)", LOW_NULL, "NVIDIA last")


def rank(arm: str, high: str) -> tuple[int, int, int, str]:
    """The tables' order: the unbudgeted arms, then by budget and policy."""
    k = budget(arm)
    if k is not None:
        return 1, k, ORDER.index(arm.rpartition(" ")[0]), arm
    fixed = fixed_order(high)
    first = [i for i, p in enumerate(fixed) if arm == p or arm.startswith(p)]
    return 0, first[0] if first else len(fixed), 0, arm


# -- the design --------------------------------------------------------------------------------


# -- the verdict -------------------------------------------------------------------------------


def above(pair: Sequence[float], bar: float = 0.0) -> bool:
    """Whether the 95% interval lies above ``bar``."""
    return not math.isnan(pair[1]) and pair[0] - pair[1] > bar


def verdict(records: Records, d: Design, arm: str) -> dict[str, Any]:
    """The verdict on ``arm`` (the seed's ``GNMR k``) over ``d`` (module docstring): ``word``
    and the figures it is read from, ``gap`` (low - high), ``share`` (of the gap closed),
    ``vs_high`` and ``vs_low`` (paired, 95%) and ``work`` (recovered share of the work)."""
    gap = paired(records, d, d.low, d.high)
    out: dict[str, Any] = {"arm": arm, "gap": gap, "share": None, "vs_high": None, "vs_low": None}
    out["work"] = None
    if math.isnan(gap[1]):
        return out | {"word": "not yet"}
    if not all((arm, s, p) in records for s in d.seeds for p in d.points):
        return out | {"word": "not yet"}
    share = share_closed(records, d, arm)
    vs_high, vs_low = paired(records, d, arm, d.high), paired(records, d, arm, d.low)
    out |= {"share": share, "vs_high": vs_high, "vs_low": vs_low, "work": work(records, d, arm)}
    if not above(gap):
        word = "not at this scale"
    elif above(vs_low):
        word = "the opposite"
    elif above(share, REPRODUCED) and not above(vs_high):
        word = "reproduced"
    elif above(share):
        word = "partly"
    else:
        word = "not reproduced"
    return out | {"word": word}


# -- one regime ----------------------------------------------------------------------------------

ARMS_HEADER = ["arm", "recovered work", "held-out - {high}", "held-out - low-cost"]
ARMS_HEADER += ["share of the static gap closed", SPIKES_VS, "diverged"]


def arm_row(records: Records, d: Design, arm: str) -> list[str]:
    """One row of :data:`ARMS_HEADER`: paired figures over ``d``'s seeds (95%)."""
    spikes = None if arm == d.low else spike_difference(records, d, arm)
    return [
        arm,
        pct(work(records, d, arm)),
        pm(paired(records, d, arm, d.high)),
        pm(paired(records, d, arm, d.low)),
        pm(share_closed(records, d, arm), 2),
        pm(spikes, 1),
        str(troubles(records, d, arm)[1]),
    ]


class SeedRegime:
    """One seed regime's records (maybe none yet) and the figures of its part of the section."""

    def __init__(self, src: Source, name: str) -> None:
        self.src, self.name = src, name
        self.records: Records = src.records(name, family=FAMILY)
        self.claim = CLAIMS.get(name)
        self.high = recovery_arm(self.records)
        high = self.high or "BF16"
        self.nulls = {f"null {high} (1e-6)": high, LOW_NULL: LOW}
        self.arms = sorted({a for a, _, _ in self.records}, key=lambda a: rank(a, high))
        self.low = next((r for k, r in self.records.items() if k[0] == LOW), None)
        self.evals = sorted(int(e) for e in self.low["heldout"]) if self.low else []
        self.horizon = self.evals[-1] if self.evals else 0

    @property
    def file(self) -> str:
        return f"{FAMILY}/{self.name}.jsonl"

    @cached_property
    def chosen(self) -> tuple[Design | None, list[str], list[str]]:
        if self.low is None or self.high is None:
            return None, [], list(self.arms)
        return choose_arms(self.records, self.arms, self.horizon, self.high)

    @property
    def design(self) -> Design | None:
        return self.chosen[0]

    @property
    def table_arms(self) -> list[str]:
        return self.chosen[1]

    @property
    def waiting(self) -> list[str]:
        return self.chosen[2]

    def progress(self) -> list[tuple[int, list[str]]]:
        return progress(self.records, self.design, self.table_arms) if self.design else []

    def in_progress(self) -> list[str]:
        """What the design leaves out, in words (nothing: every arm has every branch): the arms
        short of all seeds at its points, the points left out, the arms waiting."""
        seeds, d = len(self.all_seeds()), self.design
        out = [
            f"{listing(arms)} {'has' if len(arms) == 1 else 'have'} {n} of {seeds} seeds at "
            "these points"
            for n, arms in self.progress()
        ]
        left = [p for p in self.all_points() if p not in d.points]
        if left:
            out.append(
                f"branch point{'s' if len(left) > 1 else ''} {listing(left)} "
                f"{'are' if len(left) > 1 else 'is'} left out (not every arm has "
                f"{'them' if len(left) > 1 else 'it'} on these seeds)"
            )
        if self.waiting:
            out.append(f"waiting, with too few seeds for an interval: {listing(self.waiting)}")
        return out

    def all_seeds(self) -> list[int]:
        return list(dict.fromkeys(s for _, s, _ in self.records))

    def all_points(self) -> list[int]:
        return sorted({p for _, _, p in self.records})

    def spec(self) -> dict[str, Any]:
        return self.low["arm_spec"]

    def options(self, path: str) -> str:
        """A path's options (``low_cost``, ``recovery``) as JSON, as the records state them."""
        return json.dumps(self.spec()[path], sort_keys=True)

    # -- noise

    def noise(self) -> dict[str, dict[int, tuple[float, float]]]:
        """Per figure (the static gap, each null in the design) per evaluation step: the paired
        mean and 95% half-width over seeds."""
        d = self.design
        pairs = [(LOW, d.high)] + [(n, r) for n, r in self.nulls.items() if n in self.table_arms]
        return {
            f"{a} - {b}": {e: paired(self.records, replace(d, horizon=e), a, b) for e in self.evals}
            for a, b in pairs
        }

    def noise_table(self) -> str:
        """The static gap and each null at every evaluation, with the nulls' ``|null| / gap``
        (``|mean| + half-width`` over the gap's mean at the same step)."""
        noise = self.noise()
        gap = noise[f"{LOW} - {self.design.high}"]
        header = ["figure"]
        for e in self.evals:
            header += [f"after {e} steps", f"\\|null\\| / gap, {e}"]
        rows = []
        for name, by in noise.items():
            cells = [f"static gap ({name})" if by is gap else name]
            for e in self.evals:
                ratio = (
                    "-" if by is gap or gap[e][0] == 0 else f"{reach(by[e]) / abs(gap[e][0]):.2f}"
                )
                cells += [pm(by[e]), ratio]
            rows.append(cells)
        return markdown_table(header, rows)

    def gap(self) -> tuple[float, float]:
        """The static gap (low-cost - the recovery arm) at the horizon."""
        return paired(self.records, self.design, LOW, self.design.high)

    def null_pairs(self) -> list[tuple[str, tuple[float, float], float]]:
        """(null, its interval at the horizon, ``|null| / gap``) of the nulls in the design."""
        gap = abs(self.gap()[0])
        out = []
        for n, ref in self.nulls.items():
            if n in self.table_arms:
                pair = paired(self.records, self.design, n, ref)
                out.append((n, pair, reach(pair) / gap if gap else math.nan))
        return out

    # -- arms and verdicts

    def arms_table(self) -> str:
        header = [h.format(high=self.design.high) for h in ARMS_HEADER]
        return markdown_table(
            header, [arm_row(self.records, self.design, a) for a in self.table_arms]
        )

    def budgets(self) -> list[int]:
        """The budgets of the seed's GNMR arms recorded (in the design or waiting)."""
        return sorted({k for a in self.arms if a.startswith("GNMR ") and (k := budget(a))})

    def verdicts(self) -> list[dict[str, Any]]:
        """Per budget: :func:`verdict` on ``GNMR k``, with ``controls``: (arm, share closed) of
        each control in the design (:data:`CONTROLS`: NVIDIA's rule at its own budget)."""
        out = []
        for k in self.budgets():
            arm = f"GNMR {k}"
            if arm in self.table_arms:
                v = verdict(self.records, self.design, arm)
            else:
                v = {"arm": arm, "word": "not yet", "gap": self.gap(), "share": None}
            controls = [
                a
                for a in self.table_arms
                if a.startswith(CONTROLS[0]) or a in [f"{p} {k}" for p in CONTROLS[1:]]
            ]
            v["controls"] = [(a, share_closed(self.records, self.design, a)) for a in controls]
            v["k"] = k
            out.append(v)
        return out

    # -- cost

    def formats(self) -> cost.Formats:
        s = self.spec()
        return cost.Formats(s["backend"], s["low_cost"], s["recovery"])

    def unpriced(self) -> str | None:
        """Why no hardware prices the formats (``not priced: ...``), else ``None``."""
        notes = [cost.price(self.formats(), hw).note for hw in cost.HARDWARE]
        if all(n is not None and n.startswith("not priced") for n in notes):
            return notes[0]
        return None

    def cost_table(self) -> str:
        """:func:`benchmarks.harness.cost.cost_table` on the design's arms against the recovery
        arm (the speed-up columns left out when the formats are not priced)."""
        d = self.design
        summary = cost.summarize_costs(
            self.records,
            d,
            self.formats(),
            arms=self.table_arms,
            schedule=SCHEDULES.get(self.name, SCHEDULE_END),
            error=error_cost(self.src, self.formats().backend),
        )
        hardware = () if self.unpriced() else cost.HARDWARE
        table = cost.cost_table(summary, hardware, horizon=self.horizon)
        head, _, body = table.partition("\n")
        return f"{head.replace('BF16', d.high)}\n{body}"

    def priced(self) -> str:
        """The formats priced and at what rates (the cost model's last assumption line), and the
        error term's cost ``C`` with its source."""
        early = max([e for e in self.evals if e < self.horizon], default=self.horizon)
        line = cost.assumptions(self.formats(), self.horizon, early)[-1]
        e = error_cost(self.src, self.formats().backend)
        c = "not known" if e is None else f"{100 * e.share:.1f}% ({e.source})"
        return f"{line[0].lower()}{line[1:].removesuffix('.')}; the error term's C = {c}"


def regimes(src: Source) -> list[SeedRegime]:
    """The seed's experiments in the order of their claims, then any other seed regime with
    records; a claimed regime without a file is there, with no records."""
    last = len(CLAIMS) + 1
    names = sorted(
        {*CLAIMS, *src.regimes(FAMILY)},
        key=lambda n: (CLAIMS[n].number if n in CLAIMS else last, n),
    )
    return [SeedRegime(src, n) for n in names]


def context(src: Source) -> dict[str, Any]:
    """The section's names: every seed regime (claimed or with records) and the bars."""
    return {
        "paper_branch": regimes(src),
        "seed_generic_claim": GENERIC,
        "seed_reproduced": REPRODUCED,
        "fpm": pm,
    }
