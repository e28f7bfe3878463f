"""The report of an FP4 branch sweep (:mod:`benchmarks.sweep.branches`): the estimator's noise, one
row per arm, the verdicts per budget, a JSON summary and the quality-against-budget plot."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from itertools import product
from pathlib import Path
from typing import Any

from benchmarks.harness.branch import NULL_ARMS
from benchmarks.harness.branch_stats import (
    GAP,
    SPIKE,
    Design,
    Records,
    paired,
    share_closed,
    spike_figures,
    table,
    troubles,
    unit_step_share,
    verdict,
)
from benchmarks.harness.common import RESULTS, errorbar, finish_plot, jsonable, subplots
from benchmarks.harness.model import PROJECTIONS
from benchmarks.harness.provenance import record
from benchmarks.harness.stats import plus_minus
from benchmarks.sweep.regimes import Regime

logger = logging.getLogger(__name__)


def complete(records: Records, d: Design, arm: str) -> bool:
    return all((arm, s, p) in records for s in d.seeds for p in d.points)


def summarize(records: Records, d: Design, arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per arm with every branch done: its paired figures (``benchmarks.harness.branch_stats``),
    its loss spikes and their per-seed difference to the low-cost arm's (``None`` for that arm)."""
    out: dict[str, dict[str, Any]] = {}
    if not (complete(records, d, d.low) and complete(records, d, d.high)):
        return out  # every figure pairs with the two static arms
    for arm in arms:
        if not complete(records, d, arm):
            continue
        _, diverged = troubles(records, d, arm)
        out[arm] = {
            "vs_bf16": paired(records, d, arm, d.high),
            "vs_low_cost": paired(records, d, arm, d.low),
            "closed": share_closed(records, d, arm),
            "unit_steps": unit_step_share(records, d, arm),
            **spike_figures(records, d, arm),
            "diverged": diverged,
        }
    return out


def noise(records: Records, d: Design) -> dict[str, tuple[float, float]]:
    """The null controls and the static gap (paired mean, 95% half-width)."""
    pairs = {
        GAP: (d.low, d.high),
        f"{NULL_ARMS[0]} - BF16": (NULL_ARMS[0], d.high),
        f"{NULL_ARMS[1]} - low-cost": (NULL_ARMS[1], d.low),
        "low-cost (SR seed 1) - low-cost": ("low-cost (SR seed 1)", d.low),
    }
    out = {
        name: paired(records, d, a, b)
        for name, (a, b) in pairs.items()
        if complete(records, d, a) and complete(records, d, b)
    }
    if GAP in out:  # how the gap grows along a branch
        for e in _horizons(records, d):
            out[f"static gap after {e} steps"] = paired(
                records, replace(d, horizon=e), d.low, d.high
            )
    return out


def _horizons(records: Records, d: Design) -> list[int]:
    """The other evaluation steps every branch of the two static arms recorded."""
    keys = [set(records[k]["heldout"]) for k in product((d.low, d.high), d.seeds, d.points)]
    return sorted(int(e) for e in set.intersection(*keys) if int(e) != d.horizon)


def picks(records: Records, d: Design, arm: str, top: int = 6) -> list[tuple[str, float]]:
    """The units ``arm`` ran on the recovery path most, as ``("L<layer>.<proj>", share of the
    arm's recovered unit-steps)``; empty for records that predate the per-unit counts."""
    rows = [records[(arm, s, p)].get("unit_recovered") for s in d.seeds for p in d.points]
    if not rows or any(r is None for r in rows):
        return []
    totals = [sum(col) for col in zip(*rows, strict=True)]
    whole = sum(totals) or 1
    ranked = sorted(range(len(totals)), key=lambda i: -totals[i])[:top]
    n = len(PROJECTIONS)  # the harness Llama's units, in registry order per layer
    short = [p.removesuffix("_proj") for p in PROJECTIONS]
    return [(f"L{i // n}.{short[i % n]}", totals[i] / whole) for i in ranked if totals[i]]


def noise_checks(est: dict[str, tuple[float, float]]) -> list[str]:
    """Each null's check: its interval holds 0, and its half-width is at most a third of the
    static gap's mean (the gap the estimator is asked to resolve)."""
    if GAP not in est:
        return []
    gap, gap_h = est[GAP]
    out = [f"- static gap resolved (interval excludes 0): {abs(gap) > gap_h}"]
    for name, (m, h) in est.items():
        if not name.startswith("static gap") and gap:
            holds = abs(m) <= h
            out.append(
                f"- check {name}: holds 0 {holds}; half-width / static gap "
                f"{h / abs(gap):.2f} (<= 1/3: {h <= abs(gap) / 3})"
            )
    return out


