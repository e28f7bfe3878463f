"""The fault regimes' figures beyond the arms table (RESULTS.md's fault section and what its
verdicts rest on), from branch records by (arm, seed, point); RESULTS.md words them. No torch.

- :func:`verdict`: a pre-registered comparison; :func:`reading`: what RESULTS.md's top reads;
- :func:`late`: where NVIDIA's time rules act (they switch to the recovery path late in the
  schedule, so only the branches that end it see them act) and how GNMR+e fares against them
  there;
- :func:`oracle`: the loss oracle on the grid it ran on (a subset of the design's);
- :func:`covered`: the seeds whose fault (:func:`struck`) struck a unit GNMR+e keeps on the
  recovery path whatever the fault does (:func:`benchmarks.harness.designs.standing`), which it
  covers without detecting it, and their share of the gap;
- :func:`looks`: a comparison at the seeds planned (the first look of the stopping rule,
  :data:`benchmarks.harness.preregistered.STOPPING`) and at the end, with the sign count's p
  Bonferroni-adjusted over the family and the looks (the sign count does not rest on the
  intervals' nominal level, which seeds added after a look void);
- :func:`rests_on`: what a regime's verdicts rest on, these and the static gap after each
  evaluation.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import Design, Records, paired, per_seed, share_closed
from benchmarks.harness.designs import (
    MIN_SEEDS,
    comparison,
    complete_seeds,
    largest_design,
    old_cost,
    pair_design,
    singles,
    standing,
    unit_name,
    unit_of,
    unit_work,
    work,
)

LATE = ("NVIDIA late", "late fwd")
"""Name prefixes of the time rules."""
FIXED = ("random ", "NVIDIA last-")
"""Name prefixes of the fixed rules GNMR+e must beat to pay for itself."""


def verdict(
    records: Records, d: Design, seeds: Sequence[int], arm: str, rival: str, family: int, ties: bool
) -> dict[str, Any]:
    """:func:`benchmarks.harness.designs.comparison` of ``arm - rival`` at the family's level over
    :func:`benchmarks.harness.designs.pair_design` of ``seeds``; with ``ties``, a tie is read
    against the static gap on the same seeds."""
    d = pair_design(records, d, seeds, arm, rival)
    # the tie's scale is the gap of the seeds compared, not the design's
    gap = paired(records, d, "low-cost", "BF16")[0] if ties else None
    return comparison(records, d, arm, rival, family, gap)


def reading(
    records: Records, d: Design, arm: str, arms: Sequence[str], verdicts: Sequence[dict[str, Any]]
) -> tuple[str, tuple[float, float], list[str]]:
    """``pays`` (a "better" against a :data:`FIXED` rule), ``worse`` (a fixed rule better), ``open``
    or ``no help`` (``arm``'s share of the gap closed not above 0, 95%); that share; the other
    ``arms`` whose 95% share overlaps it, each at its own cost (not those that close none or all
    of the gap by construction: the low-cost path, the nulls, the recovery path everywhere)."""
    m, h = share = share_closed(records, d, arm)
    others = [a for a in arms if a not in (arm, "low-cost") and not a.startswith(("BF16", "null "))]
    shares = {a: share_closed(records, d, a) for a in others}
    # two intervals overlap where each one's upper end reaches the other's lower end
    level = [a for a, (m2, h2) in shares.items() if m2 + h2 >= m - h and m2 - h2 <= m + h]
    fixed = [v["verdict"] for v in verdicts if v["rival"].startswith(FIXED)]
    kind = "pays" if "better" in fixed else "worse" if "worse" in fixed else "open"
    return ("no help" if not m - h > 0 else kind), share, level


def work_by_point(records: Records, arm: str) -> dict[int, float]:
    """``arm``'s mean share of the linear work on the recovery path per branch point."""
    by: dict[int, list[float]] = {}
    for (a, _, p), r in records.items():
        if a == arm:
            by.setdefault(p, []).append(cost.flops_share(r)[0])
    return {p: statistics.fmean(v) for p, v in sorted(by.items())}


def late(
    records: Records, arms: Sequence[str], ours: Sequence[str], schedule: int, horizon: int
) -> dict[str, Any] | None:
    """Where the time rules among ``arms`` act (``acts``: per rule the points where it runs the
    low-cost path throughout, ``idle``, and its mean work where it acts, ``busy``) and, at the
    ``point`` whose branches end the ``schedule``, on the ``seeds`` with every one of ``arms``
    there, ``pairs``: (arm, rule, ``arm - rule`` (95%)) for each of ``ours`` in ``arms``; ``None``
    without a time rule."""
    rules = [a for a in arms if a.startswith(LATE)]
    if not rules:
        return None
    point = schedule - horizon
    seeds = complete_seeds(records, arms, list(dict.fromkeys(s for _, s, _ in records)), [point])
    d = Design(tuple(seeds), (point,), horizon)
    # an interval needs two seeds: with fewer the pairs are left out, not given as (one seed)
    ours = [e for e in ours if e in arms] if len(seeds) >= MIN_SEEDS else []
    acts = []
    for a in rules:
        by = work_by_point(records, a)
        acts.append({"arm": a, "idle": [p for p, w in by.items() if w == 0]})
        acts[-1]["busy"] = [(p, w) for p, w in by.items() if w > 0]
    pairs = [(e, a, paired(records, d, e, a)) for e in ours for a in rules]
    return {"point": point, "seeds": len(seeds), "acts": acts, "pairs": pairs}


def oracle(records: Records, horizon: int, rank: Callable[[str], Any]) -> dict[str, Any] | None:
    """The loss oracles (``loss oracle k``, in ``rank``'s order) on the largest grid with each of
    them and both static arms (``design``, two seeds or more): ``shares``, per oracle (name, share
    of the gap closed (95%), work); ``pairs``, (arm, oracle, ``arm - oracle`` (95%)) for the arms
    at its budget recorded on that whole grid; ``singles``,
    :func:`benchmarks.harness.designs.singles`."""
    oracles = sorted({a for a, _, _ in records if a.startswith("loss oracle ")}, key=rank)
    d = largest_design(records, [*oracles, "low-cost", "BF16"], horizon) if oracles else None
    if d is None or len(d.seeds) < MIN_SEEDS:
        return None  # an oracle on one seed waits: its intervals need two
    pairs = []
    for o in oracles:
        k = o.rpartition(" ")[2]
        for a in (f"GNMR+e {k}", f"GNMR+e v2 {k}", f"oracle {k}", f"random {k}"):
            # the oracle ran on part of the grid: an arm is paired only where it has all of it
            if complete_seeds(records, [a], d.seeds, d.points) == list(d.seeds):
                pairs.append((a, o, paired(records, d, a, o)))
    shares = [(o, share_closed(records, d, o), work(records, d, o)) for o in oracles]
    return {"design": d, "shares": shares, "pairs": pairs, "singles": singles(records, d)}


def struck(records: Records, d: Design) -> list[tuple[int, int, int | None]]:
    """Per seed of ``d``: (seed, the unit its fault struck, the input channel or ``None`` for
    the whole input), as the low-cost record's fault plan states it."""
    # the fault is drawn per seed: every branch point of a seed strikes the same unit
    lows = [(s, records[("low-cost", s, d.points[0])]["outliers"][0]) for s in d.seeds]
    return [(s, unit_of(o["module"]), o.get("channel")) for s, o in lows]


def covered(records: Records, d: Design, units: set[int]) -> tuple[list[int], float]:
    """The seeds of ``d`` whose fault struck one of ``units`` and their share of the summed
    static gap (low-cost - BF16, each seed's mean over ``d``'s points)."""
    gaps = dict(zip(d.seeds, per_seed(records, d, "low-cost", "BF16"), strict=True))
    hit = [s for s, u, _ in struck(records, d) if u in units]
    return hit, sum(gaps[s] for s in hit) / sum(gaps.values())


def looks(
    records: Records, d: Design, arm: str, rival: str, stop: preregistered.Stopping, family: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``arm - rival`` (:func:`benchmarks.harness.designs.comparison` at the family's level) at
    the first look, on the planned seeds of ``d`` (``None`` where no seed was added or fewer
    than two were planned), and at the end on all of ``d``'s, its ``adjusted`` sign-test p
    (times the family and the looks, at most 1: the sign count does not rest on the intervals'
    level)."""
    planned = tuple(s for s in stop.planned if s in d.seeds)
    first = None
    if len(planned) >= MIN_SEEDS and stop.added:
        first = comparison(records, replace(d, seeds=planned), arm, rival, family)
    end = comparison(records, d, arm, rival, family)
    # Bonferroni over the family and the looks; a probability, so at most 1
    return first, end | {"adjusted": min(1.0, end["p"] * family * len(stop.looks))}


def rests_on(
    records: Records,
    d: Design,
    seeds: Sequence[int],
    arm: str,
    rivals: Sequence[str],
    family: int,
    stop: preregistered.Stopping | None,
    price: cost.Price,
    schedule: int,
) -> dict[str, Any]:
    """What the verdicts on ``arm`` against ``rivals`` (the first: random selection; each over
    :func:`benchmarks.harness.designs.pair_design` of ``seeds``) rest on: ``standing``, (unit
    name, mean steps on the recovery path) of the standing units; ``hit``, ``seeds`` and ``share``
    of :func:`covered`; ``margins``, (rival, comparison) on the seeds not hit; ``work`` and
    ``parts`` (:func:`benchmarks.harness.designs.unit_work`); ``gaps``, (evaluation step, the
    static gap there) and whether it ``grows`` after the first; ``looks``, (rival, :func:`looks`)
    under ``stop``; ``old``, the old cost model on the low-cost path at ``price``
    (:func:`benchmarks.harness.designs.old_cost`; ``past``: its largest extra steps run past the
    end of the trunk's ``schedule``), ``None`` where the price has a note."""
    keep = standing(records, d, arm)
    pairs = {r: pair_design(records, d, seeds, arm, r) for r in rivals}
    units = {u for u, _ in keep}
    hit, share = covered(records, pairs[rivals[0]], units)
    others = tuple(s for s in pairs[rivals[0]].seeds if s not in hit)
    margins = []
    for r in rivals if hit and len(others) >= MIN_SEEDS else ():
        margins.append((r, comparison(records, replace(pairs[r], seeds=others), arm, r, family)))
    evals = sorted(int(e) for e in records[("low-cost", d.seeds[0], d.points[0])]["heldout"])
    gaps = [(e, paired(records, replace(d, horizon=e), "low-cost", "BF16")) for e in evals]
    old = None if price.note is not None else old_cost(records, d, price)
    if old is not None:
        # the old model let a branch's extra steps run on past the end of the trunk's schedule
        old["past"] = old["worst"][0] + d.horizon + old["worst"][1] > schedule
    return {
        "standing": [(unit_name(u), m) for u, m in keep],
        "hit": hit,
        "seeds": pairs[rivals[0]].seeds,
        "share": share,
        "margins": margins,
        "work": work(records, d, arm),
        "parts": unit_work(records, d, arm, units) or [],
        "gaps": gaps,
        "grows": gaps[-1][1][0] > gaps[0][1][0],
        "old": old,
        "looks": [(r, *looks(records, pairs[r], arm, r, stop, family)) for r in rivals if stop],
    }
