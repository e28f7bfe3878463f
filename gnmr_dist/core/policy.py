"""The GNMR policy as two pure functions: one step's scores, then the plan (docs/algorithm.md).

:func:`score` is the doc's sections Scores and Risk, :func:`select` its Selection, with the
comments numbering the steps 1-4 as the doc does. Both read the history, the locks and the
latches as arguments and return new arrays; the controller (:mod:`gnmr_dist.core.controller`)
owns that state, checks the inputs, absorbs each step into the history afterwards (the doc's
History update), keeps the accounting and checkpoints it.

numpy, not torch: a decision is a few dozen operations on U floats, so the per-operation overhead
is what it costs (docs/algorithm.md#cost). The doc's ``ratio`` conventions come out of IEEE
division with one fix: ``a / b`` is ``a / b`` for ``b > 0`` and ``+inf`` for ``a > 0 = b``;
``0 / 0`` and every division by the NaN of an empty history (``S / c`` with ``c = 0``, then
``S = 0``; ``sum(W) / |W|`` with ``W`` empty) is NaN, which becomes the 1 that both conventions
give there. :func:`gnmr_dist.testing.scores.risk_scores` states the same scores with the
conventions spelled out, in torch; ``tests/core/test_scores.py`` asserts that the two agree bit
for bit.

The selection of the second policy (budget schedules, ``max_share``, ``latch``, ``pinned``)
adds work only where those are set: without latches the order is the stable sort of the first
policy, without ``max_share`` the budget is its ``k_t`` first units, and the candidates are
sorted only when they do not all fit. Under ``max_share`` the greedy walk with skips
(:func:`_walk`) is vectorised by runs, at most ``k_t`` cumulative sums, and the cap is
``floor(s_t W)`` taken exactly (:func:`share_cap`), so the integer cost test never rounds.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from gnmr_dist.core.config import GNMRConfig, PolicyAt
from gnmr_dist.core.decision import Scores, Selection

__all__ = ["Units", "score", "select", "share_cap"]


def score(
    norms: np.ndarray,
    history: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    thresholds: tuple[float, float, float | None],
    errors: np.ndarray | None,
) -> Scores:
    """GNMR, delta-GNMR, risk and exceedance of every unit at one step.

    ``history`` is ``(S, c, W, |W|)``: the sum and count of each unit's past finite norms, its
    window of past finite GNMR values ``[U, window]`` (right-aligned, oldest first) and the
    window's length. ``thresholds`` is ``(alpha_t, beta_t, gamma_t)``; ``errors`` the error
    scores ``e_t``, required with ``gamma_t`` and ignored without it.
    """
    norm_sum, norm_count, window, window_len = history
    alpha, beta, gamma = thresholds
    finite = np.isfinite(norms)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Scores: GNMR_t = ratio(n_t, S / c), 1 when c = 0
        gnmr = norms / (norm_sum / norm_count)
        np.copyto(gnmr, 1.0, where=np.isnan(gnmr))
        # dGNMR_t = ratio(GNMR_t, mean W), 1 when W is empty; W summed oldest to newest
        total = np.cumsum(window, axis=1)[:, -1]
        dgnmr = gnmr / (total / window_len)
        np.copyto(dgnmr, 1.0, where=np.isnan(dgnmr))
    all_finite = bool(finite.all())
    if not all_finite:  # a non-finite norm scores +inf on both
        gnmr = np.where(finite, gnmr, np.inf)
        dgnmr = np.where(finite, dgnmr, np.inf)
    # Risk: max(GNMR_t / alpha_t, dGNMR_t / beta_t), with the damage term also e_t / gamma_t
    # (a non-finite e_t scores +inf); a unit exceeds when its risk is above 1
    risk = np.maximum(gnmr / alpha, dgnmr / beta)
    e = None
    if errors is not None and gamma is not None:
        e = np.where(np.isfinite(errors), errors, np.inf)
        risk = np.maximum(risk, e / gamma)
    return Scores(gnmr, dgnmr, risk, risk > 1.0, finite, e, all_finite)


_NONE = np.zeros(0, dtype=np.int64)
"""No unit: ``P_t`` while the pinned condition does not hold (never written to)."""


class Units(NamedTuple):
    """What the selection knows of the units besides their scores (fixed for a run)."""

    eligible: np.ndarray
    """bool [U]: units with a recovery path."""
    pinned: np.ndarray
    """int64, ascending: the eligible pinned units, ``P_t`` while the condition holds."""
    costs: np.ndarray | None
    """int64 [U]: ``w(u)``, the cost of each unit's recovery; ``None``: not given."""
    total_cost: int
    """``W``: the units' linear-layer work (docs/algorithm.md#compute-share); 0 without costs."""


@functools.lru_cache(maxsize=64)
def share_cap(share: float, total_cost: int) -> int:
    """``floor(s_t W)``, exactly: an integer cost is ``<= s_t W`` iff it is ``<=`` this.

    ``s_t`` is taken as the decimal it prints as (``repr``, the shortest that reads back as the
    same float), so ``"max_share": 0.3`` is 3/10 and 3 units of cost 1 fit in ``W = 10``; the
    double nearest 0.3 lies just below it and would leave them out. Cached: a constant share
    costs one look-up a step.
    """
    return math.floor(Fraction(repr(float(share))) * total_cost)


