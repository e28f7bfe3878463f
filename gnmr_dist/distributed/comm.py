"""The few collectives gnmr-dist uses, with ``group=None`` meaning "no communication".

Passing process groups explicitly (never fetching hidden globals) makes a single process the
degenerate case of the distributed one: the same code path, tested by the same tests. A group is
used only when ``torch.distributed`` is initialised; a group given without it is an error. The
first collective over a group registers the exit hook of :mod:`gnmr_dist.distributed.teardown`
(gloo's worker threads finish releasing their last collective before the interpreter finalizes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in __all__

from gnmr_dist.distributed.teardown import install_exit_hook

__all__ = [
    "all_gather_objects",
    "all_reduce_sum",
    "all_reduce_sum_async",
    "group_rank",
    "join_local_world",
    "leave_local_world",
    "local_store",
]

Group = Any  # torch.distributed.ProcessGroup; Any keeps the type checker off torch internals


def _require_init(group: Group) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"a process group was passed ({group!r}) but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group first or pass group=None"
        )
    # the first collective arms the wait for gloo's workers at exit (teardown.py)
    install_exit_hook()


def all_reduce_sum(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` and return it; untouched when ``group`` is None."""
    # None is the single process: the degenerate case of the same code, no collective
    if group is None:
        return tensor
    _require_init(group)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_sum_async(tensor: torch.Tensor, group: Group | None) -> Callable[[], torch.Tensor]:
    """Start summing ``tensor`` in place over ``group``; the returned call waits and returns it.

    Lets a caller overlap the reduction with other work (the optimizer step); with ``group=None``
    nothing is started and the call returns ``tensor`` at once.
    """
    if group is None:
        return lambda: tensor
    _require_init(group)
    # async: the caller overlaps it with the optimizer step and waits after
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return tensor

    return wait


def all_gather_objects(obj: Any, group: Group | None) -> list[Any]:
    """Every rank's ``obj`` in group-rank order; ``[obj]`` when ``group`` is None."""
    if group is None:
        return [obj]
    _require_init(group)
    out: list[Any] = [None] * dist.get_world_size(group)
    # pickled objects: for the checks and names at start, never on the per-step path
    dist.all_gather_object(out, obj, group=group)
    return out


def group_rank(group: Group | None) -> int:
    """This process's rank in ``group`` (0 when ``group`` is None)."""
    return 0 if group is None else dist.get_rank(group)


LOCAL_HOST = "127.0.0.1"


def local_store(timeout: timedelta = timedelta(seconds=300)) -> Any:
    """A rendezvous store served by this process on ``127.0.0.1``, on the port the OS assigned
    as it bound the socket (port 0; ``store.port`` says which).

    Asking for a free port and binding it later leaves a window in which any other process may
    take it (``EADDRINUSE``); here the port is bound from the start and stays bound while the
    store lives. Processes join it as clients with :func:`join_local_world`, the way torchrun's
    workers join their agent's store. For worlds on one machine (tests, benchmarks)."""
    # port 0: bound now, so no other process can take it between choosing and binding
    return TCPStore(LOCAL_HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join_local_world(
    port: int, rank: int, world: int, timeout: timedelta = timedelta(seconds=120)
) -> None:
    """Make this process rank ``rank`` of a gloo world whose store :func:`local_store` serves
    on ``port``.

    The environment is set as torchrun sets it (DeepSpeed and megatron read it), including
    ``TORCHELASTIC_USE_AGENT_STORE``: a later ``env://`` rendezvous in this process joins the
    same store as a client instead of binding ``MASTER_PORT`` again."""
    os.environ.update(
        MASTER_ADDR=LOCAL_HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    store = TCPStore(LOCAL_HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def leave_local_world() -> NoReturn:
    """Destroy this process's groups and end the process at once, exit status 0, without
    finalizing the interpreter: for a worker whose result is already saved.

    A gloo worker thread releases a finished collective's work after marking it complete, so
    it can still be dropping the last reference to a tensor while the main thread moves on. A
    tensor whose Python object is gone needs the GIL to drop it, and a thread that asks for the
    GIL after ``Py_FinalizeEx`` has begun is ended with ``pthread_exit``; the unwinding runs
    into a ``noexcept`` destructor (``AsyncWork``'s), and ``std::terminate`` aborts the process
    ("terminate called without an active exception"). Without finalization no thread can be
    caught that way, as with multiprocessing's forked children, which leave by ``os._exit``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter finalization: no gloo thread can then ask for the GIL too late
    os._exit(0)
