"""A watch on every DeepSpeed engine built: a ``"gnmr"`` block no GNMR code read is said once.

DeepSpeed ignores top-level keys it does not know, so a config with an enabled ``"gnmr"`` block
handed to DeepSpeed's own ``initialize`` (a script that forgot :func:`gnmr_dist.deepspeed.
initialize`, a Trainer without ``GNMRCallback``) trains without GNMR and without a word.
:func:`arm` runs when :mod:`gnmr_dist` is imported and wraps ``DeepSpeedEngine.__init__`` in
:func:`_watched`, without importing DeepSpeed: if DeepSpeed is already imported it is wrapped
now, otherwise a finder first on ``sys.meta_path`` wraps it right after DeepSpeed's module runs
(the finder answers for ``deepspeed`` alone, and leaves ``sys.meta_path`` only then: a probe
such as ``importlib.util.find_spec("deepspeed")``, which transformers runs when it is imported,
imports nothing and leaves it in place).

The engine's class, not the ``deepspeed.initialize`` function, is what is wrapped: a script that
bound ``from deepspeed import initialize`` before importing :mod:`gnmr_dist`, an ``initialize``
of another package (MS-AMP's), or an engine class built directly all end in
``DeepSpeedEngine.__init__`` (the pipeline and hybrid engines through ``super().__init__``).
The wrapper builds the engine unchanged, then reads the config the engine holds. GNMR's own
routes never hand DeepSpeed a block (:func:`gnmr_dist.deepspeed.initialize` removes it before
calling DeepSpeed), so a block found there was read by nobody: one warning per process names the
fix, ``GNMRCallback`` when accelerate built the engine (Trainer, or an accelerate loop),
:func:`gnmr_dist.deepspeed.initialize` otherwise. A process that never imports :mod:`gnmr_dist`
before its engine is built is not watched (docs/deepspeed.md, "Nothing silent").
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["arm", "warned"]

logger = logging.getLogger(__name__)

_WARNED: list[bool] = []
_MARK = "__gnmr_watch__"
"""Attribute set on the wrapper: the engine class is wrapped at most once, however often it is
armed."""


def warned() -> bool:
    """Whether this process has warned of an unread block (the Trainer callback then stays
    quiet about the same engine)."""
    return bool(_WARNED)


def arm() -> None:
    """Watch ``deepspeed.initialize`` from now on (idempotent; never imports DeepSpeed)."""
    module = sys.modules.get("deepspeed")
    if module is not None:
        _wrap(module)
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` with the finders after it and wraps its loader's ``exec_module``
    (every time it is asked: only the import that runs the module removes the finder)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Finder):
                continue
            spec = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec  # type: ignore[no-any-return]
        return None


class _Loader(importlib.abc.Loader):
    """DeepSpeed's own loader, and :func:`_wrap` once its module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Finder)]
        _wrap(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code...
        return getattr(self._loader, name)


def _wrap(deepspeed: Any) -> None:
    """Wrap ``deepspeed.DeepSpeedEngine.__init__`` in :func:`_watched` (at most once)."""
    engine_class = getattr(deepspeed, "DeepSpeedEngine", None)
    init = getattr(engine_class, "__init__", None)
    if init is None or getattr(init, _MARK, False):
        return
    setattr(engine_class, "__init__", _watched(init))  # noqa: B010 (a class's own method)


def _watched(init: Any) -> Any:
    """``DeepSpeedEngine.__init__`` that, once the engine is built, warns of an unread block."""

    @functools.wraps(init)
    def watched_init(engine: Any, *args: Any, **kwargs: Any) -> None:
        init(engine, *args, **kwargs)
        if not _WARNED:
            _check(engine)

    setattr(watched_init, _MARK, True)
    return watched_init


def _check(engine: Any) -> None:
    """Warn once when the engine's config holds an enabled ``"gnmr"`` block. Never raises: a
    watch must not change what DeepSpeed does."""
    try:
        block = engine._config._param_dict.get("gnmr")
    except Exception:  # not DeepSpeed's config object as 0.19 keeps it: nothing to read
        return
    if not isinstance(block, dict) or block.get("enabled", True) is False:
        return
    _WARNED.append(True)
    logger.warning("%s", unread_block_message(from_accelerate=_from_accelerate()))


def _from_accelerate() -> bool:
    """Whether accelerate is on the stack (Trainer builds its engine through it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("accelerate"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def unread_block_message(*, from_accelerate: bool) -> str:
    """The one line said when an enabled ``"gnmr"`` block reaches plain DeepSpeed."""
    fix = (
        "Give the Trainer callbacks=[GNMRCallback()] (from gnmr_dist import GNMRCallback), or "
        "call gnmr_dist.deepspeed.enable() before accelerator.prepare"
        if from_accelerate
        else "Call gnmr_dist.deepspeed.initialize (the same arguments) instead"
    )
    return (
        'gnmr: this DeepSpeed config has an enabled "gnmr" block, but its engine was built by '
        "plain DeepSpeed (deepspeed.initialize without GNMR), so the block is ignored and GNMR "
        f"is off. {fix}"
    )
