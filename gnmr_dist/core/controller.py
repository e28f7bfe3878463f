"""The GNMR controller: per-unit risk scores in, a budgeted recovery set out.

Each optimizer step ``t`` the controller receives one vector of U global per-unit gradient norms
(and, with section 2.1's term on, one vector of U error scores) and returns a :class:`Decision`:
the set ``A`` of at most ``max_active`` units that run the recovery path on the *next* step. The
policy (docs/algorithm.md):

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
budget, lock and warm-up rules are unchanged. Choices where the design leaves room
(docs/algorithm.md#differences-from-the-design-card):

* the controller keeps no error state. docs/algorithm.md#damage-term allows errors measured only
  on probe steps and carried forward in between; the *caller* carries them, and
  ``step(norms, errors=e)`` must get a full vector at every step while ``gamma`` is set
  (``errors=None`` then raises ``ValueError``, so a wiring mistake cannot silently turn the term
  off). Passing ``errors``
  without ``gamma`` raises too, naming ``gnmr.gamma``.
* With ``gamma`` unset the term does not exist: no extra op touches the risk, and every score
  and decision is bit-identical to section 2's.

The state is a handful of float64/int64 vectors of length U plus the ``U x window`` window of past
scores, so ``state_dict()`` is plain tensors and ints that load under
``torch.load(weights_only=True)``, and a restored controller makes bit-identical decisions to one
that never stopped. The error term adds nothing to it (see :data:`STATE_VERSION`).

**Speed.** A decision is a few dozen operations on vectors of U floats, so what it costs is the
per-operation overhead, not the arithmetic. The policy runs on numpy arrays (about a microsecond
an operation, against several for a torch op on the CPU), the float64 CPU tensor the runtime
passes is read as a view, the ratio conventions come out of IEEE division with one NaN fix, an
unchanged window is shifted in place, the candidates are sorted only when there are more than
``max_active``, and a :class:`Decision` makes its tensors, candidate tuple and telemetry only when
they are read. ``python -m benchmarks.overhead.controller`` times it against a 25-line numpy twin of
the same policy on one trace, side by side: 0.84-0.91x of the twin's time at U = 28 to 16,384, with
every decision identical. The scores equal :func:`~gnmr_dist.core.scores.risk_scores` (torch)
bit for bit (``tests/core``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gnmr_dist.core.config import GNMRConfig
from gnmr_dist.core.integrity import open_state, seal
from gnmr_dist.core.state import check_state

__all__ = ["Decision", "GNMRController", "Telemetry"]

logger = logging.getLogger(__name__)

NormsLike = torch.Tensor | Sequence[float] | Any

_VECTORS = {
    "norms": ("per-unit norms", "they are L2 norms"),
    "errors": ("per-unit error scores", "they are error magnitudes, docs/algorithm.md#damage-term"),
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
    non-finite ``e`` included). Always 0 without ``gamma`` (docs/algorithm.md#damage-term)."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: value}`` for loggers and JSON traces."""
        return {k: float(v) for k, v in self.__dict__.items()}


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
        "_arrays",
        "_beta",
        "_cache",
        "_gamma",
        "_num_locked",
        "_step",
    )

    def __init__(
        self,
        step: int,
        active: tuple[int, ...],
        alpha: float,
        beta: float,
        gamma: float | None,
        arrays: dict[str, np.ndarray],
        num_locked: int,
    ) -> None:
        self._step, self._active, self._alpha, self._beta = step, active, alpha, beta
        self._gamma, self._arrays, self._num_locked = gamma, arrays, num_locked
        self._cache: dict[str, Any] = {}

    @property
    def step(self) -> int:
        """1-based optimizer step whose gradients were scored."""
        return self._step

    @property
    def active(self) -> tuple[int, ...]:
        """Ascending ids of the units on the recovery path for the next step."""
        return self._active

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
        """``gamma_t`` used at this step; ``None`` when the section 2.1 term is off."""
        return self._gamma

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self._arrays[key])
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
        return None if self._arrays.get("error") is None else self._tensor("error")

    @property
    def candidates(self) -> tuple[int, ...]:
        """Ascending ids of the candidate pool."""
        if "candidates" not in self._cache:
            ids = np.flatnonzero(self._arrays["candidates"])
            self._cache["candidates"] = tuple(ids.tolist())
        return self._cache["candidates"]  # type: ignore[no-any-return]

    @property
    def telemetry(self) -> Telemetry:
        """Summary counts for logging (computed when first read)."""
        if "telemetry" not in self._cache:
            self._cache["telemetry"] = self._telemetry()
        return self._cache["telemetry"]  # type: ignore[no-any-return]

    def _telemetry(self) -> Telemetry:
        a = self._arrays
        error_exceed = 0
        if a.get("error") is not None and self._gamma is not None:
            error_exceed = int(np.count_nonzero(a["error"] / self._gamma > 1.0))
        return Telemetry(
            num_exceed=int(np.count_nonzero(a["exceed"])),
            num_exceed_eligible=int(np.count_nonzero(a["exceed"] & a["eligible"])),
            num_candidates=int(np.count_nonzero(a["candidates"])),
            num_active=len(self._active),
            num_locked=self._num_locked,
            num_nonfinite=int(a["finite"].size - np.count_nonzero(a["finite"])),
            max_risk=float(a["risk"].max()),
            num_error_exceed=error_exceed,
        )

    @property
    def active_mask(self) -> torch.Tensor:
        """bool [U]: True for the units in :attr:`active`."""
        mask = torch.zeros(self._arrays["risk"].size, dtype=torch.bool)
        mask[list(self._active)] = True
        return mask

    def __repr__(self) -> str:
        return (
            f"Decision(step={self._step}, active={self._active}, alpha={self._alpha}, "
            f"beta={self._beta}, gamma={self._gamma})"
        )


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


