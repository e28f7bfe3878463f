"""The top of RESULTS.md (``templates/summary.md.j2``): when to turn GNMR on. A fault regime swept
on :data:`SWEPT` seeds either passes the noise bar (:attr:`.branches.BranchRegime.bar`) and gets a
row per budget with a reading (:func:`advice`) and a column of what it rests on (:func:`rests_on`),
or its gap is not resolved (nothing to recover), or its nulls fail the bar. Issue 44's ablation
and stage-5 regimes are named apart; the seed experiments give their words (:mod:`.paper_branch`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import cost, designs, fault_figures, preregistered
from benchmarks.harness.branch_stats import share_closed
from benchmarks.report.branches import SCHEDULE_END
from benchmarks.report.faults import FAMILY, FaultRegime
from benchmarks.report.faults import context as fault_context
from benchmarks.report.paper_branch import regimes as seed_regimes
from benchmarks.report.source import Source
from benchmarks.report.words import pct, percent

__all__ = ["context"]

SWEPT = 5
"""Seeds from which a fault regime counts as swept rather than piloted: an unresolved gap then
says the format absorbed the fault, not that two seeds could not tell."""
PILOT = "pilot1"
"""The folder of the first pilot's records (a smaller outlier) under ``results/faults/``."""


def reading(r: FaultRegime, arm: str, verdicts: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """``pays`` (a pre-registered "better" against random selection or NVIDIA's fixed rule), ``no
    help`` (its share of the gap closed not above 0, 95%), ``worse`` (a fixed rule better) or
    ``open``; and the other arms whose 95% share overlaps ``arm``'s (the same loss, each at its
    own cost; not the low-cost path nor the arms on the recovery path everywhere, which close the
    whole gap by construction at full cost)."""
    m, h = share_closed(r.records, r.design, arm)  # type: ignore[arg-type]
    level = []
    for other in (a for a in r.table_arms if a not in (arm, "low-cost")):
        m2, h2 = share_closed(r.records, r.design, other)  # type: ignore[arg-type]
        if not other.startswith(("BF16", "null ")) and m2 + h2 >= m - h and m2 - h2 <= m + h:
            level.append(other)
    rivals = [v["verdict"] for v in verdicts if v["rival"].startswith(("random ", "NVIDIA last-"))]
    kind = "pays" if "better" in rivals else "worse" if "worse" in rivals else "open"
    return ("no help" if not m - h > 0 else kind), level


def advice(r: FaultRegime) -> list[tuple[list[str], str, dict[str, Any] | None]]:
    """Per budget ``k`` with ``GNMR+e k`` in the design of a regime that passes the bar: the
    top table's row, its :func:`reading` and the regime's :func:`rests_on`."""
    d, measured, rows = r.design, [p for p in r.preregistered if not p["why"]], []
    assert d is not None  # a regime that passes its bar has a design
    for arm, k in ((f"GNMR+e {k}", k) for k in r.budgets() if f"GNMR+e {k}" in r.table_arms):
        verdicts = [p for p in measured if p["arm"] in (arm, f"GNMR+e v2 {k}")]
        kind, level = reading(r, arm, [v for v in verdicts if v["arm"] == arm])
        seeds = f"{len(d.seeds)} (up to {max([len(d.seeds), *(p['seeds'] for p in measured)])})"
        texts = [f"{v['arm']} vs {v['rival']}: {v['text']} ({v['seeds']})" for v in verdicts]
        row = [f"`{r.name}`", seeds, r.bar["gap"], pct(share_closed(r.records, d, arm))]
        row += [percent(designs.work(r.records, d, arm)), "; ".join(texts)]
        row += [" / ".join(cost.speed_cell(r.costs[a], "B200") for a in (arm, "low-cost"))]
        rows.append(([*row, ", ".join(level) or "-"], kind, rests_on(r, k)))
    return rows


def rests_on(r: FaultRegime, k: int) -> dict[str, Any] | None:
    """:func:`benchmarks.harness.fault_figures.rests_on` for ``GNMR+e k`` against random
    selection and NVIDIA's rule, with the outlier's ``peak``, the first pilot's static gap
    (:func:`benchmarks.harness.designs.static_gap`) and the fault's window; ``None``: no outlier.
    The old cost model is priced at B200's rates, bounded by the trunk's schedule."""
    d, rivals = r.design, [a for a in (f"random {k}", f"NVIDIA last-{k}") if a in r.table_arms]
    if d is None or r.outlier is None or not rivals:
        return None
    n, stop, o = len(preregistered.comparisons(k)), preregistered.STOPPING.get(r.name), r.outlier
    p, end = cost.price(r.formats, "B200"), SCHEDULE_END
    out = fault_figures.rests_on(r.records, d, r.seeds, f"GNMR+e {k}", rivals, n, stop, p, end)
    pilot = designs.static_gap(designs.one_host(r.src.records(r.name, f"{FAMILY}/{PILOT}"))[0])
    window = (o["offset"], o["offset"] + o["rise"] + o["hold"] - 1)
    return out | {"name": r.name, "peak": o["peak"], "window": window, "stop": stop, "pilot": pilot}


def context(src: Source) -> dict[str, Any]:
    """``advice``: the top table of the swept regimes that pass the bar; ``quiet``: those whose
    gap is not resolved; ``noisy``: the rest; ``pilots``: the regimes not swept; ``rests``: what
    they rest on, ``chosen``: when each outlier was chosen; ``apart``: issue 44's ablation and
    stage-5 regimes with their seeds of those planned, ``not_run``: those without records."""
    faults = fault_context(src)
    every: list[FaultRegime] = faults["fault_regimes"]
    names = {*preregistered.ABLATION_REGIMES, *preregistered.STAGE5_FAMILIES}
    regimes = [r for r in every if r.name not in names]
    swept = [r for r in regimes if r.design is not None and len(r.design.seeds) >= SWEPT]
    rows = [row for r in swept if r.bar["passes"] for row in advice(r)]
    rests = [c for _, _, c in rows if c]
    chosen: dict[str, list[str]] = {}
    for name in dict.fromkeys(c["name"] for c in rests):
        stop = preregistered.STOPPING.get(name)
        if stop is not None and stop.chosen:
            chosen.setdefault(stop.chosen, []).append(name)
    apart = [(r, preregistered.STOPPING[r.name].planned) for r in every if r.name in names]
    return {
        "advice": rows,
        "quiet": [r.name for r in swept if not r.bar["resolved"]],
        "noisy": [r.name for r in swept if r.bar["resolved"] and not r.bar["passes"]],
        "pilots": [r.name for r in regimes if r not in swept],
        "rests": rests,
        "chosen": chosen,
        "apart": [(r.name, f"{len(r.design.seeds)} of {len(p)}") for r, p in apart if r.design],
        "not_run": [n for n in preregistered.STAGE5_FAMILIES if n not in {r.name for r in every}],
        "seed_words": [(s, s.verdicts()) for s in seed_regimes(src) if s.records and s.design],
        "prereg_level": faults["prereg_level"],
    }