def select(
    t: int,
    at: PolicyAt,
    scores: Scores,
    memory: tuple[np.ndarray, np.ndarray | None],
    units: Units,
    config: GNMRConfig,
) -> Selection:
    """The selection of decision ``t``: the plan ``R_t = A_t + P_t`` and every unit's lock and
    latch after it.

    ``memory`` is each unit's lock and latch step before the decision (int64 [U]; the latches
    ``None`` while ``config.latch`` is unset, which leaves the first policy's path untouched).
    Neither is modified.
    """
    lock, latched = memory
    risk, exceed = scores.risk, scores.exceed
    # 1. Locks count down: a unit that does not exceed loses one step of its lock
    lock = np.where(exceed, lock, lock - (lock > 0))
    # 2. Candidates: eligible units, not pinned at t, that exceed, hold a lock or are latched;
    #    none during warm-up
    held = exceed | (lock > 0)
    if latched is not None:
        held |= latched > 0
    candidates = held & units.eligible
    pinned = units.pinned if at.pin else _NONE
    if pinned.size:
        candidates[pinned] = False
    if t <= config.warmup_steps:
        candidates[:] = False
    # 3. Budget: the order (latched by latch step, then by risk descending, ties by id), walked
    #    under k_t and, with max_share, the cost cap; sorted only when not every candidate fits
    share = None
    if at.share is not None and units.costs is not None:
        share = (share_cap(at.share, units.total_cost), units.costs)
    chosen = _choose(np.flatnonzero(candidates), risk, latched, at.k, share)
    # 4. Locks are set: exceeding units of A_t get lock_steps (and, while the latch condition
    #    holds, a latch if they have none), the others in A_t keep theirs, every unit outside
    #    A_t gets 0
    new_lock = np.zeros_like(lock)
    new_lock[chosen] = np.where(exceed[chosen], config.lock_steps, lock[chosen])
    new_latched = None if latched is None else _latch(t, at.latch, chosen, exceed, latched)
    # The plan R_t = A_t + P_t
    active = np.union1d(chosen, pinned) if pinned.size else chosen
    return Selection(candidates, active, new_lock, chosen, pinned, new_latched)


def _choose(
    ids: np.ndarray,
    risk: np.ndarray,
    latched: np.ndarray | None,
    k: int,
    share: tuple[int, np.ndarray] | None,
) -> np.ndarray:
    """``A_t`` (ascending) from the candidates ``ids`` (ascending): step 3. ``share`` is the
    cap ``floor(s_t W)`` and the costs ``w``, ``None`` without ``max_share``."""
    if ids.size <= k and (share is None or int(share[1][ids].sum()) <= share[0]):
        return ids
    order = _ranked(ids, risk, latched)
    if share is None:
        return np.sort(order[:k])
    cap, costs = share
    return np.sort(_walk(order, costs, k, cap))


def _ranked(ids: np.ndarray, risk: np.ndarray, latched: np.ndarray | None) -> np.ndarray:
    """``ids`` in selection order: latched units first by latch step then id, then the others
    by risk descending, ties by id ascending (a stable sort of -risk over ascending ids)."""
    if latched is not None:
        mark = latched[ids] > 0
        if mark.any():
            first, rest = ids[mark], ids[~mark]
            first = first[np.lexsort((first, latched[first]))]
            return np.concatenate([first, rest[np.argsort(-risk[rest], kind="stable")]])
    return ids[np.argsort(-risk[ids], kind="stable")]


def _walk(order: np.ndarray, costs: np.ndarray, k: int, cap: int) -> np.ndarray:
    """The walk of step 3 under both budgets: take each unit of ``order`` while fewer than
    ``k`` are taken and its cost fits in what is left of ``cap``, skip it otherwise.

    Vectorised by runs: what is left only shrinks, so a unit that does not fit now never will
    and is dropped at once; the rest's longest prefix that fits is taken in one cumulative sum.
    Each round takes at least one unit, so there are at most ``k`` rounds.
    """
    taken, room = [], cap
    while k > 0 and order.size:
        order = order[costs[order] <= room]
        if not order.size:
            break
        cum = np.cumsum(costs[order])
        n = min(int(np.searchsorted(cum, room, side="right")), k)
        taken.append(order[:n])
        room, k, order = room - int(cum[n - 1]), k - n, order[n:]
    return np.concatenate(taken) if taken else order[:0]


def _latch(
    t: int, latch_on: bool, chosen: np.ndarray, exceed: np.ndarray, latched: np.ndarray
) -> np.ndarray:
    """Latches after step 4: kept in ``A_t``, set to ``t`` on its exceeding unlatched units
    while the latch condition holds, 0 outside ``A_t``."""
    out = np.zeros_like(latched)
    out[chosen] = latched[chosen]
    if latch_on:
        new = chosen[exceed[chosen] & (latched[chosen] == 0)]
        out[new] = t
    return out
