"""GNMR's console line, and its few notices, with a library's manners.

Every integration prints the same short line on rank 0 every ``log.console`` steps::

    gnmr step 120 | samples 960 | exceed 2 | active 1 ['model.layers.2.mlp.up_proj'] |
        max risk 3.1 | grad norm 0.52                              (one line, cut here)

and one line when it restores its state ("gnmr: state restored at controller step 250 from ...").
Where they go is the user's to decide, and the library never sets a level or adds a handler on
any logger:

* a record goes to the logger ``gnmr_dist.console`` when logging is configured for it: a handler
  anywhere on its chain (the program called ``logging.basicConfig``, or Trainer's or megatron's
  set-up did), or a level set on ``gnmr_dist.console`` or ``gnmr_dist``; that logger's level then
  decides (``logging.getLogger("gnmr_dist.console").setLevel(logging.WARNING)`` silences it);
* with nothing configured Python's logging would drop an INFO record, so the line is written to
  standard output directly, through ``tqdm.write`` when a tqdm bar is open (the line lands above
  the bar instead of inside it).

``log.console: false`` turns the line off whatever the logging set-up.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from gnmr_dist.core import Decision

__all__ = ["LOGGER", "configured", "console_line", "emit"]

LOGGER = "gnmr_dist.console"
"""The logger of the console line."""


def configured(log: logging.Logger) -> bool:
    """Whether the program has a say about ``log``: a handler on its chain, or a level set on it
    or on a parent below the root."""
    if log.hasHandlers():
        return True
    node: logging.Logger | None = log
    while node is not None and node.parent is not None:  # the root's WARNING default is not a say
        if node.level != logging.NOTSET:
            return True
        node = node.parent
    return False


def emit(message: str) -> None:
    """One console line: through logging where it is configured, else to standard output."""
    log = logging.getLogger(LOGGER)
    if configured(log):
        if log.isEnabledFor(logging.INFO):
            log.info(message)
        return
    tqdm = _open_tqdm()
    if tqdm is not None:
        tqdm.write(message, file=sys.stdout)
    else:
        print(message, file=sys.stdout, flush=True)  # noqa: T201  (nothing else would show it)


def _open_tqdm() -> Any:
    """tqdm's class when a bar is open in this process (tqdm is never imported here)."""
    module = sys.modules.get("tqdm")
    cls = getattr(module, "tqdm", None)
    return cls if cls is not None and getattr(cls, "_instances", None) else None


def console_line(
    decision: Decision, global_norm: float, names: Sequence[str], samples: int | None = None
) -> str:
    """The console line of one decision (``samples``: the framework's sample count, if any)."""
    t = decision.telemetry
    where = f" | samples {samples}" if samples is not None else ""
    active = [names[u] for u in decision.active]
    return (
        f"gnmr step {decision.step}{where} | exceed {t.num_exceed} | active {len(active)} "
        f"{active} | max risk {t.max_risk:.3g} | grad norm {global_norm:.4g}"
    )
