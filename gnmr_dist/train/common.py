"""What the training programs share beyond the integrations: logging set-up and the next-token
loss. Both read their ``"gnmr"`` block through the one reader,
:func:`gnmr_dist.integrations.config.read_block`, in their preflight, and hand the parsed block
(with the backend built while checking it) to the integration: nothing is parsed twice."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from gnmr_dist.integrations.console import LOGGER as CONSOLE

__all__ = ["next_token_loss", "setup_logging"]

_NOISY = ("DeepSpeed", "deepspeed", "torch.distributed")
_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    """The programs' format, except GNMR's console line, which carries its own plain prefix."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if record.name == CONSOLE else super().format(record)


class _BarAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes above an open tqdm bar (``tqdm.write``) instead of into it."""

    def emit(self, record: logging.LogRecord) -> None:
        cls = getattr(sys.modules.get("tqdm"), "tqdm", None)
        if cls is None or not getattr(cls, "_instances", None):
            super().emit(record)
            return
        try:
            cls.write(self.format(record), file=self.stream)
        except Exception:  # logging's own contract: a failing handler reports, never raises
            self.handleError(record)


def import_modules(names: Sequence[str], flag: str) -> None:
    """Import each module ``names`` lists (``flag``: the option that named it), so a backend of
    one's own registers before the block is read; ``ValueError`` naming a module that fails."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            raise ValueError(
                f"{flag} {name}: cannot import it ({type(err).__name__}: {err}); give a module "
                "on this Python's path (an installed package, or PYTHONPATH)"
            ) from None


def setup_logging(rank: int = 0) -> None:
    """INFO on rank 0, WARNING elsewhere, one format for every program; the frameworks' own
    chatter (DeepSpeed, torch.distributed) at WARNING."""
    handler = _BarAwareHandler()
    handler.setFormatter(_Formatter(_FORMAT))
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO, handlers=[handler])
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def next_token_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    Computed here rather than with ``labels=``: Hugging Face causal LMs shift ``labels`` by one
    themselves, so passing already-shifted targets would train on the token two ahead.
    """
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
