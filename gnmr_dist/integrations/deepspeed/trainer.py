"""Hugging Face ``Trainer``: :class:`GNMRCallback`.

``Trainer(..., callbacks=[GNMRCallback()])`` is the Trainer-native way in, as the W&B and
CodeCarbon integrations plug in: for a run whose DeepSpeed config holds a ``"gnmr"`` block, the
callback turns GNMR on before Trainer builds its engine (:func:`gnmr_dist.deepspeed.enable`, which
makes ``deepspeed.initialize`` read the block; accelerate looks it up when it prepares the model,
and ``Trainer.log`` adds GNMR's counts: :mod:`~gnmr_dist.integrations.deepspeed.trainer_log`);
when training ends it writes the run's accounting (``engine.gnmr.report()``) and turns GNMR
off. ``enable()`` itself stays for plain accelerate loops and
scripts.

**Nothing is silent.** A run whose DeepSpeed config has an enabled ``"gnmr"`` block but whose
engine carries no GNMR (built before the callback or ``enable()`` could hook it) is warned about
once: by :mod:`~gnmr_dist.integrations.ds_watch` as the engine is built, or else when training
begins.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from gnmr_dist.integrations import ds_watch
from gnmr_dist.integrations.config import check_block_name, read_block
from gnmr_dist.integrations.deepspeed.engine import (
    built_sessions,
    disable,
    enable,
    engines_with_gnmr,
    is_enabled,
    load_ds_config,
    no_block_warned,
)

__all__ = ["GNMRCallback"]

logger = logging.getLogger(__name__)


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
        self._was_enabled = is_enabled()
        enable()
        self._built = engines_with_gnmr()
        self._warned = False
        self._checked = False  # on_init_end ran: its block is kept, not read and built again
        self._block: Any = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the run before any model or data work: at the end of ``Trainer.__init__``."""
        self._block = self._check(args, state, control)
        self._checked = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The checks of :meth:`on_init_end` (for a callback added after the Trainer was made),
        and a warning when the config enables a block that no engine got since the callback
        was made (Trainer builds its engine just before this)."""
        block = self._block if self._checked else self._check(args, state, control)
        built = engines_with_gnmr() > self._built
        if _block_enabled(block) and not built and not self._warned and not ds_watch.warned():
            self._warned = True
            logger.warning(
                'gnmr: the DeepSpeed config has an enabled "gnmr" block but this run\'s engine '
                "has no GNMR: it was built before GNMRCallback() (or gnmr_dist.deepspeed."
                "enable()) could hook deepspeed.initialize. Make the callback before the "
                "Trainer, or the block is ignored"
            )

    def _check(self, args: Any, state: Any, control: Any) -> Any:
        """Refuse a run without DeepSpeed (GNMR runs inside its engine: the callback would do
        nothing) and a bad ``"gnmr"`` block, each in one line with GNMR turned off again; warn
        once, for the callback and the engine together, when the config has no block. Returns
        the block as given (``None``: none)."""
        try:
            if not _is_deepspeed(args):
                raise ValueError(
                    "TrainingArguments.deepspeed is not set, so this run has no DeepSpeed engine "
                    'for GNMR to run in. Give Trainer a DeepSpeed config with a "gnmr" block '
                    "(TrainingArguments(deepspeed=...)), or drop the callback"
                )
            block = _ds_block(args)
            if block is not None:
                read_block(block, "gnmr")  # every key, value and backend option, now
        except ValueError as err:
            self._turn_off()
            message = str(err).removeprefix("GNMRCallback: ")
            raise ValueError(f"GNMRCallback: {message}") from None
        if block is None and not self._warned:
            self._warned = True
            no_block_warned()  # the engine, built later in train(), says nothing more
            logger.warning(
                'gnmr: GNMRCallback is on, but the DeepSpeed config has no "gnmr" block: GNMR '
                'is off for this run (add one, e.g. {"gnmr": {"backend": "act_quant", '
                '"max_active": 2}})'
            )
        return block

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the run's accounting (``engine.gnmr.report()``: recovered shares, non-finite
        unit-steps, the first non-finite unit) of the engines built since the callback was
        made, and disable GNMR again if this callback enabled it."""
        for session in built_sessions(self._built):
            session.report()
        self._turn_off()

    def _turn_off(self) -> None:
        """Disable GNMR again if this callback enabled it."""
        if not self._was_enabled:
            disable()


def _is_deepspeed(args: Any) -> bool:
    return bool(getattr(args, "deepspeed", None))


def _ds_block(args: Any) -> Any:
    """The ``"gnmr"`` block of the run's DeepSpeed config (``None`` when there is none)."""
    hf = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf, "config", None)
    if config is None:
        given = getattr(args, "deepspeed", None)
        config = load_ds_config(given) if given else {}
    if not isinstance(config, dict):
        return None
    check_block_name(config, "GNMRCallback: the DeepSpeed config")
    return config.get("gnmr")


def _block_enabled(block: Any) -> bool:
    return isinstance(block, dict) and block.get("enabled", True) is not False
