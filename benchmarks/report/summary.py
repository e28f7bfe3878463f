"""The paragraph at the top of RESULTS.md: when to turn GNMR on, with which budget, and what it
buys there, read from the same figures as the sections below.

Regimes fall into three kinds, each told apart by its own figures: a **fault regime that passes
the noise bar** (:meth:`.faults.FaultRegime.bar`: a resolved static gap, quiet nulls), where the
paragraph gives GNMR+e's share of the gap closed, its recovered work and its four
pre-registered verdicts; a **fault regime whose gap is not resolved**, where there is nothing to
recover; and the **seed experiments**, with their verdict words (:mod:`.paper_branch`). The FP4
section's own summary covers uniform damage.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import preregistered
from benchmarks.harness.branch_stats import share_closed
from benchmarks.report.ablation import ablation
from benchmarks.report.faults import FaultRegime, work
from benchmarks.report.faults import context as fault_context
from benchmarks.report.paper_branch import regimes as seed_regimes
from benchmarks.report.rests_on import rests_on
from benchmarks.report.rests_on import table as rests_table
from benchmarks.report.source import Source

__all__ = ["context"]


def local(r: FaultRegime) -> dict[str, Any] | None:
    """What the paragraph says of a fault regime that passes the bar: per budget ``k`` with
    GNMR+e in its design, the share of the gap GNMR+e closes and its work, and the verdicts."""
    d = r.design
    if d is None or not r.bar()["passes"]:
        return None
    measured = [p for p in r.preregistered() if not p["missing"]]
    rows = []
    for k in r.budgets():
        arm = f"GNMR+e {k}"
        if arm not in r.table_arms:
            continue
        family = {arm, f"GNMR+e v2 {k}"}
        verdicts = [p for p in measured if p["c"].arm in family]
        share = share_closed(r.records, d, arm)
        rows.append(
            {
                "k": k,
                "share": share,
                "work": work(r.records, d, arm),
                "verdicts": verdicts,
                "kind": kind(share, verdicts, arm),
                "level": level_with(r, arm, share),
                "work_pct": f"{100 * work(r.records, d, arm):.1f}%",
                **speedups(r, arm),
                "rests": rests_on(r, k),
            }
        )
    seeds = len(d.seeds)
    pair_seeds = max([seeds, *(p["seeds"] for p in measured)])
    out = {"regime": r, "seeds": seeds, "pair_seeds": pair_seeds}
    return out | {"budgets": rows} if rows else None


HIGH = ("BF16", "null ")
"""Arms that run the recovery path everywhere (the static gap's upper end and its null): they
close the whole gap by construction, at full cost."""


def level_with(r: FaultRegime, arm: str, share: tuple[float, float]) -> list[str]:
    """The other table arms that close as much of the static gap as ``arm`` (95% intervals of
    the share that overlap), the recovery path everywhere left out: what a user could run
    instead for the same loss, each at its own cost (the cost table)."""
    lo, hi = share[0] - share[1], share[0] + share[1]
    out = []
    for other in r.table_arms:
        if other in (arm, "low-cost") or other.startswith(HIGH):
            continue
        m, h = share_closed(r.records, r.design, other)
        if m + h >= lo and m - h <= hi:
            out.append(other)
    return out


def speedups(r: FaultRegime, arm: str, hardware: str = "B200") -> dict[str, str]:
    """``arm``'s and the low-cost path's speed-up over BF16 at matched loss on ``hardware``
    (:attr:`FaultRegime.costs`), or the note saying why there is none."""
    out = {}
    for key, a in (("speed_arm", arm), ("speed_low", "low-cost")):
        c = r.costs[a]["hardware"][hardware]
        out[key] = f"{c['speedup'][0]:.2f} +- {c['speedup'][1]:.2f}" if c["speedup"] else c["note"]
    return out


SWEPT = 5
"""Seeds from which a fault regime counts as swept rather than piloted: an unresolved gap then
says the format absorbed the fault, not that two seeds could not tell."""


def kind(share: tuple[float, float], verdicts: list[dict[str, Any]], arm: str) -> str:
    """``"pays"``: GNMR+e beats random selection or NVIDIA's fixed rule (a pre-registered
    "better"); ``"no help"``: its share of the gap closed is not above 0 (95%); ``"worse"``: a
    fixed rule beats it; ``"open"``: it closes part of the gap, but its margin over those rules
    is not resolved (more seeds may tell)."""
    mean, half = share
    if not mean - half > 0:
        return "no help"
    fixed = ("random ", "NVIDIA last-")
    rivals = [v for v in verdicts if v["c"].arm == arm and v["c"].rival.startswith(fixed)]
    if any(v["verdict"] == "better" for v in rivals):
        return "pays"
    return "worse" if any(v["verdict"] == "worse" for v in rivals) else "open"


def context(src: Source) -> dict[str, Any]:
    """Of the fault regimes swept on :data:`SWEPT` seeds or more: ``advice``, those that pass
    the bar (:func:`local`, each budget with its :func:`kind`), ``quiet``, those whose static
    gap is not resolved, and ``noisy``, the rest (a gap, but nulls above the bar); ``pilots``:
    the others; ``seed_words``: (regime, verdicts) of the seed experiments; ``ablation``: issue
    44's ablation regimes (:mod:`.ablation`), kept out of the others; ``stage5``: (name,
    its measured pre-registered comparisons, ``None`` when it has no records yet) of each of
    issue 44's stage-5 regimes, also kept out (the wgrad rows have no fault to advise on)."""
    faults = fault_context(src)
    every: list[FaultRegime] = faults["faults"]
    apart = {*preregistered.ABLATION_REGIMES, *preregistered.STAGE5_FAMILIES}
    regimes = [r for r in every if r.name not in apart]  # each has its own words
    have = {r.name: r for r in every}
    swept = [r for r in regimes if r.design is not None and len(r.design.seeds) >= SWEPT]
    advice = [a for a in (local(r) for r in swept) if a is not None]
    quiet = [r for r in swept if not r.bar()["resolved"]]
    told = {a["regime"].name for a in advice} | {r.name for r in quiet}
    noisy = [r for r in swept if r.name not in told]  # a resolved gap, nulls above the bar
    pilots = [r for r in regimes if r not in swept]
    seeds = [(s, s.verdicts()) for s in seed_regimes(src) if s.records and s.design]
    names = {"advice": advice, "quiet": quiet, "noisy": noisy, "pilots": pilots}
    shared = {k: faults[k] for k in ("fpm", "prereg_level")}  # what rests_on.md.j2 reads
    stage5 = [(n, have.get(n)) for n in preregistered.STAGE5_FAMILIES]
    measured = [(n, r and [p for p in r.preregistered() if "mean" in p]) for n, r in stage5]
    names |= {"stage5": measured}
    rests = [(a["regime"].name, b["rests"]) for a in advice for b in a["budgets"] if b["rests"]]
    chosen: dict[str, list[str]] = {}
    for name, _ in rests:
        stop = preregistered.STOPPING.get(name)
        if stop is not None and stop.chosen:
            chosen.setdefault(stop.chosen, []).append(name)
    names |= {"rests": rests_table(rests) if rests else "", "chosen": chosen}
    return names | {"seed_words": seeds, "ablation": ablation(every)} | shared
