"""What a table of branch records reads, chosen from the records, and the per-arm figures of the
fault and paper regimes (:mod:`benchmarks.sweep.branches`), beside the paired statistics of
:mod:`benchmarks.harness.branch_stats`; RESULTS.md's sections word them. No torch.

A figure pairs arms on the same (seed, point) and averages a seed's points, so a table needs all
its arms at every (seed, point) of one grid: the largest, by branches per arm then seeds
(:func:`largest_design`); an arm that would leave it under :data:`MIN_SEEDS` seeds waits outside
(:func:`choose_arms`). Another CPU trains other bits from the same commit, so a (seed, point) is
read on the host of its BF16 branch and other hosts' records are set aside (:func:`one_host`).
The paper regimes' verdict rules (:func:`verdict`): docs/benchmarks.md#sweep-paper-regimes; a
pilot's static gap (:func:`static_gap`) and the old cost model's means (:func:`old_cost`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from itertools import combinations
from typing import Any

from benchmarks.harness import cost, preregistered
from benchmarks.harness.branch_stats import Design, Records, paired, per_seed, share_closed
from benchmarks.harness.provenance import UNKNOWN
from benchmarks.harness.stats import interval

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_SEEDS = 2
"""The fewest seeds a design keeps (an interval needs two)."""
STANDING = 0.8
"""A unit GNMR+e recovers on at least this share of the steps of the branches whose fault struck
another unit (their mean) is standing spend."""
HIDDEN, FFN = 128, 344
"""The harness Llama's widths: q, k, v and o are ``HIDDEN x HIDDEN``, gate, up and down ``HIDDEN
x FFN``; :func:`unit_work` gives no split where they do not add up to ``flops_recovered``."""
REPRODUCED = 0.5
"""The share of the static gap GNMR's interval must lie above for *reproduced*."""


def unit_of(module: str) -> int:
    """The unit index of ``model.layers.<L>.<block>.<proj>`` in the records' order."""
    parts = module.split(".")
    return int(parts[2]) * len(PROJECTIONS) + PROJECTIONS.index(parts[-1])


def unit_name(u: int) -> str:
    layer, j = divmod(u, len(PROJECTIONS))
    return f"L{layer}.{PROJECTIONS[j].removesuffix('_proj')}"


def machine(record: dict[str, Any]) -> str:
    """The host a record was trained on (CPU model and ISA), ``not recorded`` without one."""
    h = record.get("provenance", {}).get("host")
    return f"{h['cpu']}, ISA {h['isa']}" if isinstance(h, dict) else UNKNOWN


def one_host(records: Records) -> tuple[Records, Records]:
    """(kept, set aside): per (seed, point) the records on the host of its BF16 branch (without
    one, the host with the most records there, ties by name)."""
    hosts: dict[tuple[int, int], Counter[str]] = {}
    for (_, s, p), r in records.items():
        hosts.setdefault((s, p), Counter())[machine(r)] += 1
    chosen = {sp: min(c, key=lambda h: (-c[h], h)) for sp, c in hosts.items()}
    chosen |= {(s, p): machine(r) for (a, s, p), r in records.items() if a == "BF16"}
    kept = {k: r for k, r in records.items() if machine(r) == chosen[k[1:]]}
    return kept, {k: r for k, r in records.items() if k not in kept}


def complete_seeds(
    records: Records, arms: Sequence[str], seeds: Sequence[int], points: Sequence[int]
) -> list[int]:
    """The seeds of ``seeds`` with a record of every arm at every point of ``points``."""
    return [s for s in seeds if all((a, s, p) in records for a in arms for p in points)]


def largest_design(records: Records, arms: Sequence[str], horizon: int) -> Design | None:
    """The seeds x points grid with every arm of ``arms``, largest by branches per arm, then
    seeds (points: any subset of those recorded); ``None`` when there is none."""
    seeds = list(dict.fromkeys(s for a, s, _ in records if a in arms))
    points = sorted({p for a, _, p in records if a in arms})
    best, design = (0, 0), None
    for n in range(len(points), 0, -1):
        for pts in combinations(points, n):
            got = complete_seeds(records, arms, seeds, pts)
            if (len(got) * n, len(got)) > best:
                best, design = (len(got) * n, len(got)), Design(tuple(got), pts, horizon)
    return design


def choose_arms(
    records: Records, arms: Sequence[str], horizon: int, high: str = "BF16"
) -> tuple[Design | None, list[str], list[str]]:
    """(design, its arms, the arms waiting): while the design of all ``arms`` has fewer than
    :data:`MIN_SEEDS` seeds and the static arms (low-cost, ``high``) alone have that many, the
    arm with the fewest records leaves it (ties: the last in the tables' order)."""
    kept, waiting, statics = list(arms), [], ["low-cost", high]
    alone = largest_design(records, statics, horizon)
    while True:
        d = largest_design(records, kept, horizon)
        d = replace(d, high=high) if d else None
        if d is None or len(d.seeds) >= MIN_SEEDS or alone is None:
            return d, kept, waiting
        if len(alone.seeds) < MIN_SEEDS or len(kept) <= 2:
            return d, kept, waiting
        counts = {a: sum(k[0] == a for k in records) for a in kept if a not in statics}
        worst = min(reversed(list(counts)), key=counts.__getitem__)
        kept.remove(worst)
        waiting.append(worst)


