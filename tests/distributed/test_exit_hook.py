"""A process GNMR communicates in ends without gloo's native abort at exit.

Real gloo processes. The user-style runs (``user_scripts/own_loop.py``: a user's own loop with
``GNMRRuntime`` that all-reduces its metrics as its last act and does nothing at exit) must end
rc 0 with no "terminate called without an active exception"; before the exit hook of
``gnmr_dist.distributed.teardown``, most such runs aborted (a gloo worker thread still releasing
the last collective's tensors when the interpreter finalized). The hook's wait is checked on its
own: busy while a collective is under way, idle once it is over.
"""

from __future__ import annotations

import atexit
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import multiproc

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
OWN_LOOP = Path(__file__).parent / "user_scripts" / "own_loop.py"


def user_run(script: Path, *args: str) -> str:
    """``script`` on 2 ranks under torchrun, the way a user starts it; its output, once it has
    ended rc 0 without a native abort."""
    cmd = [*multiproc.torchrun(2), str(script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    assert "terminate called" not in text, text[-3000:]
    assert out.returncode == 0, text[-3000:]
    return text


@pytest.mark.parametrize("tail", ["sync", "async", "async"])
def test_own_loop_ending_in_collectives_exits_cleanly(tail):
    """The metrics all-reduced one by one (``sync``), or started and never waited (``async``),
    as the script's last act: rc 0, no abort, the 6 decisions made. Before the hook, 3 of 20
    ``sync`` and 18 of 20 ``async`` runs aborted."""
    assert "decisions: 6" in user_run(OWN_LOOP, tail)


def _hook_and_wait(rank: int, world: int) -> dict:
    """Rank 0 starts an all-reduce that rank 1 joins only after the WORLD barrier: the wait
    sees a busy worker until then, and none once the all-reduce is over."""
    from gnmr_dist.distributed import comm, teardown

    fresh = not teardown._installed
    before = atexit._ncallbacks()
    group = dist.new_group([0, 1])
    total = comm.all_reduce_sum(torch.ones(3), group)  # GNMR's first collective: the hook
    teardown.install_exit_hook()
    registered = atexit._ncallbacks() - before
    out = {"fresh": fresh, "registered": registered, "sum": total.tolist()}
    if rank == 0:
        work = dist.all_reduce(torch.ones(1000), group=group, async_op=True)
        out["busy_pending"] = teardown.gloo_worker_busy()
        start = time.monotonic()
        out["waited_pending"] = teardown.wait_for_gloo_workers(timeout=0.3)
        out["seconds_pending"] = time.monotonic() - start
        dist.barrier()
        work.wait()
    else:
        dist.barrier()
        dist.all_reduce(torch.ones(1000), group=group)
    out["waited_done"] = teardown.wait_for_gloo_workers()
    out["busy_done"] = teardown.gloo_worker_busy()
    return out


def test_exit_hook_registered_once_and_waits_for_running_collectives():
    ranks = multiproc.run(_hook_and_wait, 2)
    for r in ranks:
        assert r["fresh"] and r["registered"] == 1 and r["sum"] == [2.0, 2.0, 2.0]
        assert r["waited_done"] is True and r["busy_done"] == 0
    zero = ranks[0]
    assert zero["busy_pending"] >= 1 and zero["waited_pending"] is False
    assert 0.3 <= zero["seconds_pending"] < 1.5
