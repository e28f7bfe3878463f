"""Run a function in N real processes joined by a gloo process group, collect what each returns.

The workers are started with ``spawn`` (clean interpreters, like torchrun) and each returns a
picklable value; an exception in any worker fails the calling test with that worker's traceback.

``spawn`` gives each worker a copy of the parent's ``sys.path`` and unpickles the target's
arguments before the target runs, so neither ``PYTHONPATH`` nor a ``sys.path`` edit inside ``fn``
can choose which copy of a package the worker imports (unpickling ``fn`` already imports its
module, and with it whatever that module imports). ``run(..., sys_path_prepend=[dir])`` puts
``dir`` first on the worker's ``sys.path`` and only then unpickles ``fn`` and its arguments: this
is how a test runs its workers against another megatron-core release installed with
``pip install --target dir``.

Importing megatron-core takes ~9 s of CPU per process, which dominates a small test on a 2-core
machine. ``run_jobs(jobs, preload=[...])`` spawns one clean interpreter that imports ``preload``
once and then forks every rank of every job from it (copy-on-write: the ranks start with the
modules loaded). The ranks are still separate processes joined by gloo, exactly as with ``run``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gnmr_dist.distributed.comm import free_port


def _worker(rank: int, world: int, port: int, out: str, prepend: list[str], payload: bytes) -> None:
    sys.path[:0] = prepend  # before unpickling `fn`, which imports its module
    fn, args = pickle.loads(payload)
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


def run(
    fn: Callable[..., Any], world: int, *args: Any, sys_path_prepend: Sequence[str] = ()
) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process.

    ``sys_path_prepend``: directories put first on each worker's ``sys.path`` before ``fn`` and
    ``args`` are unpickled there (so before ``fn``'s module imports anything).
    """
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world, free_port(), out, list(sys_path_prepend), payload),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


Job = tuple[Callable[..., Any], int, tuple[Any, ...]]
"""``(fn, world, args)``: ``fn(rank, world, *args)`` on ``world`` ranks."""


def _zygote(_index: int, prepend: list[str], preload: list[str], payload: bytes, out: str) -> None:
    sys.path[:0] = prepend
    torch.set_num_threads(1)  # no OpenMP pool in the process the ranks are forked from
    for name in preload:
        importlib.import_module(name)
    jobs: list[Job] = pickle.loads(payload)
    for j, (fn, world, args) in enumerate(jobs):
        job_out = Path(out, str(j))
        job_out.mkdir()
        mp.start_processes(
            _worker,
            args=(world, free_port(), str(job_out), [], pickle.dumps((fn, args))),
            nprocs=world,
            join=True,
            start_method="fork",
        )


def run_jobs(
    jobs: Sequence[Job], *, sys_path_prepend: Sequence[str] = (), preload: Sequence[str] = ()
) -> list[list[Any]]:
    """``[run(fn, world, *args) for fn, world, args in jobs]``, the ranks forked from one process.

    That process puts ``sys_path_prepend`` first on ``sys.path``, imports the modules named in
    ``preload``, unpickles ``jobs`` and then runs them one after the other, forking ``world``
    ranks for each. An exception in a rank fails the call (and skips the jobs after it).
    """
    payload = pickle.dumps(list(jobs))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _zygote,
            args=(list(sys_path_prepend), list(preload), payload, out),
            nprocs=1,
            join=True,
            start_method="spawn",
        )
        return [
            [pickle.loads(Path(out, str(j), f"{r}.pkl").read_bytes()) for r in range(world)]
            for j, (_, world, _) in enumerate(jobs)
        ]


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
