"""CPU stand-ins for megatron-core's persistent checkpoint writer (``--async-save``).

megatron writes each checkpoint in a worker process running
``PersistentAsyncCaller.async_loop``, started with ``forkserver`` (Megatron-LM) or ``spawn``
(megatron-core's default; 0.16: always): a fresh interpreter, without the training process's
CPU compatibility. On a CPU host megatron's loop stops there at once on
``torch.cuda.set_device(rank % torch.cuda.device_count())`` (``async_utils.py:565``; 0.16.1:
488; a ``ZeroDivisionError``, and the trainer then waits forever), its staging
(``FileSystemWriterAsync.preload_tensors``) ends with ``torch.cuda.synchronize()``
(``filesystem_async.py:248``; 0.16.1: 230), and the staging's device-to-host copy
(``tensor.to("cpu")``, ``:243``; 0.16.1: 226) is no copy: a CPU tensor reaches the worker as
the trainer's own (shared) memory, which the trainer changes once the staging is done.

The route in: ``enable_cpu_compat`` makes ``PersistentAsyncCaller.async_loop`` in the training
process :func:`writer_loop`. A process target is pickled by reference, so the worker imports
this module (with the trainer's ``sys.path``) and :func:`writer_loop` runs megatron's loop with
:func:`writer_stand_ins` on: under every start method, whatever the script imports where.
(``multiprocessing.set_forkserver_preload`` reaches less: Python 3.11's forkserver imports the
listed modules on its own ``sys.path``, skipping an ``ImportError`` silently, only when it is
not yet running, and ``spawn`` has no preload.)

:func:`writer_stand_ins`, in megatron's two writer modules only: ``torch`` in
``strategies.async_utils`` and ``strategies.filesystem_async`` -> a stand-in whose ``cuda`` has
one device (``device_count()`` is 1) and a ``set_device`` and ``synchronize`` that do nothing;
``FileSystemWriterAsync.preload_tensors`` -> the original given copies of the CPU tensors, so
the checkpoint holds the state at the save, as the staging copy makes it on a GPU. The
trainer's own calls on this path (``async_utils.py:224, 273, 698``) are the training process's
compat's. docs/megatron.md, "CPU compatibility".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gnmr_dist.integrations.patching import Patches
from gnmr_dist.testing.megatron_cpu.device import _cpu_synchronize

__all__ = ["writer_loop", "writer_stand_ins"]

logger = logging.getLogger(__name__)

_STRATEGIES = "megatron.core.dist_checkpointing.strategies"


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _WriterCuda(types.ModuleType):
    """``torch.cuda`` as megatron's writer modules see it on a CPU host: one device, the host,
    which needs no selecting and no synchronising. Any other attribute is the real one."""

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda for megatron's checkpoint writer on CPU")
        self.device_count = lambda: 1
        self.set_device = _nothing
        self.synchronize = _cpu_synchronize

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _WriterTorch(types.ModuleType):
    """``torch`` as megatron's writer modules see it on a CPU host: ``cuda`` is
    :class:`_WriterCuda`, every other attribute is torch's."""

    def __init__(self) -> None:
        super().__init__("torch", "torch for megatron's checkpoint writer on CPU")
        self.cuda = _WriterCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's copy (the staging copy a GPU tensor gets); any other tensor as it is."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor


def _staging_copies(original: Callable[..., Any]) -> Callable[..., Any]:
    """``FileSystemWriterAsync.preload_tensors`` run on copies of the buckets' CPU tensors."""

    @functools.wraps(original)
    def preload_tensors(write_buckets: list[Any], non_blocking: bool = True) -> Any:
        copies = [
            (name, key, (data, [(item, _own_copy(tensor)) for item, tensor in tensors]))
            for name, key, (data, tensors) in write_buckets
        ]
        return original(copies, non_blocking)

    return preload_tensors


@contextlib.contextmanager
def writer_stand_ins() -> Iterator[None]:
    """Within the block, megatron's checkpoint writer runs on a CPU host (the module
    docstring lists what changes); restored on exit. ``RuntimeError`` when CUDA is available."""
    import importlib

    if torch.cuda.is_available():
        raise RuntimeError("megatron_patches.cpu: the writer's stand-ins are never active on a GPU")
    async_utils = importlib.import_module(f"{_STRATEGIES}.async_utils")
    filesystem_async = importlib.import_module(f"{_STRATEGIES}.filesystem_async")
    writer = filesystem_async.FileSystemWriterAsync
    patches = Patches("cpu compat: checkpoint writer")
    try:
        patches.set(async_utils, "torch", _WriterTorch())
        patches.set(filesystem_async, "torch", _WriterTorch())
        staging = _staging_copies(writer.preload_tensors)
        patches.set(writer, "preload_tensors", staticmethod(staging))
        logger.debug("megatron's checkpoint writer: CPU stand-ins on (%d)", len(patches))
        yield
    finally:
        patches.restore()


def _megatron_loop() -> Callable[..., None]:
    """megatron's own ``PersistentAsyncCaller.async_loop``: the class's in a worker that imported
    megatron afresh (spawn, forkserver); the one the compat replaced in a forked worker."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    loop: Callable[..., None] = PersistentAsyncCaller.async_loop
    if loop is writer_loop:  # forked from the training process, whose compat holds the original
        from gnmr_dist.testing import megatron_cpu

        loop = megatron_cpu._APPLIED.original(PersistentAsyncCaller, "async_loop")
    return loop


def writer_loop(*args: Any, **kwargs: Any) -> None:
    """megatron's ``PersistentAsyncCaller.async_loop`` (same arguments) with
    :func:`writer_stand_ins` on: the persistent checkpoint worker's target while the CPU compat
    is on in the process that starts it."""
    loop = _megatron_loop()
    with writer_stand_ins():
        loop(*args, **kwargs)
