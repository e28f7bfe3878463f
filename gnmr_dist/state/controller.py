"""The controller's part of a saved state: its format, its checks, and how it fits a new policy.

A truncated state, or one of another model (U), window or future format, fails loudly with
what is wrong and what to do; it never loads into a controller that then decides differently.

Format 1 holds the history and the locks; format 2 (:data:`STATE_VERSION`) adds ``latched``,
``lr_peak``, the accounting (``recovered``, ``nonfinite``, ``first_nonfinite``) and the ``plan``
(docs/algorithm.md#state-and-resume). :func:`check_state` returns a format-1 state upgraded: no
latches, a zero peak, zero counts and an empty plan. Inside a run state (:mod:`.run`, format 3)
the controller part carries no plan: the run's ``plan_active`` is the one copy, and
:func:`check_state` leaves the plan's checks to the run's reader (``plan_in_run=True``).

Beyond keys, shapes and dtypes, a state must satisfy what the algorithm implies of any state it
can reach after ``step`` decisions with its saved policy, so that a hand-edited or otherwise
impossible state is refused even where no checksum covers it:

* ``0 <= norm_count(u) <= step`` and ``0 <= window_len(u) <= min(window, step)``;
* ``norm_sum(u)`` finite, ``>= 0``, and 0 where ``norm_count(u) = 0``;
* the window holds finite scores ``>= 0``, right-aligned after zeros;
* ``0 <= lock(u) <= lock_steps``, locks held only by eligible units and by at most ``k_t``
  units (step 4 clears every lock outside ``A_t``; on the lr_decay clock, where ``k_t`` needs
  the learning rate, at most ``max(start, end)``);
* ``0 <= latched(u) <= step``, only on eligible units and with a saved ``latch``; lock and latch
  holders together at most ``k_t`` units and (format 2) all in the plan, itself eligible;
* ``0 <= recovered(u) <= max(step - 1, 0)``; ``nonfinite(u) >= 0`` with ``norm_count(u) +
  nonfinite(u) <= step``; ``first_nonfinite`` ``[0, -1]`` exactly while every ``nonfinite`` is
  0, else a step in ``[1, step]`` and a unit with ``nonfinite >= 1``; ``lr_peak`` finite ``>= 0``.

The saved policy is read with the caller's ``policy_of`` (``GNMRConfig.from_dict``): this layer
knows no policy class, only :class:`Policy`. :func:`fit` fits a checked state to a new policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "STATE_VERSION",
    "Policy",
    "PolicyOf",
    "StateMismatchError",
    "check_invariants",
    "check_state",
    "fit",
    "numpy_copy",
]

STATE_VERSION = 2
"""The format :meth:`GNMRController.state_dict <gnmr_dist.core.controller.GNMRController.
state_dict>` writes; 1 is read too (module docstring)."""


class Policy(Protocol):
    """What the checks and :func:`fit` ask of a policy (``GNMRConfig`` has it)."""

    @property
    def lock_steps(self) -> int: ...

    @property
    def latch(self) -> object | None: ...

    def budget_bound(self, step: int) -> int: ...


PolicyOf = Callable[[Mapping[str, Any]], Policy]
"""A saved ``config`` entry -> its policy; ``TypeError`` or ``ValueError`` when it is none."""

_TENSORS: dict[str, torch.dtype] = {
    "eligible": torch.bool,
    "norm_sum": torch.float64,
    "norm_count": torch.int64,
    "window_buffer": torch.float64,
    "window_len": torch.int64,
    "lock": torch.int64,
}
"""The tensors of format 1 and their dtypes; each of shape ``[num_units]`` but
``window_buffer``, ``[num_units, window]``."""

_TENSORS_2: dict[str, torch.dtype] = {
    "latched": torch.int64,
    "recovered": torch.int64,
    "nonfinite": torch.int64,
    "plan": torch.bool,
    "lr_peak": torch.float64,
    "first_nonfinite": torch.int64,
}
"""The tensors format 2 adds, each ``[num_units]`` but ``lr_peak`` (a 0-dim tensor) and
``first_nonfinite`` (``[2]``: ``[step, unit]``)."""

_SHAPES = {"lr_peak": (), "first_nonfinite": (2,)}
"""The tensors not shaped ``[num_units]`` (besides ``window_buffer``)."""

_KEYS = ("version", "num_units", "step", "config", *_TENSORS)
"""Every key a state of either format must have."""

_OTHER_MODEL = "the state was saved for another model: resume with the model it was saved for"


class StateMismatchError(ValueError):
    """A readable, intact state saved under other settings (unit count, window, format): not
    corruption, so the fix is the settings it was saved with, not another copy of the file."""


def _expect_tensor(
    state: Mapping[str, Any], key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    value = state[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"GNMR state is corrupted: {key!r} is {type(value).__name__}, not a tensor"
        )
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise StateMismatchError(
            f"GNMR state does not fit: {key!r} is {value.dtype} {list(value.shape)}, "
            f"expected {dtype} {list(shape)}; {_OTHER_MODEL}"
        )


def _corrupted(field: str, detail: str) -> ValueError:
    return ValueError(f"GNMR state is corrupted: {field} {detail}")


def _refuse(bad: torch.Tensor, entry: str, detail: Callable[[int], str]) -> None:
    """The error naming ``entry[u]`` of the first unit ``u`` that ``bad`` marks, if any."""
    if bool(bad.any()):
        u = _first(bad)
        raise _corrupted(f"{entry}[{u}]", detail(u))


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0])


def _check_counts(state: Mapping[str, Any], window: int, step: int) -> None:
    count, wlen = state["norm_count"], state["window_len"]
    bad = (count < 0) | (count > step)
    _refuse(bad, "norm_count", lambda u: f"= {int(count[u])} is outside [0, step={step}]")
    bad = (wlen < 0) | (wlen > min(window, step))
    _refuse(
        bad,
        "window_len",
        lambda u: f"= {int(wlen[u])} is outside [0, min(window={window}, step={step})]",
    )


def _check_history(state: Mapping[str, Any], window: int) -> None:
    total, count = state["norm_sum"], state["norm_count"]
    bad = ~torch.isfinite(total) | (total < 0) | ((count == 0) & (total != 0))
    _refuse(
        bad,
        "norm_sum",
        lambda u: (
            f"= {float(total[u])!r} with norm_count {int(count[u])} (a sum of recorded norms "
            "is finite, >= 0 and 0 before the first)"
        ),
    )
    buf, wlen = state["window_buffer"], state["window_len"]
    slot = torch.arange(window).unsqueeze(0)
    padding = slot < (window - wlen).unsqueeze(1)
    bad = ~torch.isfinite(buf) | (buf < 0) | (padding & (buf != 0))
    if bool(bad.any()):
        u, i = (int(v) for v in bad.nonzero()[0])
        raise _corrupted(
            f"window_buffer[{u}, {i}]",
            f"= {float(buf[u, i])!r} with window_len {int(wlen[u])} (the window holds finite "
            "scores >= 0, right-aligned after zeros)",
        )


def _saved_policy(config: Mapping[str, Any], policy_of: PolicyOf) -> Policy:
    try:
        return policy_of(config)
    except (TypeError, ValueError) as err:
        raise _corrupted("config", f"is not a policy ({err})") from None


def _check_locks(state: Mapping[str, Any], policy: Policy, step: int) -> None:
    lock, eligible = state["lock"], state["eligible"]
    lock_steps, budget = policy.lock_steps, policy.budget_bound(step)
    bad = (lock < 0) | (lock > lock_steps) | ((lock > 0) & ~eligible)
    _refuse(
        bad,
        "lock",
        lambda u: (
            f"= {int(lock[u])} (locks lie in [0, lock_steps={lock_steps}] and only eligible "
            f"units hold one; unit {u} eligible: {bool(eligible[u])})"
        ),
    )
    held = int((lock > 0).sum())
    if held > budget:
        raise _corrupted("lock", f"is held by {held} units, more than max_active={budget}")


def _check_latches(state: Mapping[str, Any], policy: Policy, step: int) -> None:
    latched, eligible = state["latched"], state["eligible"]
    bad = (latched < 0) | (latched > step) | ((latched > 0) & ~eligible)
    if policy.latch is None:
        bad |= latched != 0
    _refuse(
        bad,
        "latched",
        lambda u: (
            f"= {int(latched[u])} (a latch is a step in [0, step={step}], held only by eligible "
            f"units and only with a latch in the policy; unit {u} eligible: "
            f"{bool(eligible[u])}, latch: {policy.latch})"
        ),
    )
    held = (state["lock"] > 0) | (latched > 0)
    if int(held.sum()) > policy.budget_bound(step):
        raise _corrupted(
            "latched",
            f"with the locks is held by {int(held.sum())} units, more than "
            f"max_active={policy.budget_bound(step)}",
        )
    plan = state.get("plan")
    if plan is None:  # inside a run state: read_run checks plan_active against these holders
        return
    if state["version"] >= 2:
        _refuse(held & ~plan, "plan", lambda u: "is False for a lock or latch holder")
    _refuse(plan & ~eligible, "plan", lambda u: "is True for an ineligible unit")


def _check_accounting(state: Mapping[str, Any], step: int) -> None:
    rec, bad_n, count = state["recovered"], state["nonfinite"], state["norm_count"]
    bad = (rec < 0) | (rec > max(step - 1, 0))
    _refuse(bad, "recovered", lambda u: f"= {int(rec[u])} is outside [0, step - 1]")
    bad = (bad_n < 0) | (count + bad_n > step)
    _refuse(
        bad,
        "nonfinite",
        lambda u: (
            f"= {int(bad_n[u])} with norm_count {int(count[u])} (every step's norm is finite "
            f"or not: the two add up to at most step={step})"
        ),
    )
    _check_first_nonfinite(state, step)
    peak = float(state["lr_peak"])
    if not math.isfinite(peak) or peak < 0:
        raise _corrupted("lr_peak", f"= {peak!r} is not a finite number >= 0")


def _check_first_nonfinite(state: Mapping[str, Any], step: int) -> None:
    (at, unit), counts = state["first_nonfinite"].tolist(), state["nonfinite"]
    if not bool((counts > 0).any()):
        ok = (at, unit) == (0, -1)
    else:
        ok = 1 <= at <= step and 0 <= unit < counts.numel() and int(counts[unit]) >= 1
    if not ok:
        raise _corrupted(
            "first_nonfinite",
            f"= [{at}, {unit}] (it is [0, -1] while no norm was non-finite, else [step, unit] "
            "of the first: a step in [1, step] and a unit whose nonfinite count is >= 1)",
        )


def check_invariants(state: Mapping[str, Any], window: int, policy_of: PolicyOf) -> None:
    """Raise ``ValueError`` naming the first entry of a (well-shaped, format-2 or upgraded)
    state that no run of the algorithm can reach (module docstring); ``policy_of`` reads the
    saved policy."""
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _corrupted("step", f"= {step!r} is not an integer >= 0")
    _check_counts(state, window, step)
    _check_history(state, window)
    policy = _saved_policy(state["config"], policy_of)
    _check_locks(state, policy, step)
    _check_latches(state, policy, step)
    _check_accounting(state, step)


def _upgraded(state: Mapping[str, Any], num_units: int) -> dict[str, Any]:
    """A format-1 state in format 2: no latches, a zero peak, zero counts, an empty plan."""
    zeros = torch.zeros(num_units, dtype=torch.int64)
    return {
        **state,
        "latched": zeros,
        "recovered": zeros.clone(),
        "nonfinite": zeros.clone(),
        "plan": torch.zeros(num_units, dtype=torch.bool),
        "lr_peak": torch.tensor(0.0, dtype=torch.float64),
        "first_nonfinite": torch.tensor([0, -1]),
    }


def check_state(
    state: Mapping[str, Any],
    num_units: int,
    window: int,
    policy_of: PolicyOf,
    *,
    plan_in_run: bool = False,
) -> dict[str, Any]:
    """``state`` in format 2 (upgraded from 1) after checking it fits (``num_units``,
    ``window``) and every invariant; ``ValueError`` (:class:`StateMismatchError` for an intact
    state saved under other settings) naming the entry otherwise. ``policy_of`` reads the saved
    policy. ``plan_in_run``: the controller part of a run state, whose plan is the run's
    ``plan_active``: returned without a ``plan``, which the caller checks and adds."""
    if not isinstance(state, Mapping):
        raise ValueError(f"GNMR state must be a dict, got {type(state).__name__}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"GNMR state is corrupted or not a GNMR state: missing {missing}")
    version = state["version"]
    if version not in (1, STATE_VERSION) or isinstance(version, bool):
        raise StateMismatchError(
            f"GNMR state has format version {version!r}; this gnmr-dist reads versions 1 and "
            f"{STATE_VERSION}: resume with the gnmr-dist release that wrote it"
        )
    added = {k: v for k, v in _TENSORS_2.items() if not (plan_in_run and k == "plan")}
    missing = [k for k in added if k not in state] if version == 2 else []
    if missing:
        raise ValueError(f"GNMR state is corrupted: format 2 without {missing}")
    _check_fit(state, num_units, window)
    full = dict(state) if version == 2 else _upgraded(state, num_units)
    if plan_in_run:
        full.pop("plan", None)  # a format-2 run's copy; plan_active is the one read
    for key, dtype in {**_TENSORS, **added}.items():
        shape = (num_units, window) if key == "window_buffer" else (num_units,)
        _expect_tensor(full, key, _SHAPES.get(key, shape), dtype)
    check_invariants(full, window, policy_of)
    return full


def _check_fit(state: Mapping[str, Any], num_units: int, window: int) -> None:
    if state["num_units"] != num_units:
        raise StateMismatchError(
            f"GNMR state has num_units={state['num_units']}, this controller has {num_units}; "
            f"{_OTHER_MODEL}"
        )
    if not isinstance(state["config"], Mapping):
        raise ValueError(f"GNMR state is corrupted: config is {type(state['config']).__name__}")
    saved_window = state["config"].get("window")
    if saved_window != window:
        raise StateMismatchError(
            f"GNMR state was saved with window={saved_window}, the config has window={window}; "
            f"the window length cannot change on resume: set gnmr.window back to {saved_window}"
        )


def numpy_copy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A numpy copy of a checked state tensor (whatever its autograd flag or layout)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous().numpy().copy()


def fit(
    state: Mapping[str, Any], eligible: np.ndarray, pinned: np.ndarray, policy: Policy
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lock, latched, plan ids)`` of a checked format-2 ``state`` under the current
    ``policy``: the one rule a resume applies, where the saved and the current policy (or
    eligibility, or pinned units) differ.

    Locks at most ``lock_steps``; locks and latches only on ``eligible`` units, latches only
    with a ``latch``; both held by at most ``k_t`` units of the saved step (the latched first by
    latch step, then the locks largest first, ties to the lower id). The plan keeps those
    holders, the saved units ``pinned`` now (outside the budget; ids of eligible pinned units),
    then the other saved eligible units up to ``k_t``. What the next decision would enforce
    anyway, applied at load so that the restored state satisfies this policy's invariants and a
    state saved right after loads again; a no-op when nothing changed, so the resumed run is the
    uninterrupted one."""
    step = int(state["step"])
    lock = numpy_copy(state["lock"], torch.int64)
    lock = np.where(eligible, np.minimum(lock, policy.lock_steps), 0)
    latched = numpy_copy(state["latched"], torch.int64)
    latched = np.where(eligible & (policy.latch is not None), latched, 0)
    held = np.flatnonzero((lock > 0) | (latched > 0))
    budget = policy.budget_bound(step)
    if held.size > budget:
        # the latched first (earliest latch first), then the longest locks, ties to the lower id
        late = np.where(latched[held] > 0, latched[held], np.iinfo(np.int64).max)
        drop = held[np.lexsort((held, -lock[held], late))[budget:]]
        lock[drop], latched[drop] = 0, 0
    saved = np.flatnonzero(numpy_copy(state["plan"], torch.bool))
    holds = (lock[saved] > 0) | (latched[saved] > 0)
    is_pinned = np.isin(saved, pinned) & ~holds
    rest = saved[eligible[saved] & ~holds & ~is_pinned]
    # the plan's room is k_t of the step it runs at; a fresh state (step 0) plans step 1's
    room = max(0, policy.budget_bound(max(step, 1)) - int(holds.sum()))
    plan = np.concatenate([saved[holds], saved[is_pinned], rest[:room]])
    return lock, latched, np.sort(plan).astype(np.int64)
