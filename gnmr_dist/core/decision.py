"""What one decision produces: the policy's records and the controller's read-only result.

:class:`Scores` and :class:`Selection` are what the two halves of :mod:`gnmr_dist.core.policy`
return (numpy arrays over the U units); :class:`Decision` is what :meth:`GNMRController.step
<gnmr_dist.core.controller.GNMRController.step>` hands its caller, with :class:`Telemetry`, the
counts a trace or a log line keeps. A :class:`Decision` wraps the arrays without copying them and
makes its tensors, candidate tuple and telemetry only when they are first read, so a caller that
only needs :attr:`Decision.active` pays for nothing else (docs/algorithm.md#cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["Decision", "Report", "Scores", "Selection", "Telemetry"]


class Scores(NamedTuple):
    """One step's scores (docs/algorithm.md, sections Scores and Risk), float64/bool [U]."""

    gnmr: np.ndarray
    """``GNMR_t``: the norm over the mean of the unit's past finite norms."""
    delta_gnmr: np.ndarray
    """``dGNMR_t``: GNMR over the mean of the unit's window of past finite GNMR values."""
    risk: np.ndarray
    """``max(GNMR / alpha_t, dGNMR / beta_t[, e_t / gamma_t])``."""
    exceed: np.ndarray
    """``risk > 1``."""
    finite: np.ndarray
    """Units whose norm is finite (the others score +inf and leave their history untouched)."""
    error: np.ndarray | None
    """``e_t`` as scored (non-finite as +inf); ``None`` without the damage term."""
    all_finite: bool = True
    """Whether every norm was finite (``finite.all()``, taken once for the score and the
    accounting)."""


class Selection(NamedTuple):
    """The selection of one step (docs/algorithm.md#selection): the plan ``R_t`` and the lock and
    latch state it leaves."""

    candidates: np.ndarray
    """bool [U]: the candidate pool ``C``."""
    active: np.ndarray
    """int64, ascending: the ids of ``R_t = A_t + P_t``, the recovery path's units for the next
    step."""
    lock: np.ndarray
    """int64 [U]: every unit's lock after the decision."""
    chosen: np.ndarray
    """int64, ascending: ``A_t``, the budgeted choice (``active`` itself without pinned units)."""
    pinned: np.ndarray
    """int64, ascending: ``P_t``, the pinned units on the recovery path (often empty)."""
    latched: np.ndarray | None
    """int64 [U]: every unit's latch step after the decision; ``None`` without ``latch``."""


class Report(NamedTuple):
    """Which of the second policy's counts a decision's :class:`Telemetry` carries (``None`` or
    ``False``: left out, so a trace without them reads as before they existed)."""

    budget: int | None
    """``k_t``, reported while ``max_active`` is a schedule."""
    costs: np.ndarray | None
    """int64 [U] ``w(u)`` and ``W``: with them, the plan's share of the units' linear work."""
    total_cost: int
    """``W`` (0 without costs)."""
    pinned: bool
    """Report ``num_pinned`` (``pinned`` is set)."""
    latched: bool
    """Report ``num_latched`` (``latch`` is set)."""


@dataclass(frozen=True)
class Telemetry:
    """Counts that summarise one decision, cheap to log every step."""

    num_exceed: int
    """Units with ``risk > 1`` (all units, eligible or not)."""
    num_exceed_eligible: int
    """Eligible units with ``risk > 1`` (the numerator of the exceedance rate)."""
    num_candidates: int
    """Size of the candidate pool ``C``."""
    num_active: int
    """Size of the plan ``R_t`` (units on the recovery path next step, pinned ones included)."""
    num_locked: int
    """Units holding a lock after the decision (always <= ``k_t``)."""
    num_nonfinite: int
    """Units whose norm was NaN or +-inf at this step."""
    max_risk: float
    """Largest risk over all units (``inf`` when any norm or error score is non-finite)."""
    num_error_exceed: int = 0
    """Units whose error term alone exceeds, ``e_t / gamma_t > 1`` (all units, eligible or not;
    non-finite ``e`` included). Always 0 without ``gamma`` (docs/algorithm.md#damage-term)."""
    num_pinned: int | None = None
    """``|P_t|``: pinned units in the plan (``num_active`` counts them too); ``None`` (left out
    of :meth:`as_dict`) without ``pinned``."""
    num_latched: int | None = None
    """Units holding a latch after the decision; ``None`` without ``latch``."""
    budget: int | None = None
    """``k_t``; ``None`` unless ``max_active`` is a schedule."""
    plan_share: float | None = None
    """``cost(R_t) / W``: the plan's share of the units' linear-layer work; ``None`` unless the
    controller was given the costs."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: value}`` for loggers and JSON traces; the second policy's counts only
        where they are reported, so a trace without them is byte for byte what it was."""
        return {k: float(v) for k, v in self.__dict__.items() if v is not None}


