"""A watch on plain ``deepspeed.initialize``: a ``"gnmr"`` block no GNMR code read is said once.

DeepSpeed ignores top-level keys it does not know, so a config with an enabled ``"gnmr"`` block
handed to DeepSpeed's own ``initialize`` (a script that forgot :func:`gnmr_dist.deepspeed.
initialize`, a Trainer without ``GNMRCallback``) trains without GNMR and without a word.
:func:`arm` runs when :mod:`gnmr_dist` is imported and wraps ``deepspeed.initialize`` in
:func:`_watched`, without importing DeepSpeed: if DeepSpeed is already imported it is wrapped
now, otherwise a finder first on ``sys.meta_path`` wraps it right after its module runs (the
finder answers for ``deepspeed`` alone and removes itself then).

The wrapper passes every call through unchanged. GNMR's own routes never reach it with a block
(:func:`gnmr_dist.deepspeed.initialize` removes the block before calling DeepSpeed, and
:func:`gnmr_dist.deepspeed.enable` replaces the wrapper itself), so a block that arrives here was
read by nobody: one warning per process names the fix, ``GNMRCallback`` when the call comes from
accelerate (Trainer, or an accelerate loop), :func:`gnmr_dist.deepspeed.initialize` otherwise.
A process that never imports :mod:`gnmr_dist` is not watched (docs/deepspeed.md, "Nothing
silent").
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["arm", "warned"]

logger = logging.getLogger(__name__)

_WARNED: list[bool] = []
_MARK = "__gnmr_watch__"
"""Attribute set on the wrapper: DeepSpeed is wrapped at most once, however often it is armed."""


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
    """Finds ``deepspeed`` with the finders after it and wraps its loader's ``exec_module``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed":
            return None
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]
        for finder in sys.meta_path:
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
        _wrap(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code...
        return getattr(self._loader, name)


def _wrap(deepspeed: Any) -> None:
    original = getattr(deepspeed, "initialize", None)
    if original is None or getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if not _WARNED:
            _check(signature, args, kwargs, sys._getframe(1).f_globals.get("__name__", ""))
        return original(*args, **kwargs)

    setattr(initialize, _MARK, True)
    deepspeed.initialize = initialize


def _check(signature: inspect.Signature, args: Any, kwargs: Any, caller: str) -> None:
    """Warn once when the call's config holds an enabled ``"gnmr"`` block. Never raises: a
    config DeepSpeed cannot read is DeepSpeed's to refuse."""
    try:
        given = signature.bind(*args, **kwargs).arguments
        config = (
            given.get("config")
            or given.get("config_params")
            or getattr(given.get("args"), "deepspeed_config", None)
        )
        if not isinstance(config, dict):
            from gnmr_dist.integrations.deepspeed.engine import load_ds_config

            config = load_ds_config(config)
        block = config.get("gnmr")
    except Exception:  # a watch must not change what DeepSpeed does
        return
    if not isinstance(block, dict) or block.get("enabled", True) is False:
        return
    _WARNED.append(True)
    logger.warning("%s", unread_block_message(from_accelerate=caller.startswith("accelerate")))


def unread_block_message(*, from_accelerate: bool) -> str:
    """The one line said when an enabled ``"gnmr"`` block reaches plain DeepSpeed."""
    fix = (
        "Give the Trainer callbacks=[GNMRCallback()] (from gnmr_dist import GNMRCallback), or "
        "call gnmr_dist.deepspeed.enable() before accelerator.prepare"
        if from_accelerate
        else "Call gnmr_dist.deepspeed.initialize (the same arguments) instead"
    )
    return (
        'gnmr: this DeepSpeed config has an enabled "gnmr" block, but deepspeed.initialize '
        f"was called without GNMR, so the block is ignored and GNMR is off. {fix}"
    )
