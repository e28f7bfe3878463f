"""The GNMR policy as two pure functions: one step's scores, then the plan (docs/algorithm.md).

:func:`score` is the doc's sections Scores and Risk, :func:`select` its Selection, with the
comments numbering the steps 1-4 as the doc does. Both read the history and the locks as
arguments and return new arrays; the controller (:mod:`gnmr_dist.core.controller`) owns that
state, checks the inputs, absorbs each step into the history afterwards (the doc's History
update) and checkpoints it.

numpy, not torch: a decision is a few dozen operations on U floats, so the per-operation overhead
is what it costs (docs/algorithm.md#cost). The doc's ``ratio`` conventions come out of IEEE
division with one fix: ``a / b`` is ``a / b`` for ``b > 0`` and ``+inf`` for ``a > 0 = b``;
``0 / 0`` and every division by the NaN of an empty history (``S / c`` with ``c = 0``, then
``S = 0``; ``sum(W) / |W|`` with ``W`` empty) is NaN, which becomes the 1 that both conventions
give there. :func:`gnmr_dist.core.scores.risk_scores` states the same scores with the
conventions spelled out, in torch; ``tests/core/test_scores.py`` asserts that the two agree bit
for bit.
"""

from __future__ import annotations

import numpy as np

from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.decision import Plan, Scores

__all__ = ["score", "select"]


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
    if not finite.all():  # a non-finite norm scores +inf on both
        gnmr = np.where(finite, gnmr, np.inf)
        dgnmr = np.where(finite, dgnmr, np.inf)
    # Risk: max(GNMR_t / alpha_t, dGNMR_t / beta_t), with the damage term also e_t / gamma_t
    # (a non-finite e_t scores +inf); a unit exceeds when its risk is above 1
    risk = np.maximum(gnmr / alpha, dgnmr / beta)
    e = None
    if errors is not None and gamma is not None:
        e = np.where(np.isfinite(errors), errors, np.inf)
        risk = np.maximum(risk, e / gamma)
    return Scores(gnmr, dgnmr, risk, risk > 1.0, finite, e)


def select(
    t: int, scores: Scores, lock: np.ndarray, eligible: np.ndarray, config: GNMRConfig
) -> Plan:
    """The active set ``A_t`` of decision ``t`` and every unit's lock after it.

    ``lock`` is each unit's lock before the decision (int64 [U]), ``eligible`` the bool mask of
    units with a recovery path. Neither is modified.
    """
    risk, exceed = scores.risk, scores.exceed
    # 1. Locks count down: a unit that does not exceed loses one step of its lock
    lock = np.where(exceed, lock, lock - (lock > 0))
    # 2. Candidates: eligible units that exceed or still hold a lock; none during warm-up
    candidates = (exceed | (lock > 0)) & eligible
    if t <= config.warmup_steps:
        candidates[:] = False
    # 3. Budget: the first max_active candidates by risk descending, ties by id ascending
    #    (a stable sort of -risk over ascending ids), sorted only when there are more
    ids = np.flatnonzero(candidates)
    if ids.size > config.max_active:
        order = np.argsort(-risk[ids], kind="stable")[: config.max_active]
        active = np.sort(ids[order])
    else:
        active = ids
    # 4. Locks are set: exceeding units of A_t get lock_steps, the others in A_t keep theirs,
    #    every unit outside A_t gets 0
    held = np.zeros_like(lock)
    held[active] = np.where(exceed[active], config.lock_steps, lock[active])
    return Plan(candidates, active, held)