def progress(records: Records, d: Design, arms: Sequence[str]) -> list[tuple[int, list[str]]]:
    """(seeds with every design point, the arms) of each of ``arms`` short of all their seeds."""
    seeds = list(dict.fromkeys(s for a, s, _ in records if a in arms))
    out: dict[int, list[str]] = {}
    for a in arms:
        n = len(complete_seeds(records, [a], seeds, d.points))
        if n < len(seeds):
            out.setdefault(n, []).append(a)
    return sorted(out.items())


def work(records: Records, d: Design, arm: str) -> float:
    """Mean share of the linear-layer work on the recovery path (``flops_recovered``)."""
    keys = [(arm, s, p) for s in d.seeds for p in d.points]
    return statistics.fmean(cost.flops_share(records[k])[0] for k in keys)


def on_fault(records: Records, d: Design, arm: str) -> float | None:
    """Mean over the branches that recovered anything of the share of the arm's recovered
    unit-steps spent on the faulted unit."""
    shares = []
    for r in (records[(arm, s, p)] for s in d.seeds for p in d.points):
        if r.get("unit_recovered") and r["recovered_unit_steps"] and r.get("outliers"):
            u = unit_of(r["outliers"][0]["module"])
            shares.append(r["unit_recovered"][u] / r["recovered_unit_steps"])
    return statistics.fmean(shares) if shares else None


def reach(pair: Sequence[float]) -> float:
    """How far a null's 95% interval reaches from 0: ``|mean| + half-width``."""
    return abs(pair[0]) + (0.0 if math.isnan(pair[1]) else pair[1])


def comparison(
    records: Records, d: Design, arm: str, rival: str, family: int, gap: float | None = None
) -> dict[str, Any]:
    """``arm - rival`` over ``d``'s seeds at the family's Bonferroni level, its verdict (``a tie``
    against ``gap``, :func:`preregistered.tie`, where one is given) and sign count; ``text``:
    the difference +- half-width and the verdict."""
    diffs = per_seed(records, d, arm, rival)
    m, h, v = preregistered.verdict(diffs, family)
    below, n, p = preregistered.sign_test(diffs)
    word = v + (" (a tie)" if gap is not None and preregistered.tie(m, h, gap) else "")
    half = "-" if math.isnan(h) else f"{h:.4f}"
    out = {"mean": m, "half": half, "verdict": v, "word": word, "seeds": len(diffs)}
    signs = f"{below} of {n} (p = {p:.3f})"
    return out | {
        "text": f"{m:+.4f} +- {half} {word}",
        "signs": signs,
        "below": below,
        "n": n,
        "p": p,
    }


def singles(records: Records, d: Design) -> dict[str, Any] | None:
    """Over the (seed, point) of ``d`` with every ``single <u>``: on how many the faulted unit
    had the largest single held-out gain over the low-cost arm, and per branch its rank."""
    ranks, h = [], str(d.horizon)
    for s in d.seeds:
        for p in d.points:
            low = records[("low-cost", s, p)]
            units = range(len(low["unit_recovered"]))
            if not all((f"single {u}", s, p) in records for u in units):
                continue
            gain = [low["heldout"][h] - records[(f"single {u}", s, p)]["heldout"][h] for u in units]
            order = sorted(units, key=lambda u: (-gain[u], u))
            fault = unit_of(low["outliers"][0]["module"])
            ranks.append((s, order.index(fault) + 1, f"{gain[fault]:+.4f}"))
    if not ranks:
        return None
    top = sum(x[1] == 1 for x in ranks)
    return {"top": top, "n": len(ranks), "units": len(units), "ranks": ranks}


def standing(records: Records, d: Design, arm: str) -> list[tuple[int, float]]:
    """(unit, mean recovered steps per branch) of the units ``arm`` recovers on at least
    :data:`STANDING` of the steps, over the design's branches whose fault struck another unit."""
    steps: dict[int, list[int]] = {}
    for r in (records[(arm, s, p)] for s in d.seeds for p in d.points):
        fault = unit_of(r["outliers"][0]["module"])
        for u, n in enumerate(r["unit_recovered"]):
            if u != fault:
                steps.setdefault(u, []).append(n)
    means = {u: statistics.fmean(v) for u, v in sorted(steps.items())}
    return [(u, m) for u, m in means.items() if m >= STANDING * d.horizon]


