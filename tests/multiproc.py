"""Run a function in N real processes joined by a gloo process group, collect what each returns.

The workers are started with ``spawn`` (clean interpreters, like torchrun) and each returns a
picklable value; an exception in any worker fails the calling test with that worker's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world, free_port(), out, fn, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


class CollectiveSpy:
    """Records every collective torch.distributed is asked for, then runs the real one.

    ``p2p=True`` also records send/recv/isend/irecv (not usable around megatron's pipeline
    schedule, whose ``P2POp`` checks those functions by identity).
    """

    COLLECTIVES = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "broadcast",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce",
        "gather",
    )
    P2P = ("send", "recv", "isend", "irecv")

    def __init__(self, p2p: bool = False) -> None:
        self.names = self.COLLECTIVES + (self.P2P if p2p else ())
        self.calls: list[tuple[str, int]] = []
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveSpy:
        for name in self.names:
            real = self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, real))
        return self

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, obj.numel() if torch.is_tensor(obj) else -1))
            return real(obj, *args, **kwargs)

        return wrapped

    def __exit__(self, *exc: object) -> None:
        for name, real in self.saved.items():
            setattr(dist, name, real)
