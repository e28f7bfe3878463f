"""Leaving a gloo job without a native abort at exit.

Gloo runs each collective on a worker thread of its group (``pt_gloo_runloop``), which marks it
complete, waking the caller, and only then drops its references to the collective's tensors.
Dropping the last C++ reference to a tensor that has a Python object decrefs that object, which
takes the GIL; a thread asking for the GIL once the interpreter is finalizing is ended by
``pthread_exit``, whose unwinding through gloo's ``noexcept`` ``~AsyncWork`` calls
``std::terminate``: "terminate called without an active exception", SIGABRT, exit status 1 (gdb
on the core: the worker in ``runLoop`` -> ``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` ->
``PyThread_exit_thread``, the main thread in ``Py_FinalizeEx``). Any process whose last
collective comes just before its end can lose that race, with GNMR or without.
``destroy_process_group()`` does not close it: a group's workers stop only when its last
reference goes, and DeepSpeed (``deepspeed.utils.groups``, the engine, the optimizer, each
parameter's ``_dp_group``) and megatron keep theirs; ``shutdown()`` and ``abort()`` leave them.

What closes it: before the interpreter finalizes, wait with the GIL released until every gloo
worker of the process is idle, read from ``/proc`` (:func:`gloo_worker_busy`): an idle worker
sleeps on its work queue, a futex wait without a timeout, while one inside a collective waits
for the other ranks' data with gloo's timeout and one releasing a finished collective runs or
waits for the GIL with Python's switch timeout. With the GIL free, the release finishes first; a
collective started with ``async_op=True`` and never waited finishes too while the other ranks
run it. Nothing is sent to other ranks, so a rank that died cannot make it hang; past 2 s it
warns. GNMR registers the wait as an ``atexit`` hook the first time it communicates over a group
(:func:`install_exit_hook`, from :mod:`gnmr_dist.distributed.comm`), for a user's script, a
Trainer run and the shipped programs alike; :func:`close_distributed` is the explicit end of a
program whose ranks all reach it.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import time

import torch.distributed as dist

__all__ = ["close_distributed", "gloo_worker_busy", "install_exit_hook", "wait_for_gloo_workers"]

logger = logging.getLogger(__name__)

WORKER_NAME = "pt_gloo_runloop"
"""The name torch gives gloo's worker threads (``/proc/<pid>/task/<tid>/comm``); where a build
names them otherwise, the wait finds none and returns at once."""
TASKS = "/proc/self/task"
FUTEX = {"x86_64": "202", "aarch64": "98", "arm64": "98"}.get(platform.machine())
"""The futex system call's number in ``/proc/<pid>/task/<tid>/syscall``, by architecture."""

_installed = False


def _busy(tid: str) -> bool | None:
    """Whether gloo worker thread ``tid`` is busy; ``None`` if it is not a gloo worker."""
    try:
        with open(f"{TASKS}/{tid}/stat") as f:
            stat = f.read()
    except OSError:  # the thread ended in between
        return None
    if stat[stat.find("(") + 1 : stat.rfind(")")] != WORKER_NAME:
        return None
    if stat[stat.rfind(")") + 2 :][:1] != "S":
        return True  # running, or runnable and waiting for a CPU
    if FUTEX is None:  # an architecture not listed: a sleeping worker counts as idle
        return False
    try:
        with open(f"{TASKS}/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:  # not readable here: likewise
        return False
    # "<nr> uaddr op val timeout ...": a futex wait without a timeout is the idle queue wait
    return not (len(call) > 4 and call[0] == FUTEX and int(call[4], 16) == 0)


def gloo_worker_busy() -> int | None:
    """How many of this process's gloo worker threads are busy (running, waiting for data, for
    the GIL, ...), or ``None`` where ``/proc`` does not list the process's threads."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    return sum(bool(_busy(tid)) for tid in tids)


def wait_for_gloo_workers(timeout: float = 2.0, quiet_polls: int = 3, poll: float = 0.001) -> bool:
    """Wait, with the GIL released, until no gloo worker thread of this process is busy in
    ``quiet_polls`` polls in a row, ``poll`` seconds apart (a worker between two waits can look
    idle for an instant); ``True`` once so, ``False`` after ``timeout`` seconds with one busy.

    Where ``/proc`` does not list the threads, it sleeps ``quiet_polls * poll`` seconds and
    returns ``True``: a worker waiting for the GIL takes it in that time.
    """
    if gloo_worker_busy() is None:
        time.sleep(quiet_polls * poll)
        return True
    deadline, quiet = time.monotonic() + timeout, 0
    while True:
        quiet = 0 if gloo_worker_busy() else quiet + 1
        if quiet >= quiet_polls:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)  # releases the GIL: a worker releasing a collective takes it


def _at_exit() -> None:
    if not wait_for_gloo_workers():
        logger.warning(
            "gnmr: a gloo worker thread was still busy 2 s into the exit (a collective started "
            "with async_op=True and never waited?); if it finishes while the interpreter "
            "finalizes, the process aborts with 'terminate called without an active exception'"
        )


def install_exit_hook() -> None:
    """Register (once per process) the ``atexit`` hook that waits for this process's gloo
    worker threads (:func:`wait_for_gloo_workers`) before the interpreter finalizes."""
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True


def close_distributed() -> None:
    """The end of a distributed program whose ranks all reach this line: a barrier on the
    default group, ``destroy_process_group()``, then :func:`wait_for_gloo_workers`. A no-op
    for the communication where ``torch.distributed`` is not initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    wait_for_gloo_workers()
