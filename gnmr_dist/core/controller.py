"""The GNMR controller: per-unit gradient norms in, a budgeted recovery plan out.

Each optimizer step ``t`` :meth:`GNMRController.step` receives one vector of U global per-unit
gradient norms (with ``GNMRConfig(gamma=...)`` one vector of U error scores ``e_t``, and on the
lr_decay clock the learning rate ``lr_t``) and returns a
:class:`~gnmr_dist.core.decision.Decision`: the plan ``R_t = A_t + P_t`` of units that run the
recovery path on the *next* step, ``A_t`` the budgeted choice and ``P_t`` the pinned units. The
decision itself is :mod:`gnmr_dist.core.policy` (docs/algorithm.md: Scores, Risk, Selection steps
1-4); this class holds what the policy reads and what outlives a step:

* the history (``S``, ``c``, the window ``W`` of past GNMR values), the locks and the latches.
  After each decision the history absorbs the step (docs/algorithm.md#history-update): finite
  norms enter the running sum, finite GNMR values enter the window; a non-finite norm is not
  recorded, so one overflow does not poison a unit's mean for the rest of training;
* the learning-rate peak ``max(lr_1..lr_t)`` of the lr_decay clock, and the accounting
  (docs/algorithm.md#accounting): per unit the steps it ran recovered and the steps its norm
  was non-finite, and the first non-finite event;
* the units' fixed inputs: eligibility, the pinned mask, the costs ``w(u)`` and ``W`` of the
  compute-share budget;
* the checkpoint. The state is a handful of float64/int64 vectors of length U plus the
  ``U x window`` window, so :meth:`~GNMRController.state_dict` is plain tensors and ints that
  load under ``torch.load(weights_only=True)``, and a restored controller makes bit-identical
  decisions to one that never stopped.

The damage term keeps no state here: the caller carries ``e_t`` between probe steps and passes a
full vector at every step while ``gamma`` is set (:mod:`gnmr_dist.core.inputs` refuses a missing
one, and errors without ``gamma``). With ``gamma``, ``max_share``, ``latch`` and ``pinned`` unset
and a number for ``max_active`` no extra operation touches the decision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gnmr_dist.core import policy
from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.decision import Decision, Report, Scores
from gnmr_dist.core.inputs import (
    NormsLike,
    costs_from_sizes,
    eligible_mask,
    error_vector,
    learning_rate,
    pinned_mask,
    unit_costs,
    unit_vector,
)
from gnmr_dist.state import STATE_VERSION, check_state, fit, numpy_copy, open_state, seal

__all__ = ["STATE_VERSION", "GNMRController"]

logger = logging.getLogger(__name__)


class GNMRController:
    """Budgeted recovery controller over ``num_units`` units (docs/algorithm.md).

    Args:
        num_units: number of units U (ids ``0..U-1``, identical on every rank).
        config: the policy; defaults to ``GNMRConfig()``.
        eligible: optional bool mask of length U; units without a recovery path are scored but
            never selected. ``None`` means every unit is eligible.
        costs: ``w(u)``, one integer >= 1 per unit: the multiply-accumulates per token of the
            GEMMs its recovery covers (docs/algorithm.md#compute-share). With ``total_cost``;
            needed by ``max_share``, and without it only reported (``Telemetry.plan_share``).
        total_cost: ``W``, an integer >= ``sum(costs)``: three times the units' summed
            ``in x out`` (every GEMM of every unit), the denominator of every share.
        pinned: bool mask of length U of the units ``config.pinned`` names (resolve it with
            ``config.pinned.mask(unit_names)``); may be left out for ``"units": "all"`` and
            is refused without ``config.pinned``.
    """

    def __init__(
        self,
        num_units: int,
        config: GNMRConfig | None = None,
        eligible: NormsLike | None = None,
        *,
        costs: NormsLike | None = None,
        total_cost: int | None = None,
        pinned: NormsLike | None = None,
    ) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        self.num_units = num_units
        self.config = cfg = config if config is not None else GNMRConfig()
        self._costs = unit_costs(costs, total_cost, num_units)
        if cfg.max_share is not None and self._costs is None:
            raise ValueError(
                "gnmr.max_share needs the units' costs: GNMRController(..., costs=w, "
                "total_cost=W) (docs/algorithm.md#compute-share), or set max_share to null"
            )
        units = None if cfg.pinned is None else cfg.pinned.units
        self._pinned_mask = pinned_mask(pinned, units, num_units)
        self._lr_keys = cfg.lr_keys()
        self.eligible = eligible_mask(eligible, num_units)
        self.reset()

    @classmethod
    def for_units(
        cls,
        names: Sequence[str],
        config: GNMRConfig | None = None,
        eligible: NormsLike | None = None,
        *,
        sizes: Sequence[int] | None = None,
        gemms: int = 3,
    ) -> GNMRController:
        """The controller over the units ``names`` (in id order), with the inputs the policy
        derives from them: the ``pinned`` mask (``config.pinned.mask(names)``) and, with
        ``sizes`` (each unit's summed ``in x out``), the compute-share costs of
        :func:`~gnmr_dist.core.inputs.costs_from_sizes` for a recovery of ``gemms`` GEMMs.

        The one constructor of a run's controller: every integration builds it from its unit
        registry, and a replay rebuilds it from a trace's header, so the two cannot differ.
        ``gnmr.max_share`` without ``sizes`` is refused by the constructor."""
        cfg = config if config is not None else GNMRConfig()
        w, total = costs_from_sizes(sizes, gemms) if sizes is not None else (None, None)
        pinned = None if cfg.pinned is None else cfg.pinned.mask(list(names))
        return cls(len(names), cfg, eligible, costs=w, total_cost=total, pinned=pinned)

    @property
    def eligible(self) -> torch.Tensor:
        """bool [U]: units with a recovery path (scored, but never selected when False)."""
        return self._eligible_t

    @eligible.setter
    def eligible(self, mask: torch.Tensor) -> None:
        self._eligible_t = mask
        self._eligible = mask.numpy()  # a view: the policy reads it every step
        pins = self._pinned_mask
        cost, total = self._costs if self._costs is not None else (None, 0)
        ids = np.flatnonzero(pins & self._eligible) if pins is not None else np.zeros(0, np.int64)
        self._units = policy.Units(self._eligible, ids, cost, total)
        self._report = self._base_report()

    def _base_report(self) -> Report | None:
        """Which second-policy counts the telemetry reports (``None``: none, as before them)."""
        cfg, (cost, total) = self.config, self._units[2:]
        plain = cost is None and cfg.pinned is None and cfg.latch is None
        if plain and isinstance(cfg.max_active, int):
            return None
        return Report(None, cost, total, cfg.pinned is not None, cfg.latch is not None)

    def reset(self) -> None:
        """Forget all history, locks, latches, the accounting and the step counter."""
        u, w = self.num_units, self.config.window
        self._step = 0
        self._sum = np.zeros(u, dtype=np.float64)
        self._count = np.zeros(u, dtype=np.int64)
        self._wbuf = np.zeros((u, w), dtype=np.float64)
        self._wlen = np.zeros(u, dtype=np.int64)
        self._lock = np.zeros(u, dtype=np.int64)
        self._latched = np.zeros(u, dtype=np.int64)
        self._lr_peak = 0.0
        self._recovered = np.zeros(u, dtype=np.int64)
        self._nonfinite = np.zeros(u, dtype=np.int64)
        self._first_nonfinite = (0, -1)
        self._plan = np.zeros(0, dtype=np.int64)

    @property
    def step_count(self) -> int:
        """Number of decisions taken so far (the next decision is ``step_count + 1``)."""
        return self._step

    @property
    def locks(self) -> torch.Tensor:
        """int64 [U]: a copy of the lock counters."""
        return torch.from_numpy(self._lock.copy())

    @property
    def latches(self) -> torch.Tensor:
        """int64 [U]: a copy of the step each unit was latched at (0: not latched)."""
        return torch.from_numpy(self._latched.copy())

    @property
    def plan(self) -> tuple[int, ...]:
        """``R_t`` of the last decision: the ids on the recovery path for the next step."""
        return tuple(self._plan.tolist())

    @property
    def recovered(self) -> torch.Tensor:
        """int64 [U]: steps each unit ran on the recovery path (docs/algorithm.md#accounting)."""
        return torch.from_numpy(self._recovered.copy())

    @property
    def nonfinite(self) -> torch.Tensor:
        """int64 [U]: steps whose norm of each unit was NaN or +-inf."""
        return torch.from_numpy(self._nonfinite.copy())

    @property
    def first_nonfinite(self) -> tuple[int, int] | None:
        """``(step, lowest unit id)`` of the run's first non-finite norm; ``None``: none yet."""
        return None if self._first_nonfinite[0] == 0 else self._first_nonfinite

    def step(
        self, norms: NormsLike, *, errors: NormsLike | None = None, lr: float | None = None
    ) -> Decision:
        """Score one step's per-unit global gradient norms and choose the next plan.

        ``norms`` is a 1-D tensor/array/sequence of U values >= 0 (NaN and +-inf allowed: such
        units score +inf and their history is left untouched). A tensor on an accelerator is
        copied to the host once (the decision is needed there anyway).

        ``errors`` are the damage term's error scores ``e_t``, one per unit, in the same form as
        ``norms`` (>= 0; a non-finite value gives risk +inf). They are required while
        ``config.gamma`` is set (carry the last measured values forward between probe steps) and
        refused while it is not; they never enter the norm history.

        ``lr`` is the learning rate the optimizer applied at this step (its first parameter
        group), required while a schedule or condition runs on the lr_decay clock. Given
        without one it is accepted and only its peak is kept (in the state), so an integration
        may pass it at every step and a resume may turn such a schedule on.
        """
        n = unit_vector(norms, self.num_units, "norms")
        t = self._step + 1
        decay, peak = self._decay(lr)
        at = self.config.at(t, decay)
        e = error_vector(errors, at.gamma, self.num_units)
        history = (self._sum, self._count, self._wbuf, self._wlen)
        scores = policy.score(n, history, (at.alpha, at.beta, at.gamma), e)
        latched = self._latched if self.config.latch is not None else None
        selection = policy.select(t, at, scores, (self._lock, latched), self._units, self.config)
        self._account(t, scores)
        self._lock, self._plan, self._lr_peak = selection.lock, selection.active, peak
        if selection.latched is not None:
            self._latched = selection.latched
        self._record(n, scores.gnmr, scores.finite)
        self._step = t
        report = self._report
        if report is not None and not isinstance(self.config.max_active, int):
            report = report._replace(budget=at.k)
        return Decision(t, (at.alpha, at.beta, at.gamma), scores, selection, self._eligible, report)

    def _decay(self, lr: float | None) -> tuple[float | None, float]:
        """``(d_t, max(lr_1..lr_t))`` of the lr_decay clock; ``d_t`` is ``None`` without ``lr``
        (docs/algorithm.md#thresholds-and-schedules)."""
        rate = learning_rate(lr, self._lr_keys)
        if rate is None:
            return None, self._lr_peak
        peak = max(self._lr_peak, rate)
        return (0.0 if peak == 0 else 1.0 - rate / peak), peak

    def _account(self, t: int, scores: Scores) -> None:
        """docs/algorithm.md#accounting: +1 for every unit of ``R_{t-1}``, +1 for every
        non-finite norm, and the first non-finite event."""
        if self._plan.size:
            self._recovered[self._plan] += 1
        if not scores.all_finite:
            self._nonfinite += ~scores.finite
            if self._first_nonfinite[0] == 0:
                self._first_nonfinite = (t, int(np.argmin(scores.finite)))

    def _record(self, n: np.ndarray, gnmr: np.ndarray, finite: np.ndarray) -> None:
        """The history absorbs the step (docs/algorithm.md#history-update): finite norms into
        ``S, c``, finite GNMR into ``W``. The window shifts in place when every unit pushes."""
        np.add(self._sum, n, out=self._sum, where=finite)
        self._count += finite
        push = np.isfinite(gnmr)
        if push.all():
            self._wbuf[:, :-1] = self._wbuf[:, 1:]
            self._wbuf[:, -1] = gnmr
            np.minimum(self._wlen + 1, self.config.window, out=self._wlen)
            return
        shifted = np.concatenate([self._wbuf[:, 1:], gnmr[:, None]], axis=1)
        self._wbuf = np.where(push[:, None], shifted, self._wbuf)
        self._wlen = np.where(push, np.minimum(self._wlen + 1, self.config.window), self._wlen)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """:meth:`snapshot`, sealed (:func:`gnmr_dist.state.seal`): the dict a caller of the
        bare controller hands to ``torch.save``. Plain tensors, ints and a JSON-like config:
        safe for ``weights_only=True`` loads."""
        return seal(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The state as plain data, a copy, unsealed: format
        :data:`~gnmr_dist.state.STATE_VERSION` (2, docs/algorithm.md#state-and-resume), the
        history and locks of format 1, then the latches, the learning-rate peak, the accounting
        and the plan that runs next. A runtime saves it as one part of its run state
        (:mod:`gnmr_dist.state.run`), which is sealed once."""
        plan = np.zeros(self.num_units, dtype=bool)
        plan[self._plan] = True
        arrays = {
            "norm_sum": self._sum,
            "norm_count": self._count,
            "window_buffer": self._wbuf,
            "window_len": self._wlen,
            "lock": self._lock,
            "latched": self._latched,
            "recovered": self._recovered,
            "nonfinite": self._nonfinite,
            "plan": plan,
        }
        return {
            "version": STATE_VERSION,
            "num_units": self.num_units,
            "step": self._step,
            "config": self.config.to_dict(),
            "eligible": self.eligible.clone(),
            **{k: torch.from_numpy(v.copy()) for k, v in arrays.items()},
            "lr_peak": torch.tensor(self._lr_peak, dtype=torch.float64),
            "first_nonfinite": torch.tensor(self._first_nonfinite, dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (format 2, or 1: no latches, a zero learning-rate peak,
        zero counts, an empty plan); raises ``ValueError`` naming what does not fit.

        ``num_units`` and ``window`` must match this controller (they fix the state's shapes).
        Other policy fields may differ: the current config wins and the difference is logged,
        so a run can be resumed with a retuned policy (:func:`gnmr_dist.state.fit` fits the
        saved locks, latches and plan to it).

        The state must match its checksum (``StateIntegrityError``, a ``ValueError``, names
        each altered field) and satisfy the algorithm's invariants (``ValueError`` naming the
        entry, :mod:`gnmr_dist.state.controller`); a state written before checksums existed
        loads with a warning. Nothing is restored from a state that fails.
        """
        body = open_state(state, "GNMR controller state")
        self.restore(check_state(body, self.num_units, self.config.window, GNMRConfig.from_dict))

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take over a *checked* format-2 state (:func:`gnmr_dist.state.check_state`, or the
        controller part of :func:`gnmr_dist.state.read_run`): its step, history and accounting,
        with the locks, latches and plan fitted to the current policy."""
        saved_cfg = dict(state["config"])
        if saved_cfg != self.config.to_dict():
            logger.warning(
                "GNMR state was saved with policy %s; continuing with %s",
                saved_cfg,
                self.config.to_dict(),
            )
        if not torch.equal(state["eligible"], self.eligible):
            logger.warning(
                "GNMR state was saved with a different eligibility mask; using the current one"
            )
        self._lock, self._latched, self._plan = fit(
            state, self._eligible, self._units.pinned, self.config
        )
        self._step = int(state["step"])
        self._sum = numpy_copy(state["norm_sum"], torch.float64)
        self._count = numpy_copy(state["norm_count"], torch.int64)
        self._wbuf = numpy_copy(state["window_buffer"], torch.float64)
        self._wlen = numpy_copy(state["window_len"], torch.int64)
        self._lr_peak = float(state["lr_peak"])
        self._recovered = numpy_copy(state["recovered"], torch.int64)
        self._nonfinite = numpy_copy(state["nonfinite"], torch.int64)
        at, unit = state["first_nonfinite"].tolist()
        self._first_nonfinite = (int(at), int(unit))
