"""The few collectives gnmr-dist uses, with ``group=None`` meaning "no communication".

Passing process groups explicitly (never fetching hidden globals) makes a single process the
degenerate case of the distributed one: the same code path, tested by the same tests. A group is
used only when ``torch.distributed`` is initialised; a group given without it is an error.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_objects",
    "all_reduce_sum",
    "all_reduce_sum_async",
    "group_rank",
    "free_port",
]

Group = Any  # torch.distributed.ProcessGroup; Any keeps the type checker off torch internals


def _require_init(group: Group) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"a process group was passed ({group!r}) but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group first or pass group=None"
        )


def all_reduce_sum(tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` and return it; untouched when ``group`` is None."""
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
    dist.all_gather_object(out, obj, group=group)
    return out


def group_rank(group: Group | None) -> int:
    """This process's rank in ``group`` (0 when ``group`` is None)."""
    return 0 if group is None else dist.get_rank(group)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a local rendezvous (``MASTER_PORT``): the OS picks
    it by binding port 0. Another process may take it before it is used; good for tests and
    benchmarks on one machine, not for a cluster launcher."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
