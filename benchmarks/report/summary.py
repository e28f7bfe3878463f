"""The top of RESULTS.md (``templates/summary.md.j2``): when to turn GNMR on. A fault regime swept
on :data:`SWEPT` seeds either passes its noise bar and gets a row per budget (:func:`advice`) with
what it rests on (:func:`rests_on`), or its gap is not resolved, or its nulls fail the bar. Issue
44's ablation and stage-5 regimes are named apart; the seed experiments give their words."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import cost, designs, fault_figures, preregistered
from benchmarks.report.branches import SCHEDULE_END
from benchmarks.report.faults import FAMILY, LEVEL, FaultRegime, regimes
from benchmarks.report.paper_branch import regimes as seed_regimes
from benchmarks.report.source import Source
from benchmarks.report.words import pct, percent

__all__ = ["context"]

SWEPT = 5  # from 5 seeds an unresolved gap says the format absorbed the fault, not too few seeds
PILOT = "pilot1"  # the first pilot's records (a smaller outlier) under results/faults/


def advice(r: FaultRegime) -> list[dict[str, Any]]:
    """Per budget ``k`` with ``GNMR+e k`` in the design of a regime that passes the bar: its
    share of the gap closed, work, verdicts and those of ``GNMR+e v2 k`` (``most``: the most seeds
    any verdict pairs), :func:`.fault_figures.reading`, the speed-ups and :func:`rests_on`."""
    d, measured = r.design, [p for p in r.preregistered if not p["why"]]
    assert d is not None  # a regime that passes its bar has a design
    most, rows = max([len(d.seeds), *(p["seeds"] for p in measured)]), []
    for arm, k in ((f"GNMR+e {k}", k) for k in r.budgets() if f"GNMR+e {k}" in r.table_arms):
        verdicts = [p for p in measured if p["arm"] in (arm, f"GNMR+e v2 {k}")]
        mine = [v for v in verdicts if v["arm"] == arm]
        kind, share, level = fault_figures.reading(r.records, d, arm, r.table_arms, mine)
        speed = [cost.speed_cell(r.costs[a], "B200") for a in (arm, "low-cost")]
        work = percent(designs.work(r.records, d, arm))
        rows.append({"r": r, "most": most, "share": pct(share), "work": work, "kind": kind})
        rows[-1] |= {"verdicts": verdicts, "speed": speed, "level": level, "rests": rests_on(r, k)}
    return rows


def rests_on(r: FaultRegime, k: int) -> dict[str, Any] | None:
    """:func:`.fault_figures.rests_on` for ``GNMR+e k`` against random and NVIDIA's rule (B200's
    rates), with ``r``, its ``stop``ping rule and the first pilot's static gap; ``None``: none."""
    d, rivals = r.design, [a for a in (f"random {k}", f"NVIDIA last-{k}") if a in r.table_arms]
    if d is None or r.outlier is None or not rivals:
        return None
    n, stop = len(preregistered.comparisons(k)), preregistered.STOPPING.get(r.name)
    price = cost.price(r.formats, "B200")
    args = r.records, d, r.seeds, f"GNMR+e {k}", rivals, n, stop, price, SCHEDULE_END
    pilot = designs.static_gap(designs.one_host(r.src.records(r.name, f"{FAMILY}/{PILOT}"))[0])
    return fault_figures.rests_on(*args) | {"r": r, "stop": stop, "pilot": pilot}


def context(src: Source) -> dict[str, Any]:
    """``advice``: the rows of the swept regimes that pass the bar; ``quiet``, ``noisy``: those
    whose gap is not resolved, whose nulls fail; ``pilots``: not swept; ``rests``, ``chosen``:
    what the rows rest on, when each outlier was chosen; ``apart``: issue 44's ablation and stage
    5, each (name, seeds of those planned, measured verdicts); ``not_run``: those not run."""
    every = regimes(src)
    names = {*preregistered.ABLATION_REGIMES, *preregistered.STAGE5_FAMILIES}
    swept = [r for r in every if r.name not in names and r.design and len(r.design.seeds) >= SWEPT]
    rows = [row for r in swept if r.bar["passes"] for row in advice(r)]
    rests = [row["rests"] for row in rows if row["rests"]]
    chosen: dict[str, list[str]] = {}
    for c in {c["r"].name: c for c in rests if c["stop"] and c["stop"].chosen}.values():
        chosen.setdefault(c["stop"].chosen, []).append(c["r"].name)
    apart: dict[str, list[tuple[str, str, list[Any]]]] = {"ablation": [], "stage5": []}
    for r in (r for r in every if r.name in names and r.design):
        seeds = f"{len(r.design.seeds)} of {len(preregistered.STOPPING[r.name].planned)}"
        kind = "stage5" if r.name in preregistered.STAGE5_FAMILIES else "ablation"
        apart[kind].append((r.name, seeds, [p for p in r.preregistered if not p["why"]]))
    return {
        "advice": rows,
        "quiet": [r.name for r in swept if not r.bar["resolved"]],
        "noisy": [r.name for r in swept if r.bar["resolved"] and not r.bar["passes"]],
        "pilots": [r.name for r in every if r.name not in names and r not in swept],
        "rests": rests,
        "chosen": chosen,
        "apart": apart,
        "not_run": [n for n in preregistered.STAGE5_FAMILIES if n not in {r.name for r in every}],
        "seed_words": [(s, s.verdicts()) for s in seed_regimes(src) if s.records and s.design],
        "prereg_level": LEVEL,
    }
