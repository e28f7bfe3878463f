"""Selection quality: how well a set of units, or a score, matches the measured recovery gap.

Pure functions over the per-unit gap ``gap_u >= 0`` that the recovery-gap probe measures
(:mod:`gnmr_dist.distributed.probe`). ``top_k(x, k)`` is the set of the k largest entries, ties
broken by id ascending, NaN read as ``+inf`` (as the controller reads it):

    precision_at_k(s, gap, k) = |top_k(s, k)  ∩  top_k(gap, k)| / k
    set_precision(A, gap, k)  = |A  ∩  top_k(gap, k)| / k                  (k = |A| by default)
    gap_share(A, gap)         = sum_{u in A} gap_u^2  /  sum_u gap_u^2
    spearman(s, gap)          = Pearson correlation of the average ranks of s and of gap

:func:`probe_figures` grades every set a report compares on one probe step: the risk's top-k,
the named sets, the error scores' top-k, a random k-set (its exact expectation over the uniform
draws, not a draw) and the oracle (the top k by the gap itself, the upper bound). Undefined
figures are NaN. docs/telemetry.md#selection-figures derives the random set's expectation and
says when the squared gaps add.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence

import torch

__all__ = [
    "first_last_units",
    "gap_share",
    "layer_number",
    "precision_at_k",
    "probe_figures",
    "random_figures",
    "set_figures",
    "set_precision",
    "spearman",
    "top_k",
]

_FIGURES = ("precision_grad", "precision_update", "share_grad", "share_update")
_INTEGER = re.compile(r"^\d+$")


def _as_vector(values: torch.Tensor, name: str) -> torch.Tensor:
    v = torch.as_tensor(values).detach().to("cpu", torch.float64)
    if v.dim() != 1 or v.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector, got shape {tuple(v.shape)}")
    return torch.where(torch.isnan(v), torch.full_like(v, math.inf), v)


def _check_k(k: int, n: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, {n}] (the number of units), got {k!r}")


def top_k(values: torch.Tensor, k: int) -> frozenset[int]:
    """Ids of the ``k`` largest values, ties broken by id ascending (NaN as ``+inf``)."""
    v = _as_vector(values, "values")
    _check_k(k, v.numel())
    order = torch.sort(v, descending=True, stable=True).indices
    return frozenset(int(i) for i in order[:k])


def precision_at_k(scores: torch.Tensor, gaps: torch.Tensor, k: int) -> float:
    """``|top_k(scores) ∩ top_k(gaps)| / k``: how many of the k highest scores are top-k gaps."""
    if torch.as_tensor(scores).numel() != torch.as_tensor(gaps).numel():
        raise ValueError("scores and gaps must have one entry per unit each")
    return len(top_k(scores, k) & top_k(gaps, k)) / k


def set_precision(chosen: Collection[int], gaps: torch.Tensor, k: int | None = None) -> float:
    """``|chosen ∩ top_k(gaps)| / k`` with ``k = len(chosen)`` by default; NaN for ``k = 0``."""
    k = len(chosen) if k is None else k
    if k == 0:
        return math.nan
    return len(set(chosen) & top_k(gaps, k)) / k


def gap_share(chosen: Collection[int], gaps: torch.Tensor) -> float:
    """``sum of gaps^2 over chosen / sum over all``: the squared gap ``chosen`` covers."""
    g2 = _as_vector(gaps, "gaps").square()
    total = float(g2.sum())
    if total == 0.0:
        return math.nan
    ids = sorted(set(chosen))
    if ids and not 0 <= ids[0] <= ids[-1] < g2.numel():
        raise ValueError(f"chosen ids must be in [0, {g2.numel() - 1}], got {ids}")
    return float(g2[ids].sum()) / total if ids else 0.0


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """float64 1-based ranks, ties sharing the mean of their positions (NaN as ``+inf``)."""
    v = _as_vector(values, "values")
    _, inverse, counts = torch.unique(v, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks: torch.Tensor = (ends - (counts.double() - 1) / 2)[inverse]
    return ranks


def spearman(scores: torch.Tensor, gaps: torch.Tensor) -> float:
    """Spearman's rho: the Pearson correlation of :func:`average_ranks` of the two vectors."""
    a, b = average_ranks(scores), average_ranks(gaps)
    if a.numel() != b.numel():
        raise ValueError("scores and gaps must have one entry per unit each")
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float(a.square().sum()) * float(b.square().sum()))
    return float((a * b).sum()) / den if den > 0 else math.nan


