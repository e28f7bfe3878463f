"""The one bookkeeping of the attributes GNMR replaces in a framework (megatron-core functions,
``deepspeed.initialize``, ``Trainer.log``, an optimizer's ``step``), undone last first.

A :class:`Patches` remembers, for each replacement, what the owner's own ``__dict__`` held
under that name: the original object, or nothing when the attribute came from elsewhere (a
method of an instance's class, a module attribute looked up through a parent). Undoing puts the
original back or deletes the replacement, so the owner reads exactly as before, and a second
:meth:`Patches.restore` is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["Patches"]

logger = logging.getLogger(__name__)

_ABSENT = object()


class _Replaced(NamedTuple):
    owner: Any
    name: str
    original: Any  # what ``vars(owner)`` held under ``name``, or _ABSENT
    before: Any  # what ``owner.name`` read (None when it did not exist)


class Patches:
    """Replacements of ``owner.name``, restorable in reverse order; truthy while any holds."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done: list[_Replaced] = []

    def set(self, owner: Any, name: str, replacement: Any) -> Any:
        """Replace ``owner.name`` with ``replacement``; returns what ``owner.name`` read
        before (the original to wrap or call)."""
        before = getattr(owner, name, None)
        self._done.append(_Replaced(owner, name, vars(owner).get(name, _ABSENT), before))
        setattr(owner, name, replacement)
        logger.debug("%s: patched %s.%s", self.what, getattr(owner, "__name__", owner), name)
        return before

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` read before the first replacement of it, or ``None``."""
        for done in self._done:
            if done.owner is owner and done.name == name:
                return done.before
        return None

    def restore(self) -> None:
        """Undo every replacement, last first."""
        while self._done:
            owner, name, original, _ = self._done.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __iter__(self) -> Iterator[_Replaced]:
        """The replacements in the order they were made (``owner``, ``name``, ``original``)."""
        return iter(list(self._done))

    def __len__(self) -> int:  # truthy while any replacement holds
        return len(self._done)