def _array(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A numpy copy of a loaded state tensor (whatever its autograd flag or layout)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous().numpy().copy()


def _fast_vector(values: NormsLike, num_units: int) -> np.ndarray | None:
    """The float64 host vector itself when ``values`` already is one of ``num_units`` entries
    (what the runtime passes: no copy, no conversion); ``None`` for anything else."""
    if isinstance(values, torch.Tensor):
        ok = values.dtype == torch.float64 and values.device.type == "cpu"
        if ok and values.dim() == 1 and values.numel() == num_units:
            return values.detach().numpy()
        return None
    if (
        isinstance(values, np.ndarray)
        and values.dtype == np.float64
        and values.shape == (num_units,)
    ):
        return values
    return None


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
        self.eligible = self._check_eligible(eligible)
        self.reset()

    @property
    def eligible(self) -> torch.Tensor:
        """bool [U]: units with a recovery path (scored, but never selected when False)."""
        return self._eligible_t

    @eligible.setter
    def eligible(self, mask: torch.Tensor) -> None:
        self._eligible_t = mask
        self._eligible = mask.numpy()  # a view: the policy reads it every step

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
        n = self._check_vector(norms, "norms")
        t = self._step + 1
        alpha, beta = self.config.thresholds_at(t)
        gamma = self.config.gamma_at(t)
        e = self._check_errors(errors, gamma)
        finite = np.isfinite(n)
        gnmr, dgnmr, risk = self._scores(n, finite, alpha, beta, e, gamma)
        exceed = risk > 1.0
        cand_mask, active = self._select(t, risk, exceed)
        self._record(n, gnmr, finite)
        self._step = t
        arrays = {
            "gnmr": gnmr,
            "delta_gnmr": dgnmr,
            "risk": risk,
            "exceed": exceed,
            "error": e,
            "candidates": cand_mask,
            "eligible": self._eligible,
            "finite": finite,
        }
        locked = int(np.count_nonzero(self._lock[active]))
        return Decision(t, tuple(active.tolist()), alpha, beta, gamma, arrays, locked)

    def _check_vector(self, values: NormsLike, name: str) -> np.ndarray:
        """``values`` as a float64 host vector of U entries >= 0 (non-finite allowed)."""
        x = _fast_vector(values, self.num_units)
        if x is None:
            x = self._checked_vector(values, name)
        if not x.min() >= 0:  # one pass (False for NaN too); the rare cases are looked at closely
            negative = (x < 0) & np.isfinite(x)
            if negative.any():
                unit = int(np.flatnonzero(negative)[0])
                why = _VECTORS[name][1]
                raise ValueError(
                    f"{name} must be >= 0 ({why}); got {float(x[unit])!r} for unit {unit}"
                )
        return x

    def _checked_vector(self, values: NormsLike, name: str) -> np.ndarray:
        """The general path of :meth:`_check_vector`: any tensor, array or sequence."""
        what = _VECTORS[name][0]
        x = _as_tensor(values, name)
        if x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
        if x.dim() != 1 or x.numel() != self.num_units:
            raise ValueError(
                f"{name} must be a 1-D vector of num_units={self.num_units} {what}, "
                f"got shape {list(x.shape)}"
            )
        return x.to(device="cpu", dtype=torch.float64).numpy()

    def _check_errors(self, errors: NormsLike | None, gamma: float | None) -> np.ndarray | None:
        """The scored error vector (non-finite as +inf), or ``None`` without the error term."""
        if gamma is None:
            if errors is not None:
                raise ValueError(
                    "step() got errors but gnmr.gamma is not set: set gnmr.gamma (a number > 0 "
                    "or a schedule) to score them (docs/algorithm.md#damage-term), or stop "
                    "passing errors"
                )
            return None
        if errors is None:
            raise ValueError(
                "gnmr.gamma is set, so step() needs errors=: one error score per unit at every "
                "step (carry the last measured values forward between probe steps), or set "
                "gnmr.gamma to null to leave the error term out"
            )
        e = self._check_vector(errors, "errors")
        return np.where(np.isfinite(e), e, np.inf)

    def _scores(
        self,
        n: np.ndarray,
        finite: np.ndarray,
        alpha: float,
        beta: float,
        e: np.ndarray | None,
        gamma: float | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """GNMR, delta-GNMR and risk, bit for bit :func:`~gnmr_dist.core.scores.risk_scores`.

        The ratio conventions come out of IEEE division with one fix: ``a / b`` is ``a / b`` for
        ``b > 0`` and ``+inf`` for ``a > 0 = b``; ``0 / 0`` and every division by the NaN of an
        empty history (``S / c`` with ``c == 0``: ``S == 0``; ``sum(W) / |W|`` with ``W`` empty)
        is NaN, which becomes the 1.0 both conventions give there. A non-finite norm scores +inf.
        The window is summed oldest to newest (``cumsum`` of the right-aligned buffer), as the
        sequential reference adds it.
        """
        with np.errstate(divide="ignore", invalid="ignore"):
            gnmr = n / (self._sum / self._count)
            np.copyto(gnmr, 1.0, where=np.isnan(gnmr))
            total = np.cumsum(self._wbuf, axis=1)[:, -1]
            dgnmr = gnmr / (total / self._wlen)
            np.copyto(dgnmr, 1.0, where=np.isnan(dgnmr))
        if not finite.all():
            gnmr = np.where(finite, gnmr, np.inf)
            dgnmr = np.where(finite, dgnmr, np.inf)
        risk = np.maximum(gnmr / alpha, dgnmr / beta)
        if e is not None and gamma is not None:
            risk = np.maximum(risk, e / gamma)
        return gnmr, dgnmr, risk

    def _select(
        self, t: int, risk: np.ndarray, exceed: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-4 of the policy: locks count down, candidates, the budgeted active set (by
        risk descending, id ascending: a stable sort of ``-risk``), its locks."""
        cfg = self.config
        lock = self._lock
        lock = np.where(exceed, lock, lock - (lock > 0))
        cand_mask = (exceed | (lock > 0)) & self._eligible
        if t <= cfg.warmup_steps:
            cand_mask[:] = False
        cand_ids = np.flatnonzero(cand_mask)
        if cand_ids.size > cfg.max_active:
            order = np.argsort(-risk[cand_ids], kind="stable")[: cfg.max_active]
            active = np.sort(cand_ids[order])
        else:
            active = cand_ids
        held = np.zeros_like(lock)
        held[active] = np.where(exceed[active], cfg.lock_steps, lock[active])
        self._lock = held
        return cand_mask, active

    def _record(self, n: np.ndarray, gnmr: np.ndarray, finite: np.ndarray) -> None:
        """The history absorbs the step: finite norms into ``S, c``, finite GNMR into ``W``."""
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
