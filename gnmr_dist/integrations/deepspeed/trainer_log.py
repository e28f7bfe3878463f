"""GNMR's counts in Hugging Face ``Trainer``'s training logs: the ``Trainer.log`` wrapper that
:func:`gnmr_dist.deepspeed.enable` installs (transformers is imported by the caller).

Every training log entry (one with a ``"loss"``) gets the ``gnmr/*`` scalars of the decisions
since the previous log (:class:`~gnmr_dist.integrations.session.Interval`) and the run's
accounting totals, with an entry per unit whose count changed since the previous log
(``gnmr/accounting/*``, :class:`~gnmr_dist.integrations.session.AccountingLog`), and
``state.log_history`` the recovered units' steps under ``gnmr/recovered_at``
(docs/trainer.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["HISTORY_KEY", "log_entries", "with_gnmr_entries"]

HISTORY_KEY = "gnmr/recovered_at"
"""The ``state.log_history`` key of the recovered units' steps (a mapping: ``report_to``
loggers would drop it as a non-scalar, so it goes to the history only)."""


def _session(trainer: Any) -> Any:
    return getattr(getattr(trainer, "model_wrapped", None), "gnmr", None)


def log_entries(trainer: Any) -> tuple[dict[str, float], dict[str, list[int]]]:
    """The ``gnmr/*`` scalars for ``trainer``'s next training log and the recovered units' steps
    (both empty without GNMR, with ``log.monitor: false``, or without a decision since the last
    log); the interval starts afresh."""
    session = _session(trainer)
    if session is None:
        return {}, {}
    scalars, steps = session.interval.drain(session.registry.names)
    if not session.block.log.monitor or not scalars:
        return {}, {}
    names = session.registry.names
    scalars.update(session.trainer_accounting.scalars(session.summary(), names))
    return {f"gnmr/{k}": v for k, v in scalars.items()}, steps


def with_gnmr_entries(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.log`` (``original``) that adds :func:`log_entries` to a training log entry
    before Trainer appends it to ``state.log_history`` and calls the callbacks' ``on_log``."""

    @functools.wraps(original)
    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        steps: dict[str, list[int]] = {}
        if "loss" in logs:
            scalars, steps = log_entries(self)
            logs.update(scalars)
        original(self, logs, *args, **kwargs)
        if steps and self.state.log_history:
            self.state.log_history[-1][HISTORY_KEY] = steps

    return log
