"""Run a function in N real processes joined by a gloo process group, collect what each returns.

The workers are started with ``spawn`` (clean interpreters, like torchrun) and each returns a
picklable value; an exception in any worker fails the calling test with that worker's traceback.
They meet at a ``TCPStore`` this process serves on a port the OS assigned when it bound it
(``gnmr_dist.distributed.comm.local_store``), as torchrun's workers meet at their agent's: no
port is chosen first and bound later, so no other process can take it in between.

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
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gnmr_dist.distributed.comm import join_local_world, leave_local_world, local_store


def _worker(rank: int, world: int, port: int, out: str, prepend: list[str], payload: bytes) -> None:
    sys.path[:0] = prepend  # before unpickling `fn`, which imports its module
    fn, args = pickle.loads(payload)
    torch.set_num_threads(1)
    join_local_world(port, rank, world)
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise  # the traceback reaches the test
    leave_local_world()  # no interpreter finalization: see its docstring


def run(
    fn: Callable[..., Any], world: int, *args: Any, sys_path_prepend: Sequence[str] = ()
) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process.

    ``sys_path_prepend``: directories put first on each worker's ``sys.path`` before ``fn`` and
    ``args`` are unpickled there (so before ``fn``'s module imports anything).
    """
    payload = pickle.dumps((fn, args))
    store = local_store()  # bound here, on a port the OS chose: no window for another process
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world, store.port, out, list(sys_path_prepend), payload),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


def torchrun(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` processes on this machine.

    ``--standalone``: torchrun's agent serves a c10d rendezvous on a port the OS assigns as it
    binds it (port 0) and its workers join that same store (torch's shared agent store), so no
    port is picked before it is bound. A ``--master_port`` chosen by the test would be bound a
    second later, by which time another process may hold it."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def launcher_port() -> int:
    """A port free now and below the OS's ephemeral range, for a launcher that is told a port
    and binds it later (DeepSpeed's launcher: its rank 0 binds ``--master_port`` at start-up).

    The OS hands ports from the ephemeral range (``ip_local_port_range``) to every bind of port
    0 and every outgoing connection, so such a port may be taken by anyone before rank 0 binds
    it. A port below the range is taken only by a process that names it. The search starts at
    an offset drawn from this process's id, so two suites on one machine start apart; torchrun's
    defaults (29400-29599) are skipped."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [p for p in range(10_000, low) if not 29_400 <= p < 29_600]
    start = os.getpid() % len(ports)
    for port in ports[start:] + ports[:start]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{low}")


Job = tuple[Callable[..., Any], int, tuple[Any, ...]]
"""``(fn, world, args)``: ``fn(rank, world, *args)`` on ``world`` ranks."""


def _zygote(
    _index: int, prepend: list[str], preload: list[str], payload: bytes, out: str, ports: list[int]
) -> None:
    sys.path[:0] = prepend
    torch.set_num_threads(1)  # no OpenMP pool in the process the ranks are forked from
    for name in preload:
        importlib.import_module(name)
    jobs: list[Job] = pickle.loads(payload)
    for j, ((fn, world, args), port) in enumerate(zip(jobs, ports, strict=True)):
        job_out = Path(out, str(j))
        job_out.mkdir()
        mp.start_processes(
            _worker,
            args=(world, port, str(job_out), [], pickle.dumps((fn, args))),
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
    ranks for each. An exception in a rank fails the call (and skips the jobs after it). Each
    job joins a store of its own, served from this process.
    """
    payload = pickle.dumps(list(jobs))
    stores = [local_store() for _ in jobs]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _zygote,
            args=(list(sys_path_prepend), list(preload), payload, out, [s.port for s in stores]),
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