def comparisons(
    records: Records, d: Design, budgets: Sequence[int], nvidia: Sequence[str]
) -> list[tuple[str, tuple[float, float]]]:
    """Paired differences a - b that carry the verdicts (negative: a better)."""
    pairs = []
    for k in budgets:
        pairs += [(f"{policy} {k}", f"random {k}") for policy in ("GNMR+e", "GNMR", "oracle")]
        # the late switch spends NVIDIA's share of unit-steps: the last-k rule's budget
        at_nvidias = f"NVIDIA last-{k}" in nvidia
        for b in [*nvidia, f"oracle {k}"]:
            last_k = b == f"NVIDIA last-{k}"
            if b.startswith("oracle") or last_k or ("late" in b and at_nvidias):
                pairs.append((f"GNMR+e {k}", b))
    return [
        (f"{a} - {b}", paired(records, d, a, b))
        for a, b in pairs
        if complete(records, d, a) and complete(records, d, b)
    ]


def report(
    regime: Regime,
    d: Design,
    records: Records,
    arms: Sequence[str],
    budgets: Sequence[int],
    out_dir: Path = RESULTS,
    suffix: str = "",
) -> dict[str, Any]:
    """Print the report, write ``<out_dir>/sweep_fp4_<regime><suffix>.json`` and its plot."""
    summary = summarize(records, d, arms)
    nvidia = [a for a in arms if a.startswith("NVIDIA")]
    est = noise(records, d)
    comp = comparisons(records, d, budgets, nvidia)
    lines = [f"{regime.name}: {regime.description}"]
    lines.append(
        f"{len(d.seeds)} seeds x {len(d.points)} branch points {list(d.points)}, "
        f"{d.horizon} steps each; held-out loss in fp32 after {d.horizon} steps, paired by "
        "branch, mean over a seed's points, 95% Student-t interval over seeds"
    )
    checks = noise_checks(est)
    lines += [f"- {name}: {plus_minus(pair)}" for name, pair in est.items()] + checks
    lines += ["", table(summary), ""]
    lines += [f"- {name}: {plus_minus(pair)} -> {verdict(pair)}" for name, pair in comp]
    chosen = {
        a: picks(records, d, a) for a in summary if a.split()[0] in {"GNMR", "GNMR+e", "oracle"}
    }
    lines += [
        f"- {a} recovered most: " + ", ".join(f"{u} {100 * x:.0f}%" for u, x in got)
        for a, got in chosen.items()
        if got
    ]
    logger.info("\n".join(lines))
    out = {
        "regime": regime.name,
        "description": regime.description,
        "seeds": list(d.seeds),
        "points": list(d.points),
        "horizon": d.horizon,
        "instrument": regime.instrument.__dict__,
        "noise": est,
        "noise_checks": checks,
        "spike_rule": asdict(SPIKE),
        "summary": summary,
        "comparisons": dict(comp),
        "verdicts": {name: verdict(pair) for name, pair in comp},
        "picks": chosen,
        "branches": len(records),
        "provenance": record(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"sweep_fp4_{regime.name}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(jsonable(out), indent=1))
    if summary:
        plot(regime, summary, budgets, stem.with_suffix(".png"))
    return out


def plot(
    regime: Regime, summary: dict[str, dict[str, Any]], budgets: Sequence[int], path: Path
) -> None:
    """Held-out loss minus BF16's against the share of unit-steps on the recovery path."""
    fig, ax = subplots(figsize=(7.5, 4.8))

    def bars(names: list[str], **kwargs: Any) -> None:
        xs = [summary[n]["unit_steps"] for n in names]
        errorbar(ax, xs, [summary[n]["vs_bf16"] for n in names], **kwargs)

    for policy, marker in zip(("random", "GNMR", "GNMR+e", "oracle"), "osD^", strict=True):
        names = [f"{policy} {k}" for k in budgets if f"{policy} {k}" in summary]
        if names:
            bars(names, marker=marker, label=policy)
    for name in summary:
        if name.startswith(("NVIDIA", "first+last")):
            bars([name], marker="*", label=name, ms=11, ls="none")
    ax.axhline(0.0, ls=":", color="gray", label="BF16 everywhere")
    if "low-cost" in summary:
        m, h = summary["low-cost"]["vs_bf16"]
        ax.axhspan(m - h, m + h, color="red", alpha=0.12)
        ax.axhline(m, ls="--", color="red", lw=1, label="FP4 everywhere (band: 95% CI)")
    ax.set(
        title=f"{regime.name}: held-out loss after a branch vs recovery spent",
        xlabel="share of unit-steps on the recovery path (BF16)",
        ylabel="held-out loss - BF16 (paired)",
    )
    finish_plot(fig, path, 7)
