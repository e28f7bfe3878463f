"""The GNMR controller: per-unit risk scores in, a budgeted recovery set out.

Each optimizer step ``t`` the controller receives one vector of U global per-unit gradient norms
(and, with section 2.1's term on, one vector of U error scores) and returns a :class:`Decision`:
the set ``A`` of at most ``max_active`` units that run the recovery path on the *next* step. The
policy (DESIGN.md sections 2 and 2.1):

1. score every unit (GNMR, delta-GNMR, ``risk = max(GNMR / alpha_t, dGNMR / beta_t)``, or with
   ``gamma`` set ``risk = max(GNMR / alpha_t, dGNMR / beta_t, e_t / gamma_t)``);
   ``exceed = risk > 1``;
2. a unit that does not exceed counts its lock down by one;
3. candidates are eligible units that exceed or still hold a lock (none during warm-up);
4. ``A`` = the first ``max_active`` candidates by (risk descending, id ascending);
5. exceeding units in ``A`` get ``lock = lock_steps``; every unit outside ``A`` loses its lock.

The lock keeps a unit that just spiked on the recovery path for ``lock_steps`` decisions even if
its scores fall back at once (no thrashing between paths every other step), while step 5 keeps
the number of lock holders within the budget. Then the history absorbs the step: finite norms
enter the running sum, finite GNMR values enter the window; non-finite norms are not recorded,
so one overflow does not poison a unit's mean for the rest of training.

**The damage-aware term (section 2.1).** GNMR and delta-GNMR compare a unit with its own past,
so a unit that the low-cost path damages at every step never stands out. With
``GNMRConfig(gamma=...)`` the backend also reports ``e_t(u) >= 0``, a dimensionless score of what
the low-cost path does to unit u's gradient, and ``e_t / gamma_t`` becomes a third risk term. A
unit whose error stays above ``gamma_t`` therefore exceeds at every step and, once selected,
keeps its lock and its place in ``A`` (unless riskier units displace it) however flat its norms
are. The error term is absolute and memoryless: it never enters the norm history (S, c and W
are exactly what they would be without it), a non-finite ``e`` scores +inf, and the candidates,
budget, lock and warm-up rules are unchanged. Choices where DESIGN.md leaves room:

* the controller keeps no error state. DESIGN allows errors measured only on probe steps and
  carried forward in between; the *caller* carries them, and ``step(norms, errors=e)`` must get
  a full vector at every step while ``gamma`` is set (``errors=None`` then raises
  ``ValueError``, so a wiring mistake cannot silently turn the term off). Passing ``errors``
  without ``gamma`` raises too, naming ``gnmr.gamma``.
* With ``gamma`` unset the term does not exist: no extra op touches the risk, and every score
  and decision is bit-identical to section 2's.

The state is a handful of float64/int64 vectors of length U plus the ``U x window`` window of past
scores, so ``state_dict()`` is plain tensors and ints that load under
``torch.load(weights_only=True)``, and a restored controller makes bit-identical decisions to one
that never stopped. The error term adds nothing to it (see :data:`STATE_VERSION`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.integrity import open_state, seal
from gnmr_dist.core.scores import error_scores, risk_scores
from gnmr_dist.core.state import check_state

__all__ = ["Decision", "GNMRController", "Telemetry"]

logger = logging.getLogger(__name__)

NormsLike = torch.Tensor | Sequence[float] | Any

_VECTORS = {
    "norms": ("per-unit norms", "they are L2 norms"),
    "errors": ("per-unit error scores", "they are error magnitudes, DESIGN.md section 2.1"),
}
"""What :meth:`GNMRController.step` calls each input vector in its error messages."""

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
    """Size of the active set ``A`` (units on the recovery path next step)."""
    num_locked: int
    """Units holding a lock after the decision (always <= ``max_active``)."""
    num_nonfinite: int
    """Units whose norm was NaN or +-inf at this step."""
    max_risk: float
    """Largest risk over all units (``inf`` when any norm or error score is non-finite)."""
    num_error_exceed: int = 0
    """Units whose error term alone exceeds, ``e_t / gamma_t > 1`` (all units, eligible or not;
    non-finite ``e`` included). Always 0 without ``gamma`` (DESIGN.md section 2.1)."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: value}`` for loggers and JSON traces."""
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Decision:
    """What the controller decided at optimizer step ``step``."""

    step: int
    """1-based optimizer step whose gradients were scored."""
    active: tuple[int, ...]
    """Ascending ids of the units on the recovery path for the next step."""
    candidates: tuple[int, ...]
    """Ascending ids of the candidate pool."""
    gnmr: torch.Tensor
    """float64 [U]: GNMR score of each unit."""
    delta_gnmr: torch.Tensor
    """float64 [U]: delta-GNMR score of each unit."""
    risk: torch.Tensor
    """float64 [U]: ``max(GNMR / alpha_t, dGNMR / beta_t)``, with ``gamma`` set
    ``max(GNMR / alpha_t, dGNMR / beta_t, error / gamma_t)``."""
    exceed: torch.Tensor
    """bool [U]: ``risk > 1``."""
    alpha: float
    """``alpha_t`` used at this step."""
    beta: float
    """``beta_t`` used at this step."""
    telemetry: Telemetry
    """Summary counts for logging."""
    error: torch.Tensor | None = None
    """float64 [U]: the error score ``e_t`` of each unit as scored, i.e. as passed with every
    non-finite value (NaN, +-inf) replaced by +inf; its risk term is ``error / gamma``. Raw like
    :attr:`gnmr` (the threshold is in :attr:`gamma`). ``None`` without ``gamma``."""
    gamma: float | None = None
    """``gamma_t`` used at this step; ``None`` when the section 2.1 term is off."""

    @property
    def active_mask(self) -> torch.Tensor:
        """bool [U]: True for the units in :attr:`active`."""
        mask = torch.zeros(self.risk.numel(), dtype=torch.bool)
        mask[list(self.active)] = True
        return mask


