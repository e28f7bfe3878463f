"""Hugging Face ``Trainer``: GNMR's counts in ``Trainer.log``, on Trainer's step axis.

:func:`gnmr_dist.deepspeed.enable` calls :func:`patch` (when transformers is importable), so a
Trainer whose DeepSpeed engine carries ``engine.gnmr`` adds, to each training log entry (the
ones with a ``"loss"``), ``gnmr/<count>`` for every field of the last decision's
:class:`~gnmr_dist.core.controller.Telemetry`, ``gnmr/global_grad_norm`` and ``gnmr/step`` (the
controller's step). ``Trainer.log`` is where every ``report_to`` integration (TensorBoard,
W&B, ...), the console and ``state.log_history`` read from, so the entries reach all of them at
Trainer's ``global_step``. The block's ``log.monitor: false`` turns them off; ``log.every``
thins them to controller steps divisible by it.
"""

from __future__ import annotations

import functools
from typing import Any

from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.session import telemetry_scalars

__all__ = ["log_entries", "patch", "unpatch"]

_PATCHES = Patches("gnmr_dist.integrations.trainer")


def log_entries(trainer: Any) -> dict[str, float]:
    """The ``gnmr/*`` entries for ``trainer``'s next training log (empty without GNMR)."""
    session = getattr(getattr(trainer, "model_wrapped", None), "gnmr", None)
    decision = getattr(session, "last_decision", None)
    if session is None or decision is None or not session.block.log.monitor:
        return {}
    if decision.step % session.block.log.every:
        return {}
    norms = session.runtime.last_norms
    entries = {f"gnmr/{k}": v for k, v in telemetry_scalars(decision, norms.global_norm).items()}
    entries["gnmr/step"] = float(decision.step)
    return entries


def patch() -> None:
    """Wrap ``transformers.Trainer.log`` to add :func:`log_entries` (idempotent)."""
    from transformers import Trainer

    if _PATCHES:
        return
    original = Trainer.log

    @functools.wraps(original)
    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:
            logs.update(log_entries(self))
        original(self, logs, *args, **kwargs)

    _PATCHES.set(Trainer, "log", log)


def unpatch() -> None:
    """Undo :func:`patch` (no-op when not patched)."""
    _PATCHES.restore()
