"""What a probe step of the harness records: the measured recovery gaps, the graded sets and
their selection figures (:func:`gnmr_dist.telemetry.selection.set_figures`), and their means."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from gnmr_dist.distributed.probe import ProbeResult
from gnmr_dist.telemetry.selection import set_figures, spearman, top_k


def probe_record(
    step: int,
    result: ProbeResult,
    risk: torch.Tensor,
    sets: dict[str, frozenset[int]],
    k: int,
    scores: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One probe step: the gaps, the graded sets and their figures (JSON-ready).

    ``sets`` are the policy's sets of this step; the risk's top-``k`` and the two oracle top-``k``
    sets are added. Raises ``RuntimeError`` if the grad-gap oracle does not have precision 1 and
    the largest grad-gap share of the k-sets (a self-check of the probe's and selection's maths).
    """
    g, up = result.grad_gap, result.update_gap
    sets = {
        "risk_topk": top_k(risk, k),
        **sets,
        "oracle_grad": top_k(g, k),
        "oracle_update": top_k(up, k),
    }
    figures = {name: set_figures(s, g, up) for name, s in sets.items()}
    oracle = figures["oracle_grad"]
    # only k-sets compete: a larger set (first_last, active) covers more by its size alone
    best = max(f["share_grad"] for n, f in figures.items() if len(sets[n]) == k)
    if oracle["precision_grad"] != 1.0 or oracle["share_grad"] < best - 1e-12:
        raise RuntimeError(f"step {step}: the grad-gap oracle is not the best k-set: {figures}")
    return {
        "step": step,
        "k": k,
        "risk": risk.tolist(),
        "grad_gap": g.tolist(),
        "update_gap": up.tolist(),
        "grad_low_norm": result.grad_low_norm.tolist(),
        "grad_high_norm": result.grad_high_norm.tolist(),
        "loss_low": result.loss_low,
        "loss_high": result.loss_high,
        "sets": {n: sorted(s) for n, s in sets.items()},
        "figures": figures,
        "scores": {n: v.tolist() for n, v in (scores or {}).items()},
        "spearman": {
            f"{n}_{gap}": spearman(v, x)
            for n, v in {"risk": risk, **(scores or {})}.items()
            for gap, x in (("grad", g), ("update", up))
        },
    }


def summarize_probes(probes: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean of every figure over the probe steps where it is defined (NaN: never defined)."""
    rows = [(name, fig) for p in probes for name, fig in p["figures"].items()]
    rows += [("spearman", p["spearman"]) for p in probes]
    out: dict[str, dict[str, list[float]]] = {}
    for name, fig in rows:
        for key, value in fig.items():
            out.setdefault(name, {}).setdefault(key, []).append(value)
    return {
        name: {key: _mean_defined(values) for key, values in fig.items()}
        for name, fig in out.items()
    }


def _mean_defined(values: Sequence[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return statistics.fmean(defined) if defined else math.nan