def _as_tensor(values: NormsLike, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach()
    if isinstance(values, Sequence) and any(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must hold real numbers, got booleans: {list(values)[:8]}")
    try:
        if hasattr(values, "dtype"):  # an array keeps its dtype, so a complex one is refused
            return torch.as_tensor(values)
        # Python floats must not pass through torch's float32 default dtype on the way in.
        return torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a 1-D vector of real numbers: {err}") from None


class GNMRController:
    """Budgeted recovery controller over ``num_units`` units (DESIGN.md sections 2 and 2.1).

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
        self.eligible = self._check_eligible(eligible)
        self.reset()

    def _check_eligible(self, eligible: NormsLike | None) -> torch.Tensor:
        if eligible is None:
            return torch.ones(self.num_units, dtype=torch.bool)
        mask = torch.as_tensor(eligible).detach().cpu()
        if mask.dim() != 1 or mask.numel() != self.num_units:
            raise ValueError(
                f"eligible must be a 1-D mask of length num_units={self.num_units}, "
                f"got shape {list(mask.shape)}"
            )
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("eligible must hold booleans (or 0/1)")
            mask = mask.to(torch.bool)
        return mask.clone()

    def reset(self) -> None:
        """Forget all history, locks and the step counter."""
        u, w = self.num_units, self.config.window
        self._step = 0
        self._sum = torch.zeros(u, dtype=torch.float64)
        self._count = torch.zeros(u, dtype=torch.int64)
        self._wbuf = torch.zeros(u, w, dtype=torch.float64)
        self._wlen = torch.zeros(u, dtype=torch.int64)
        self._lock = torch.zeros(u, dtype=torch.int64)

    @property
    def step_count(self) -> int:
        """Number of decisions taken so far (the next decision is ``step_count + 1``)."""
        return self._step

    @property
    def locks(self) -> torch.Tensor:
        """int64 [U]: a copy of the lock counters."""
        return self._lock.clone()

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
        n = self._check_vector(norms, "norms")
        t = self._step + 1
        alpha, beta = self.config.thresholds_at(t)
        gamma = self.config.gamma_at(t)
        e = self._check_errors(errors, gamma)
        gnmr, dgnmr, risk = risk_scores(
            n,
            self._sum,
            self._count,
            self._window_mean(),
            self._wlen,
            alpha,
            beta,
            errors=e,
            gamma=gamma,
        )
        exceed = risk > 1.0
        cand_mask, active = self._select(t, risk, exceed)
        finite = torch.isfinite(n)
        self._record(n, gnmr, finite)
        self._step = t
        return Decision(
            step=t,
            active=tuple(active.tolist()),
            candidates=tuple(cand_mask.nonzero().flatten().tolist()),
            gnmr=gnmr,
            delta_gnmr=dgnmr,
            risk=risk,
            exceed=exceed,
            alpha=alpha,
            beta=beta,
            telemetry=self._telemetry(risk, exceed, cand_mask, active, finite, e, gamma),
            error=e,
            gamma=gamma,
        )

    def _check_vector(self, values: NormsLike, name: str) -> torch.Tensor:
        """``values`` as a float64 host vector of U entries >= 0 (non-finite allowed)."""
        what, why = _VECTORS[name]
        x = _as_tensor(values, name)
        if x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
        if x.dim() != 1 or x.numel() != self.num_units:
            raise ValueError(
                f"{name} must be a 1-D vector of num_units={self.num_units} {what}, "
                f"got shape {list(x.shape)}"
            )
        x = x.to(device="cpu", dtype=torch.float64)
        negative = (x < 0) & torch.isfinite(x)
        if bool(negative.any()):
            unit = int(negative.nonzero()[0])
            raise ValueError(f"{name} must be >= 0 ({why}); got {x[unit].item()!r} for unit {unit}")
        return x

    def _check_errors(self, errors: NormsLike | None, gamma: float | None) -> torch.Tensor | None:
        """The scored error vector (non-finite as +inf), or ``None`` without the error term."""
        if gamma is None:
            if errors is not None:
                raise ValueError(
                    "step() got errors but gnmr.gamma is not set: set gnmr.gamma (a number > 0 "
                    "or a schedule) to score them (DESIGN.md section 2.1), or stop passing errors"
                )
            return None
        if errors is None:
            raise ValueError(
                "gnmr.gamma is set, so step() needs errors=: one error score per unit at every "
                "step (carry the last measured values forward between probe steps), or set "
                "gnmr.gamma to null to leave the error term out"
            )
        return error_scores(self._check_vector(errors, "errors"))

    def _window_mean(self) -> torch.Tensor:
        # The window is right-aligned with zero padding in front, and cumsum adds each row left to
        # right, so the mean is the oldest-to-newest sum: bit-identical to a sequential reference
        # and independent of when a unit skipped a push.
        total = torch.cumsum(self._wbuf, dim=1)[:, -1]
        return total / torch.clamp(self._wlen, min=1).to(torch.float64)

    def _select(
        self, t: int, risk: torch.Tensor, exceed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        self._lock = torch.where(exceed, self._lock, torch.clamp(self._lock - 1, min=0))
        cand_mask = self.eligible & (exceed | (self._lock > 0))
        if t <= cfg.warmup_steps:
            cand_mask = torch.zeros_like(cand_mask)
        cand_ids = cand_mask.nonzero().flatten()
        order = torch.sort(risk[cand_ids], descending=True, stable=True).indices
        active = cand_ids[order[: cfg.max_active]]
        in_active = torch.zeros_like(cand_mask)
        in_active[active] = True
        locked = torch.where(exceed, torch.full_like(self._lock, cfg.lock_steps), self._lock)
        self._lock = torch.where(in_active, locked, torch.zeros_like(self._lock))
        return cand_mask, torch.sort(active).values

    def _record(self, n: torch.Tensor, gnmr: torch.Tensor, finite: torch.Tensor) -> None:
        self._sum = self._sum + torch.where(finite, n, torch.zeros_like(n))
        self._count = self._count + finite.to(torch.int64)
        push = torch.isfinite(gnmr)
        shifted = torch.cat([self._wbuf[:, 1:], gnmr.unsqueeze(1)], dim=1)
        self._wbuf = torch.where(push.unsqueeze(1), shifted, self._wbuf)
        self._wlen = torch.where(
            push, torch.clamp(self._wlen + 1, max=self.config.window), self._wlen
        )

    def _telemetry(
        self,
        risk: torch.Tensor,
        exceed: torch.Tensor,
        cand_mask: torch.Tensor,
        active: torch.Tensor,
        finite: torch.Tensor,
        errors: torch.Tensor | None,
        gamma: float | None,
    ) -> Telemetry:
        error_exceed = 0
        if errors is not None and gamma is not None:
            error_exceed = int((errors / gamma > 1.0).sum())
        return Telemetry(
            num_exceed=int(exceed.sum()),
            num_exceed_eligible=int((exceed & self.eligible).sum()),
            num_candidates=int(cand_mask.sum()),
            num_active=int(active.numel()),
            num_locked=int((self._lock > 0).sum()),
            num_nonfinite=int((~finite).sum()),
            max_risk=float(risk.max()),
            num_error_exceed=error_exceed,
        )

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
                "norm_sum": self._sum.clone(),
                "norm_count": self._count.clone(),
                "window_buffer": self._wbuf.clone(),
                "window_len": self._wlen.clone(),
                "lock": self._lock.clone(),
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
        self._sum = state["norm_sum"].clone()
        self._count = state["norm_count"].clone()
        self._wbuf = state["window_buffer"].clone()
        self._wlen = state["window_len"].clone()
        self._lock = self._conformed_locks(state["lock"])

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