class Decision:
    """What the controller decided at optimizer step ``step``.

    Read-only. The per-unit vectors are float64/bool CPU tensors over the controller's own
    arrays (no copy), made when first read; :attr:`candidates` and :attr:`telemetry` are
    computed when first read too, so a caller that only needs :attr:`active` pays for nothing
    else.
    """

    __slots__ = (
        "_active",
        "_alpha",
        "_beta",
        "_cache",
        "_candidates",
        "_eligible",
        "_gamma",
        "_num_locked",
        "_report",
        "_scores",
        "_selection",
        "_step",
    )

    def __init__(
        self,
        step: int,
        thresholds: tuple[float, float, float | None],
        scores: Scores,
        selection: Selection,
        eligible: np.ndarray,
        report: Report | None = None,
    ) -> None:
        self._step, (self._alpha, self._beta, self._gamma) = step, thresholds
        self._scores, self._candidates, self._eligible = scores, selection.candidates, eligible
        self._selection, self._report = selection, report
        self._active = tuple(selection.active.tolist())
        self._num_locked = int(np.count_nonzero(selection.lock[selection.active]))
        self._cache: dict[str, Any] = {}

    @property
    def step(self) -> int:
        """1-based optimizer step whose gradients were scored."""
        return self._step

    @property
    def active(self) -> tuple[int, ...]:
        """``R_t = A_t + P_t``: ascending ids of the units on the recovery path for the next
        step."""
        return self._active

    @property
    def chosen(self) -> tuple[int, ...]:
        """``A_t``: the budgeted choice (ascending); :attr:`active` without the pinned units."""
        if self._selection.chosen is self._selection.active:
            return self._active
        return self._ids("chosen", self._selection.chosen)

    @property
    def pinned(self) -> tuple[int, ...]:
        """``P_t``: the pinned units on the recovery path (ascending; empty without ``pinned``
        or while its condition does not hold)."""
        return self._ids("pinned", self._selection.pinned)

    def _ids(self, key: str, ids: np.ndarray) -> tuple[int, ...]:
        if key not in self._cache:
            self._cache[key] = tuple(ids.tolist())
        return self._cache[key]  # type: ignore[no-any-return]

    @property
    def alpha(self) -> float:
        """``alpha_t`` used at this step."""
        return self._alpha

    @property
    def beta(self) -> float:
        """``beta_t`` used at this step."""
        return self._beta

    @property
    def gamma(self) -> float | None:
        """``gamma_t`` used at this step; ``None`` when the damage term is off."""
        return self._gamma

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(getattr(self._scores, key))
        return self._cache[key]  # type: ignore[no-any-return]

    @property
    def gnmr(self) -> torch.Tensor:
        """float64 [U]: GNMR score of each unit."""
        return self._tensor("gnmr")

    @property
    def delta_gnmr(self) -> torch.Tensor:
        """float64 [U]: delta-GNMR score of each unit."""
        return self._tensor("delta_gnmr")

    @property
    def risk(self) -> torch.Tensor:
        """float64 [U]: ``max(GNMR / alpha_t, dGNMR / beta_t)``, with ``gamma`` set
        ``max(GNMR / alpha_t, dGNMR / beta_t, error / gamma_t)``."""
        return self._tensor("risk")

    @property
    def exceed(self) -> torch.Tensor:
        """bool [U]: ``risk > 1``."""
        return self._tensor("exceed")

    @property
    def error(self) -> torch.Tensor | None:
        """float64 [U]: the error score ``e_t`` of each unit as scored, i.e. as passed with every
        non-finite value (NaN, +-inf) replaced by +inf; its risk term is ``error / gamma``. Raw
        like :attr:`gnmr` (the threshold is in :attr:`gamma`). ``None`` without ``gamma``."""
        return None if self._scores.error is None else self._tensor("error")

    @property
    def candidates(self) -> tuple[int, ...]:
        """Ascending ids of the candidate pool."""
        if "candidates" not in self._cache:
            ids = np.flatnonzero(self._candidates)
            self._cache["candidates"] = tuple(ids.tolist())
        return self._cache["candidates"]  # type: ignore[no-any-return]

    @property
    def telemetry(self) -> Telemetry:
        """Summary counts for logging (computed when first read)."""
        if "telemetry" not in self._cache:
            self._cache["telemetry"] = self._telemetry()
        return self._cache["telemetry"]  # type: ignore[no-any-return]

    def _telemetry(self) -> Telemetry:
        s = self._scores
        error_exceed = 0
        if s.error is not None and self._gamma is not None:
            error_exceed = int(np.count_nonzero(s.error / self._gamma > 1.0))
        return Telemetry(
            num_exceed=int(np.count_nonzero(s.exceed)),
            num_exceed_eligible=int(np.count_nonzero(s.exceed & self._eligible)),
            num_candidates=int(np.count_nonzero(self._candidates)),
            num_active=len(self._active),
            num_locked=self._num_locked,
            num_nonfinite=int(s.finite.size - np.count_nonzero(s.finite)),
            max_risk=float(s.risk.max()),
            num_error_exceed=error_exceed,
            **self._second_policy(),
        )

    def _second_policy(self) -> dict[str, Any]:
        """The counts of :class:`Report` that are reported (docs/algorithm.md#selection)."""
        r, sel = self._report, self._selection
        if r is None:
            return {}
        out: dict[str, Any] = {"budget": r.budget}
        if r.pinned:
            out["num_pinned"] = int(sel.pinned.size)
        if r.latched and sel.latched is not None:
            out["num_latched"] = int(np.count_nonzero(sel.latched))
        if r.costs is not None:
            out["plan_share"] = int(r.costs[sel.active].sum()) / r.total_cost
        return out

    @property
    def active_mask(self) -> torch.Tensor:
        """bool [U]: True for the units in :attr:`active`."""
        mask = torch.zeros(self._scores.risk.size, dtype=torch.bool)
        mask[list(self._active)] = True
        return mask

    def __repr__(self) -> str:
        return (
            f"Decision(step={self._step}, active={self._active}, alpha={self._alpha}, "
            f"beta={self._beta}, gamma={self._gamma})"
        )
