"""Hugging Face ``Trainer``: :class:`GNMRCallback`, and GNMR's counts in Trainer's logs.

``Trainer(..., callbacks=[GNMRCallback()])`` is the Trainer-native way in, as the W&B and
CodeCarbon integrations plug in: for a run whose DeepSpeed config holds a ``"gnmr"`` block, the
callback turns GNMR on before Trainer builds its engine (:func:`gnmr_dist.deepspeed.enable`, which
makes ``deepspeed.initialize`` read the block; accelerate looks it up when it prepares the model)
and turns it off when training ends. ``enable()`` itself stays for plain accelerate loops and
scripts.

**Logging over the interval.** Trainer logs every ``logging_steps`` steps and averages its loss
over them; GNMR does the same with its decisions. Every training log entry (the ones with a
``"loss"``) gets, for the decisions since the previous log (:class:`~gnmr_dist.integrations.
session.Interval`): ``gnmr/max_risk`` (the largest risk of the interval), the counts summed
(``gnmr/num_exceed``, ``gnmr/num_exceed_eligible``, ``gnmr/num_active``, ``gnmr/num_nonfinite``,
``gnmr/num_error_exceed``), ``gnmr/recovered_unit_steps``, ``gnmr/recovered/<unit>`` (steps the
unit ran recovery), ``gnmr/global_grad_norm`` (the mean), ``gnmr/steps`` and ``gnmr/step`` (the
last controller step). So an x100 spike at step 6 with ``logging_steps=5`` shows in the entry of
step 10, with the unit that was recovered. ``state.log_history`` also gets
``gnmr/recovered_at``: each recovered unit with the steps it ran recovery at (a mapping, which
``report_to`` loggers would drop as a non-scalar, so it goes to the history only).

The entries are added in ``Trainer.log`` itself (patched by ``enable()``), before it appends to
``state.log_history`` and calls the callbacks' ``on_log``: a user callback runs after the
``report_to`` ones, so an ``on_log`` of its own would be too late for them. The block's
``log.monitor: false`` turns the entries off.

**Nothing is silent.** A run whose DeepSpeed config has an enabled ``"gnmr"`` block but whose
engine carries no GNMR (built before the callback or ``enable()`` could hook it) is warned about
once, when training begins.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from transformers import TrainerCallback

from gnmr_dist.integrations.patching import Patches

__all__ = ["GNMRCallback", "log_entries", "patch", "unpatch"]

logger = logging.getLogger(__name__)

_PATCHES = Patches("gnmr_dist.integrations.deepspeed.trainer")
_HISTORY_KEY = "gnmr/recovered_at"


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
    if not session.block.log.monitor:
        return {}, {}
    return {f"gnmr/{k}": v for k, v in scalars.items()}, steps


def patch() -> None:
    """Wrap ``transformers.Trainer.log`` to add :func:`log_entries` (idempotent)."""
    from transformers import Trainer

    if _PATCHES:
        return
    original = Trainer.log

    @functools.wraps(original)
    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        steps: dict[str, list[int]] = {}
        if "loss" in logs:
            scalars, steps = log_entries(self)
            logs.update(scalars)
        original(self, logs, *args, **kwargs)
        if steps and self.state.log_history:
            self.state.log_history[-1][_HISTORY_KEY] = steps

    _PATCHES.set(Trainer, "log", log)


def unpatch() -> None:
    """Undo :func:`patch` (no-op when not patched)."""
    _PATCHES.restore()


class GNMRCallback(TrainerCallback):
    """Turns GNMR on for a Trainer run whose DeepSpeed config has a ``"gnmr"`` block.

    Usage::

        from gnmr_dist import GNMRCallback

        trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds.json"),
                          train_dataset=data, callbacks=[GNMRCallback()])
        trainer.train()

    GNMR is enabled when the callback is made (Trainer builds its DeepSpeed engine in
    ``train()``, after that) and disabled when training ends, unless it was enabled before.
    """

    def __init__(self) -> None:
        from gnmr_dist.integrations.deepspeed import engine as gds

        self._was_enabled = bool(gds._PATCHES)
        gds.enable()
        self._built = gds.engines_with_gnmr()
        self._warned = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a run without DeepSpeed (GNMR runs inside its engine: the callback would do
        nothing); warn once when the config has no ``"gnmr"`` block, or enables one that no
        engine got since the callback was made (Trainer builds its engine just before this)."""
        from gnmr_dist.integrations.deepspeed import engine as gds

        if not _is_deepspeed(args):
            self.on_train_end(args, state, control)
            raise ValueError(
                "GNMRCallback: TrainingArguments.deepspeed is not set, so this run has no "
                "DeepSpeed engine for GNMR to run in. Give Trainer a DeepSpeed config with a "
                '"gnmr" block (TrainingArguments(deepspeed=...)), or drop the callback'
            )
        block = _ds_block(args)
        if block is None and not self._warned:
            self._warned = True
            logger.warning(
                'gnmr: GNMRCallback is on, but the DeepSpeed config has no "gnmr" block: GNMR '
                'is off for this run (add one, e.g. {"gnmr": {"backend": "act_quant", '
                '"max_active": 2}})'
            )
        built = gds.engines_with_gnmr() > self._built
        if _block_enabled(block) and not built and not self._warned:
            self._warned = True
            logger.warning(
                'gnmr: the DeepSpeed config has an enabled "gnmr" block but this run\'s engine '
                "has no GNMR: it was built before GNMRCallback() (or gnmr_dist.deepspeed."
                "enable()) could hook deepspeed.initialize. Make the callback before the "
                "Trainer, or the block is ignored"
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Disable GNMR again if this callback enabled it."""
        if not self._was_enabled:
            from gnmr_dist.integrations.deepspeed import engine as gds

            gds.disable()


def _is_deepspeed(args: Any) -> bool:
    return bool(getattr(args, "deepspeed", None))


def _ds_block(args: Any) -> Any:
    """The ``"gnmr"`` block of the run's DeepSpeed config (``None`` when there is none)."""
    hf = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf, "config", None)
    if config is None:
        from gnmr_dist.integrations.deepspeed import load_ds_config

        given = getattr(args, "deepspeed", None)
        config = load_ds_config(given) if given else {}
    return config.get("gnmr") if isinstance(config, dict) else None


def _block_enabled(block: Any) -> bool:
    return isinstance(block, dict) and block.get("enabled", True) is not False
