"""Leaving a gloo job without a native abort at exit.

Gloo runs every collective on one of its process group's worker threads (named
``pt_gloo_runloop``). The thread marks the collective complete, which wakes the caller, and only
then drops its own references to the collective's tensors. torch keeps a tensor's Python object
alive for as long as C++ holds the tensor too, so dropping the last C++ reference decrefs that
object, which takes the GIL. A thread that asks for the GIL once the interpreter has begun
finalizing is ended by ``pthread_exit``; the unwinding runs into the ``noexcept`` destructor of
gloo's ``AsyncWork`` and ``std::terminate`` aborts the process: "terminate called without an
active exception", SIGABRT, exit status 1 (gdb on the core: the worker in
``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` ->
``PyThread_exit_thread``; the main thread in ``Py_FinalizeEx``).

So a process whose last collective came just before its end (a metric all-reduced as the last
act of a script, a barrier, the last step of a loop on a loaded machine) can lose a race that
neither it nor GNMR started. ``torch.distributed.destroy_process_group()`` does not close it:
it drops torch's own references, but a gloo group's worker threads stop only when the group's
last reference goes, and DeepSpeed (``deepspeed.utils.groups``, the engine, the optimizer, every
parameter's ``_dp_group``) and megatron keep theirs to the end; the groups' ``shutdown()`` and
``abort()`` leave the threads running.

What closes it: before the interpreter finalizes, wait with the GIL released until every gloo
worker thread of the process is idle, which :func:`gloo_worker_busy` reads from ``/proc``: an
idle worker sleeps on its group's work queue, a futex wait without a timeout. A worker inside a
collective waits for the other ranks' data with gloo's timeout, and one releasing a finished
collective runs or waits for the GIL with Python's 5 ms switch timeout, so each counts as busy
until it is done; with the GIL free during the wait, the release finishes first. The wait sends
nothing to other ranks, so it cannot hang on a rank that died or left early; it gives up after
2 s with a warning. GNMR registers it as an ``atexit`` hook the first time it communicates over a
process group (:func:`install_exit_hook`, from :mod:`gnmr_dist.distributed.comm`), which covers a
user's script, a Trainer run and the shipped programs alike; :func:`close_distributed` is the
explicit end for a program whose ranks all reach it.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import time

import torch.distributed as dist

__all__ = ["close_distributed", "install_exit_hook", "wait_for_gloo_workers"]

logger = logging.getLogger(__name__)

WORKER_NAME = "pt_gloo_runloop"
"""The name gloo's process groups give their worker threads (``/proc/<pid>/task/<tid>/comm``)."""
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
    try:
        with open(f"{TASKS}/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:  # not readable here: a sleeping worker counts as idle
        return False
    # "202 uaddr op val timeout ...": a futex wait with no timeout is the idle work-queue wait
    if FUTEX is None:  # an architecture not listed: a sleeping worker counts as idle
        return False
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
