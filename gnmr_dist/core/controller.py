"""The GNMR controller: per-unit gradient norms in, a budgeted recovery set out.

Each optimizer step ``t`` :meth:`GNMRController.step` receives one vector of U global per-unit
gradient norms (and, with ``GNMRConfig(gamma=...)``, one vector of U error scores ``e_t``) and
returns a :class:`~gnmr_dist.core.decision.Decision`: the set ``A`` of at most ``max_active``
units that run the recovery path on the *next* step. The decision itself is
:mod:`gnmr_dist.core.policy` (docs/algorithm.md: Scores, Risk, Selection steps 1-4); this class
holds what the policy reads and what outlives a step:

* the history (``S``, ``c``, the window ``W`` of past GNMR values) and the locks. After each
  decision the history absorbs the step (docs/algorithm.md#history-update): finite norms enter
  the running sum, finite GNMR values enter the window; a non-finite norm is not recorded, so
  one overflow does not poison a unit's mean for the rest of training;
* the checkpoint. The state is a handful of float64/int64 vectors of length U plus the
  ``U x window`` window, so :meth:`~GNMRController.state_dict` is plain tensors and ints that
  load under ``torch.load(weights_only=True)``, and a restored controller makes bit-identical
  decisions to one that never stopped.

The damage term keeps no state here: the caller carries ``e_t`` between probe steps and passes a
full vector at every step while ``gamma`` is set (:mod:`gnmr_dist.core.inputs` refuses a missing
one, and errors without ``gamma``). With ``gamma`` unset no extra operation touches the risk.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from gnmr_dist.core import policy
from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.decision import Decision
from gnmr_dist.core.inputs import NormsLike, eligible_mask, error_vector, unit_vector
from gnmr_dist.core.integrity import open_state, seal
from gnmr_dist.core.state import check_state

__all__ = ["GNMRController"]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
"""Format version of :meth:`GNMRController.state_dict`.