def set_figures(
    chosen: Collection[int], grad_gap: torch.Tensor, update_gap: torch.Tensor | None
) -> dict[str, float]:
    """:func:`set_precision` (k = ``len(chosen)``) and :func:`gap_share` of ``chosen`` against
    the gradient gap and the update gap: keys ``precision_grad``, ``precision_update``,
    ``share_grad``, ``share_update`` (the update ones NaN when ``update_gap`` is ``None``)."""
    return {
        "precision_grad": set_precision(chosen, grad_gap),
        "precision_update": math.nan if update_gap is None else set_precision(chosen, update_gap),
        "share_grad": gap_share(chosen, grad_gap),
        "share_update": math.nan if update_gap is None else gap_share(chosen, update_gap),
    }


def random_figures(
    grad_gap: torch.Tensor, update_gap: torch.Tensor | None, eligible: Sequence[bool], k: int
) -> dict[str, float]:
    """The exact expectation of :func:`set_figures` over uniform random ``min(k, E)``-subsets
    of the ``E`` eligible units (module docstring); NaN everywhere when none is eligible."""
    elig = frozenset(i for i, e in enumerate(eligible) if e)
    if not elig:
        return dict.fromkeys(_FIGURES, math.nan)
    m = min(k, len(elig))
    out = {}
    for kind, gap in (("grad", grad_gap), ("update", update_gap)):
        if gap is None:
            out[f"precision_{kind}"] = out[f"share_{kind}"] = math.nan
            continue
        out[f"precision_{kind}"] = len(top_k(gap, m) & elig) / len(elig)
        out[f"share_{kind}"] = m / len(elig) * gap_share(elig, gap)
    return {key: out[key] for key in _FIGURES}


def layer_number(name: str) -> int | None:
    """The first integer component of a dotted unit name (``model.layers.3.mlp`` -> 3)."""
    return next((int(p) for p in name.split(".") if _INTEGER.match(p)), None)


def first_last_units(names: Sequence[str]) -> frozenset[int]:
    """Ids of the units in the first and the last layer by :func:`layer_number` (Megatron's
    static recipe); empty when no name carries a layer number."""
    layers = [layer_number(n) for n in names]
    numbered = [x for x in layers if x is not None]
    if not numbered:
        return frozenset()
    ends = {min(numbered), max(numbered)}
    return frozenset(i for i, x in enumerate(layers) if x in ends)


def probe_figures(
    grad_gap: torch.Tensor,
    update_gap: torch.Tensor | None,
    risk: torch.Tensor,
    sets: Mapping[str, Collection[int]],
    k: int,
    *,
    errors: torch.Tensor | None = None,
    eligible: Sequence[bool] | None = None,
) -> dict[str, dict[str, float]]:
    """Every graded set's :func:`set_figures` on one probe step, by row name.

    Rows: ``risk_topk`` (:func:`top_k` of ``risk``), then ``sets`` in their order, then
    ``error_topk`` (with ``errors``), ``random`` (with ``eligible``: :func:`random_figures`) and
    ``oracle`` (precision 1, the share of the top ``k`` by each gap). ``update_gap`` ``None``:
    the update figures are NaN.
    """
    rows = {"risk_topk": top_k(risk, k), **{name: frozenset(s) for name, s in sets.items()}}
    if errors is not None:
        rows["error_topk"] = top_k(errors, k)
    out = {name: set_figures(s, grad_gap, update_gap) for name, s in rows.items()}
    if eligible is not None:
        out["random"] = random_figures(grad_gap, update_gap, eligible, k)
    out["oracle"] = {
        "precision_grad": 1.0,
        "precision_update": 1.0 if update_gap is not None else math.nan,
        "share_grad": gap_share(top_k(grad_gap, k), grad_gap),
        "share_update": (
            gap_share(top_k(update_gap, k), update_gap) if update_gap is not None else math.nan
        ),
    }
    return out
