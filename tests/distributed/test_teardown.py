"""The multi-process harness ends its workers without a native abort.

A gloo worker thread releases a finished collective after marking it complete; if the release
drops the last reference to a tensor whose Python object is gone, it needs the GIL, and a
thread asking for the GIL once the interpreter is finalizing is ended by ``pthread_exit``,
whose unwinding through ``AsyncWork``'s ``noexcept`` destructor calls ``std::terminate``
("terminate called without an active exception", SIGABRT; gdb shows that stack in the gloo
worker thread). The worker below leaves such collectives behind on a group that outlives
``destroy_process_group``, as megatron's and DeepSpeed's groups do: with a plain exit after
``destroy_process_group`` a rank aborted in each of 3 runs of this test; ``tests.multiproc``
ends its workers without finalizing (``leave_local_world``), so none may.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import multiproc

pytestmark = pytest.mark.slow


_GROUPS: list = []  # as megatron's parallel_state and DeepSpeed's groups keep theirs


def _leave_collectives_behind(rank: int, world: int) -> int:
    """On a subgroup kept in a module global, start 20 all-reduces of temporaries, drop every
    handle, return without waiting: the harness's barrier on the default group does not wait
    for another group's work, and the global keeps the group (and its threads) alive past
    ``destroy_process_group``."""
    _GROUPS.append(dist.new_group(list(range(world))))
    for _ in range(20):
        dist.all_reduce(torch.ones(1_000_000), group=_GROUPS[-1], async_op=True)
    return rank


def test_workers_leaving_collectives_behind_exit_cleanly():
    for _ in range(3):
        assert multiproc.run(_leave_collectives_behind, 2) == [0, 1]