Still 1 with section 2.1: the error term keeps no state (the caller supplies ``e_t`` at every
step), so the state's keys, shapes and dtypes are unchanged and states written before ``gamma``
existed load as they are. ``gamma`` only shows up inside the saved ``"config"`` dict, which is
compared with the current policy and never shapes the state. The ``"checksum"`` entry
(:mod:`gnmr_dist.core.integrity`) is one more key, which earlier releases ignore; states without
it load with a warning. Bump this only when the tensors
change, and keep reading version 1 then.
"""


def _array(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A numpy copy of a loaded state tensor (whatever its autograd flag or layout)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous().numpy().copy()


class GNMRController:
    """Budgeted recovery controller over ``num_units`` units (docs/algorithm.md).

    Args:
        num_units: number of units U (ids ``0..U-1``, identical on every rank).
        config: the policy; defaults to ``GNMRConfig()``.
        eligible: optional bool mask of length U; units without a recovery path are scored but
            never selected. ``None`` means every unit is eligible.
    """

    def __init__(
        self,
        num_units: int,
        config: GNMRConfig | None = None,
        eligible: NormsLike | None = None,
    ) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        self.num_units = num_units
        self.config = config if config is not None else GNMRConfig()
        self.eligible = eligible_mask(eligible, num_units)
        self.reset()

    @property
    def eligible(self) -> torch.Tensor:
        """bool [U]: units with a recovery path (scored, but never selected when False)."""
        return self._eligible_t

    @eligible.setter
    def eligible(self, mask: torch.Tensor) -> None:
        self._eligible_t = mask
        self._eligible = mask.numpy()  # a view: the policy reads it every step

    def reset(self) -> None:
        """Forget all history, locks and the step counter."""
        u, w = self.num_units, self.config.window
        self._step = 0
        self._sum = np.zeros(u, dtype=np.float64)
        self._count = np.zeros(u, dtype=np.int64)
        self._wbuf = np.zeros((u, w), dtype=np.float64)
        self._wlen = np.zeros(u, dtype=np.int64)
        self._lock = np.zeros(u, dtype=np.int64)

    @property
    def step_count(self) -> int:
        """Number of decisions taken so far (the next decision is ``step_count + 1``)."""
        return self._step

    @property
    def locks(self) -> torch.Tensor:
        """int64 [U]: a copy of the lock counters."""
        return torch.from_numpy(self._lock.copy())

    def step(self, norms: NormsLike, *, errors: NormsLike | None = None) -> Decision:
        """Score one step's per-unit global gradient norms and choose the next active set.

        ``norms`` is a 1-D tensor/array/sequence of U values >= 0 (NaN and +-inf allowed: such
        units score +inf and their history is left untouched). A tensor on an accelerator is
        copied to the host once (the decision is needed there anyway).

        ``errors`` are section 2.1's error scores ``e_t``, one per unit, in the same form as
        ``norms`` (>= 0; a non-finite value gives risk +inf). They are required while
        ``config.gamma`` is set (carry the last measured values forward between probe steps) and
        refused while it is not; they never enter the norm history.
        """
        n = unit_vector(norms, self.num_units, "norms")
        t = self._step + 1
        alpha, beta = self.config.thresholds_at(t)
        gamma = self.config.gamma_at(t)
        e = error_vector(errors, gamma, self.num_units)
        history = (self._sum, self._count, self._wbuf, self._wlen)
        scores = policy.score(n, history, (alpha, beta, gamma), e)
        plan = policy.select(t, scores, self._lock, self._eligible, self.config)
        self._lock = plan.lock
        self._record(n, scores.gnmr, scores.finite)
        self._step = t
        return Decision(t, (alpha, beta, gamma), scores, plan, self._eligible)

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
        """Plain tensors, ints and a JSON-like config: safe for ``weights_only=True`` loads.

        Format :data:`STATE_VERSION` (1). The section 2.1 error term stores nothing here: its
        scores come with every :meth:`step` call, so only ``config`` shows ``gamma`` (when set).
        Sealed with a per-field checksum (:mod:`gnmr_dist.core.integrity`).
        """
        return seal(
            {
                "version": STATE_VERSION,
                "num_units": self.num_units,
                "step": self._step,
                "config": self.config.to_dict(),
                "eligible": self.eligible.clone(),
                "norm_sum": torch.from_numpy(self._sum.copy()),
                "norm_count": torch.from_numpy(self._count.copy()),
                "window_buffer": torch.from_numpy(self._wbuf.copy()),
                "window_len": torch.from_numpy(self._wlen.copy()),
                "lock": torch.from_numpy(self._lock.copy()),
            }
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; raises ``ValueError`` naming what does not fit.

        ``num_units`` and ``window`` must match this controller (they fix the state's shapes).
        Other policy fields (budget, thresholds, lock, warm-up, ``gamma``) may differ: the
        current config wins and the difference is logged, so a run can be resumed with a retuned
        policy, with the error term turned on or off. States saved before ``gamma`` existed are
        version 1 too and load unchanged (the error term keeps no state).

        The state must match its checksum (``StateIntegrityError``, a ``ValueError``, names
        each altered field) and satisfy the algorithm's invariants (``ValueError`` naming the
        entry, :mod:`gnmr_dist.core.state`); a state written before checksums existed loads
        with a warning.
        """
        state = open_state(state, "GNMR controller state")
        check_state(state, self.num_units, self.config.window, STATE_VERSION)
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
        self._step = int(state["step"])
        self._sum = _array(state["norm_sum"], torch.float64)
        self._count = _array(state["norm_count"], torch.int64)
        self._wbuf = _array(state["window_buffer"], torch.float64)
        self._wlen = _array(state["window_len"], torch.int64)
        self._lock = _array(self._conformed_locks(state["lock"]), torch.int64)

    def _conformed_locks(self, saved: torch.Tensor) -> torch.Tensor:
        """Saved locks under the current policy: at most ``lock_steps``, only on eligible units,
        held by at most ``max_active`` units (the largest kept, ties to the lower id). What the
        next decision would enforce anyway, applied now so that a state saved before it
        satisfies the invariants of its own config; unchanged when the policy is."""
        cfg = self.config
        lock = torch.where(self.eligible, torch.clamp(saved, max=cfg.lock_steps), 0)
        held = lock.nonzero().flatten()
        if held.numel() > cfg.max_active:
            order = torch.sort(lock[held], descending=True, stable=True).indices
            lock[held[order[cfg.max_active :]]] = 0
        return lock.clone()
