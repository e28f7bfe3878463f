r"""The GNMR risk scores in torch, with the conventions spelled out: the reference of the policy.

The controller scores with numpy (:func:`gnmr_dist.core.policy.score`, where the conventions
below come out of IEEE division); this module says the same in plain torch, one ``where`` per
rule, and ``tests/core/test_scores.py`` asserts the two agree bit for bit on every step of real
score histories. For unit ``u`` with gradient norm ``n_t(u)`` at optimizer step ``t``:

* **GNMR** (long horizon) compares the norm with the mean of every finite norm the unit had
  before: ``GNMR_t = n_t / (S / c)``. A value of 3 says "three times its usual gradient".
* **delta-GNMR** (short window) compares that score with the mean of the unit's last
  ``window`` finite GNMR values: ``dGNMR_t = GNMR_t / mean(W)``. A slow drift raises GNMR
  but not delta-GNMR; an abrupt spike raises both.
* **error term** (optional, docs/algorithm.md#damage-term): a backend may report a dimensionless
  error score ``e_t >= 0`` per unit; with a threshold ``gamma_t`` it enters the risk as a third
  term, ``risk = max(GNMR / alpha, dGNMR / beta, e / gamma)``, used as given (no history), a
  non-finite ``e`` (NaN, +-inf) counting as +inf.

Both ratios compare a unit with its own history, so they are dimensionless: scaling one unit's
whole norm series by ``c > 0`` leaves its scores unchanged. Division follows

    ratio(a, b) = a / b  if b > 0;   1.0 if a == b == 0;   +inf if b == 0 < a

so a unit whose history is all zeros scores 1 while it stays at zero and +inf the moment it
moves. A unit with no history (``c == 0``, or ``W`` empty) scores 1.0, and a non-finite norm
scores +inf on every score.
"""

from __future__ import annotations

import torch

__all__ = ["error_scores", "ratio", "risk_scores"]


def ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``a / b`` with the GNMR conventions for ``b == 0`` (``a, b >= 0``)."""
    safe_b = torch.where(b > 0, b, torch.ones_like(b))
    out = torch.where(b > 0, a / safe_b, torch.full_like(a, float("inf")))
    return torch.where((a == 0) & (b == 0), torch.ones_like(a), out)


def error_scores(errors: torch.Tensor) -> torch.Tensor:
    """The damage term's error scores ``e_t`` with every non-finite value (NaN, +-inf) as +inf."""
    return torch.where(torch.isfinite(errors), errors, torch.full_like(errors, float("inf")))


def risk_scores(
    norms: torch.Tensor,
    norm_sum: torch.Tensor,
    norm_count: torch.Tensor,
    window_mean: torch.Tensor,
    window_len: torch.Tensor,
    alpha: float,
    beta: float,
    *,
    errors: torch.Tensor | None = None,
    gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GNMR, delta-GNMR and risk = max(GNMR / alpha, dGNMR / beta[, e / gamma]) for every unit.

    ``norms`` may hold NaN or +-inf; those units score +inf. ``norm_sum``/``norm_count`` are the
    sum and count of past finite norms, ``window_mean``/``window_len`` the mean and size of the
    window of past finite GNMR values (summed oldest to newest, as the policy sums it, for the
    same bits). All float64 except the integer counts. ``errors`` (float64 [U], >= 0,
    non-finite counts as +inf) and ``gamma`` add the damage term
    (docs/algorithm.md#damage-term); without them the risk is the plain one
    (docs/algorithm.md#risk), bit for bit.
    """
    if (errors is None) != (gamma is None):
        raise ValueError("risk_scores needs both errors and gamma for the error term, or neither")
    finite = torch.isfinite(norms)
    clean = torch.where(finite, norms, torch.zeros_like(norms))
    have_mean = norm_count > 0
    mean = norm_sum / torch.where(have_mean, norm_count, torch.ones_like(norm_count))
    gnmr = torch.where(have_mean, ratio(clean, mean), torch.ones_like(clean))
    dgnmr = torch.where(window_len > 0, ratio(gnmr, window_mean), torch.ones_like(gnmr))
    inf = torch.full_like(gnmr, float("inf"))
    gnmr = torch.where(finite, gnmr, inf)
    dgnmr = torch.where(finite, dgnmr, inf)
    risk = torch.maximum(gnmr / alpha, dgnmr / beta)
    if errors is not None and gamma is not None:
        risk = torch.maximum(risk, error_scores(errors) / gamma)
    return gnmr, dgnmr, risk