def unit_work(records: Records, d: Design, arm: str, keep: set[int]) -> list[float] | None:
    """Mean over the design's branches of the share of the linear work ``arm`` recovered on the
    standing units ``keep``, the other units of their layers, the faulted unit and the rest;
    ``None`` where the units' sizes do not give the record's ``flops_recovered``."""
    parts: list[list[float]] = [[], [], [], []]
    layers = {u // len(PROJECTIONS) for u in keep}
    for r in (records[(arm, s, p)] for s in d.seeds for p in d.points):
        n = r["unit_recovered"]
        size = ([HIDDEN * HIDDEN] * 4 + [HIDDEN * FFN] * 3) * (len(n) // len(PROJECTIONS))
        if len(size) != len(n):
            return None
        w = [n[u] * size[u] / (sum(size) * d.horizon) for u in range(len(n))]
        if not math.isclose(sum(w), r["flops_recovered"], rel_tol=1e-6, abs_tol=1e-9):
            return None
        fault = unit_of(r["outliers"][0]["module"])
        acc = [0.0] * 4  # standing, the rest of their layers, the faulted unit, elsewhere
        for u, x in enumerate(w):
            acc[
                2 if u == fault else 0 if u in keep else 1 if u // len(PROJECTIONS) in layers else 3
            ] += x
        for part, x in zip(parts, acc, strict=True):
            part.append(x)
    return [statistics.fmean(p) for p in parts]


def recovery_arm(records: Records) -> str | None:
    """The arm running the recovery path on every unit (not a null), as the records name it."""
    names = {
        a
        for (a, _, _), r in records.items()
        if r.get("arm_spec", {}).get("policy") == "recovery" and not a.startswith("null ")
    }
    return min(names) if names else None


def above(pair: Sequence[float], bar: float = 0.0) -> bool:
    """Whether the 95% interval lies above ``bar``."""
    return not math.isnan(pair[1]) and pair[0] - pair[1] > bar


def verdict(records: Records, d: Design, arm: str) -> dict[str, Any]:
    """The verdict on ``arm`` (the paper's ``GNMR k``) over ``d``, the first rule that applies
    (docs/benchmarks.md#sweep-paper-regimes), as ``word``, with the figures it is read from:
    ``gap`` (low - high), ``share`` (of the gap closed), ``vs_high``, ``vs_low``, ``work``."""
    gap = paired(records, d, d.low, d.high)
    out: dict[str, Any] = {"arm": arm, "gap": gap, "share": None, "vs_high": None, "vs_low": None}
    out["work"] = None
    if math.isnan(gap[1]) or not all((arm, s, p) in records for s in d.seeds for p in d.points):
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


def static_gap(records: Records) -> tuple[Design, float, tuple[float, float]] | None:
    """(design, the outlier's peak as a power of 2, the static gap low-cost - BF16 (95%)) on
    every point and every seed with both static arms at all of them (a pilot's records)."""
    lows = [x for k, x in records.items() if k[0] == "low-cost"]
    seeds = list(dict.fromkeys(s for _, s, _ in records))
    points = sorted({p for _, _, p in records})
    ok = complete_seeds(records, ["low-cost", "BF16"], seeds, points)
    if not lows or not ok:
        return None
    d = Design(tuple(ok), tuple(points), max(int(e) for e in lows[0]["heldout"]))
    o, gap = lows[0]["outliers"][0], interval(per_seed(records, d, "low-cost", "BF16"))
    return d, math.log2(o["growth"] ** o["rise"]), gap


def old_cost(records: Records, d: Design, price: cost.Price) -> dict[str, Any] | None:
    """The old cost model on the low-cost path against BF16: per branch its extra steps and
    speed-up; ``extra`` and ``ratios`` their means over seeds (a seed's over its points),
    ``at_mean`` the speed-up at the mean extra steps, ``H / ((H + extra) t(0))`` (the mean of
    ratios overstates it: the speed-up is convex in the extra steps), ``worst`` the branch with
    the most extra steps (point, steps). ``None`` where a branch has no figure."""
    pairs = [
        (p, records[("low-cost", s, p)], records[("BF16", s, p)]) for s in d.seeds for p in d.points
    ]
    branches = [(p, cost.branch_cost(low, bf16, d.horizon, price)) for p, low, bf16 in pairs]
    if any(c.extra_steps is None or c.speedup is None for _, c in branches):
        return None
    n = len(d.points)
    by_seed = [[c for _, c in branches[i : i + n]] for i in range(0, len(branches), n)]
    extra = statistics.fmean(statistics.fmean(c.extra_steps for c in s) for s in by_seed)
    ratios = statistics.fmean(statistics.fmean(c.speedup for c in s) for s in by_seed)
    point, worst = max(branches, key=lambda b: b[1].extra_steps or 0.0)
    at_mean = d.horizon / ((d.horizon + extra) * cost.step_time(0.0, price))
    worst_at = (point, worst.extra_steps)
    return {"extra": extra, "ratios": ratios, "at_mean": at_mean, "worst": worst_at}


def pair_design(records: Records, d: Design, seeds: Sequence[int], arm: str, rival: str) -> Design:
    """``d``'s points on every seed of ``seeds`` with both arms at all of them, where that is more
    seeds than ``d``'s (a power run), else ``d``."""
    # a power run adds seeds for the comparisons it serves only: the design keeps every arm's
    got = complete_seeds(records, [arm, rival], seeds, d.points)
    return replace(d, seeds=tuple(got)) if len(got) > len(d.seeds) else d
