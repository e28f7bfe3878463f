"""Where an integration keeps the GNMR state on disk, and how a bad one is handled on resume.

:func:`write_atomic` writes a state so that a kill at any instant leaves either the previous
file or the complete new one: ``torch.save`` to a temporary file in the same directory,
``fsync``, ``os.replace`` over the target (atomic on POSIX file systems), then ``fsync`` of the
directory so the rename itself is durable. The DeepSpeed integration calls it *before*
DeepSpeed writes its own files and its ``latest`` tag, so a checkpoint that ``latest`` names
always holds a complete state (:mod:`gnmr_dist.integrations.deepspeed`).

:func:`read_state` tells apart a missing file, an unreadable one and a readable one; what to do
with a missing or bad state is the block's choice (``on_missing_state``, ``on_corrupt_state``),
applied by :func:`restore_or_refuse` for every framework alike. The fault both training programs
can inject to try that path (``--fail-at``, ``--gnmr-fail-at``) is test apparatus:
:func:`gnmr_dist.testing.drills.restart_drill`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.state import StateMismatchError

__all__ = ["read_state", "restore_or_refuse", "write_atomic"]

logger = logging.getLogger(__name__)


def write_atomic(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.save(state, path)`` that a kill cannot leave half-written (module docstring)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # same directory: os.replace is atomic only within one file system
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(dict(state), fh)
            fh.flush()
            # the bytes are on disk before the rename makes them the state
            os.fsync(fh.fileno())
        # a kill before this line leaves the old file, after it the complete new one
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    # the rename itself is durable only once the directory is synced
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems (and Windows) cannot fsync a directory
        pass
    finally:
        os.close(fd)


_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")
"""How a ``torch.save`` file starts: a zip archive (torch >= 1.6) or a (legacy) pickle."""


def read_state(path: str | os.PathLike[str]) -> tuple[str, Any]:
    """``("ok", state)``, ``("missing", None)`` or ``("corrupted", reason)``."""
    if not Path(path).is_file():
        return "missing", None
    with open(path, "rb") as fh:
        head = fh.read(8)
    if not head:
        return "corrupted", f"{path} is empty (0 bytes), not a GNMR state"
    if not head.startswith(_TORCH_MAGIC):
        return "corrupted", (
            f"{path} is not a GNMR state: torch.save did not write it (it starts with {head!r})"
        )
    try:
        # weights_only: a state is plain tensors and ints, so nothing in it can run code
        return "ok", torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is reported the same way, with its reason
        return "corrupted", f"{path} is not a readable GNMR state ({type(err).__name__}: {err})"


def restore_or_refuse(block: GNMRBlock, where: str, found: tuple[str, Any], session: Any) -> bool:
    """Load ``found`` (a :func:`read_state` result) into ``session``, or apply the block's choice.

    ``session``: an :class:`~gnmr_dist.integrations.session.IntegrationSession`. A missing state
    is an error unless ``on_missing_state`` is ``"fresh"``; an unreadable one, or one that
    ``session.load_state_dict`` refuses (checksum, invariants, another model: ``ValueError``,
    with nothing restored), is an error unless ``on_corrupt_state`` is ``"fresh"``. "Fresh"
    resets the session's controller (``session.reset()``) and logs a warning naming ``where``
    and the reason. Returns whether a state loaded.
    """
    kind, payload = found
    if kind == "missing":
        if block.on_missing_state == "fresh":
            logger.warning(
                "gnmr: %s has no GNMR state; the controller starts fresh "
                "(on_missing_state='fresh')",
                where,
            )
            session.reset()
            return False
        raise FileNotFoundError(
            f"gnmr: {where} has no GNMR state. Resuming without it would silently reset the "
            'controller; set "on_missing_state": "fresh" in the gnmr block to start it fresh on '
            "purpose."
        )
    reason = payload if kind == "corrupted" else None
    mismatch = False
    if reason is None:
        try:
            session.load_state_dict(payload)
            return True
        except (KeyError, TypeError, ValueError) as err:
            reason, mismatch = str(err), isinstance(err, StateMismatchError)
    if block.on_corrupt_state == "fresh":
        logger.warning(
            "gnmr: the GNMR state of %s is unusable (%s); the controller starts "
            "fresh (on_corrupt_state='fresh')",
            where,
            reason,
        )
        session.reset()
        return False
    if mismatch:
        raise ValueError(
            f"gnmr: the GNMR state of {where} is intact but was saved under other settings: "
            f"{_sentence(reason)}"
        )
    raise ValueError(
        f"gnmr: cannot restore the GNMR state of {where}: {_sentence(reason)} Restore the "
        "checkpoint from a good copy or resume from an earlier one; to start the controller "
        'fresh on purpose set "on_corrupt_state": "fresh" in the gnmr block.'
    )


def _sentence(text: str) -> str:
    """``text`` ending in exactly one full stop."""
    return text.rstrip().rstrip(".") + "."
