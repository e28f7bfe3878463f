"""Issue 33, item 5: a pretrain script that calls ``attach_from_argv()`` at module level saves
through Megatron-LM's asynchronous checkpoint writer, and GNMR stays out of the writer.

``--async-save`` on megatron-core 0.17.1 needs ``--use-persistent-ckpt-worker`` (without it
``validate_args`` turns async saving off, ``megatron/training/arguments.py:1436``);
``initialize_megatron`` then starts the persistent worker with the ``forkserver`` start method
(``megatron/training/initialize.py:98``, ``PersistentAsyncCaller._get_process``). Python 3.11's
forkserver does not preload the script (its ``ensure_running`` keeps ``main_path``, which
``get_preparation_data`` names ``init_main_from_path``), so each process it forks re-imports
the script as ``__mp_main__`` (``multiprocessing.spawn.prepare``) with the trainer's
``sys.argv`` (the ``--gnmr-*`` flags included): the module-level ``attach_from_argv()`` runs
again there, and ``_in_spawned_helper`` makes it do nothing.

On a CPU host megatron's writer itself needs CUDA: the worker starts with
``torch.cuda.set_device(rank % torch.cuda.device_count())`` (a ``ZeroDivisionError`` without a
GPU, ``megatron/core/dist_checkpointing/strategies/async_utils.py:565``, and the trainer then
waits forever), its staging calls ``torch.cuda.synchronize()``
(``strategies/filesystem_async.py:248``), and its staging copy (``:243``) is no copy on CPU.
GNMR's CPU compatibility carries its stand-ins into the worker
(:mod:`gnmr_dist.testing.megatron_cpu.writer`: the worker's target is GNMR's loop, which
runs megatron's), so the script below has none of its own; the tests after it check that
route under each start method, for a script that does not import GNMR at module level.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.requires import missing, require

require("megatron.core")

from tests.integrations.megatron.test_megatron_lm import GNMR, OWN, _env, _trace
from tests.multiproc import torchrun

SCRIPT = '''\
"""A pretrain script with GNMR's two lines at module level (tests/.../test_async_save.py)."""
import os
import sys

from gnmr_dist.integrations.megatron.loop import attached
from gnmr_dist.train.megatron_flags import attach_from_argv
from tests.integrations.megatron.own_pretrain import main

extra_args_provider = attach_from_argv()  # at module level, as users write it

if __name__ == "__mp_main__":
    said = f"helper {os.getpid()} re-imported the script; GNMR attached: {attached() is not None}"
    print(said, file=sys.stderr, flush=True)

if __name__ == "__main__":
    main(extra_args_provider)
'''

ASYNC = ["--ckpt-format", "torch_dist", "--async-save", "--use-persistent-ckpt-worker"]
ASYNC += ["--async-strategy", "mcore"]  # megatron's own writer (nvidia-resiliency-ext's: none)
ATTACHED = "cpu compat enabled for megatron-core"
"""What ``attach_from_argv`` logs in every process it attaches in on a CPU host."""


def _args(work: Path, name: str, iters: int, *extra: str) -> list[str]:
    """``OWN`` (the own script's set) for ``iters`` iterations, without its spike drill."""
    own = list(OWN)
    at = own.index("--gnmr-inject-grad-spike")
    del own[at : at + 2]
    at = own.index("--train-iters")
    own[at + 1] = str(iters)
    gnmr = ["--gnmr-config", str(work / "gnmr.json")]
    gnmr += ["--gnmr-trace", str(work / name / "trace.jsonl")]
    return [*own, "--log-interval", "1", *gnmr, *extra]


def _run(work: Path, name: str, args: list[str]) -> tuple[str, list[str]]:
    """The script under torchrun (2 ranks, data parallel 2) with each rank's output in its own
    file (a helper process writes to its rank's): (torchrun's own output, the ranks' outputs)."""
    logs = work / name / "logs"
    cmd = [*torchrun(2), "--log-dir", str(logs), "--redirects", "3", str(work / "pretrain.py")]
    done = subprocess.run(
        [*cmd, *args], cwd=work, env=_env(), capture_output=True, text=True, timeout=600
    )
    ranks = [
        "".join(p.read_text() for p in sorted(d.iterdir()))
        for d in sorted(logs.glob("*/attempt_0/*"), key=lambda d: int(d.name))
    ]
    everything = done.stdout + done.stderr + "".join(ranks)
    assert done.returncode == 0, everything[-8000:]
    assert len(ranks) == 2, sorted(p.relative_to(logs) for p in logs.rglob("*"))
    return done.stdout + done.stderr, ranks


@pytest.mark.slow
def test_a_module_level_attach_saves_through_megatrons_async_writer(tmp_path):
    _env()  # skips (locally) when the release with megatron.training is not installed
    if importlib.util.find_spec("megatron.training") is None:
        missing("megatron-core without megatron.training (0.17+ ships it)")
    work = tmp_path
    (work / "pretrain.py").write_text(SCRIPT)
    (work / "gnmr.json").write_text(json.dumps({"gnmr": GNMR}))
    save = ["--save", str(work / "ckpt"), "--save-interval", "2", *ASYNC]
    launcher, ranks = _run(work, "full", _args(work, "full", 4, *save))

    for out in (launcher, *ranks):
        assert "Traceback" not in out and "EOFError" not in out, out[-6000:]
    both = "".join(ranks)
    for iteration in (2, 4):  # saved by the worker, while training went on / at the end
        assert re.search(rf"scheduled an async checkpoint save at iteration +{iteration} ", both)
        assert re.search(rf"successfully saved checkpoint from iteration +{iteration} ", both)
    for rank, out in enumerate(ranks):
        times = out.count(ATTACHED)
        assert times == 1, f"rank {rank}: {ATTACHED!r} {times} times (a helper attached too?)"
        helpers = re.findall(r"helper \d+ re-imported the script; GNMR attached: (\w+)", out)
        assert helpers and set(helpers) == {"False"}, (rank, helpers)

    ckpt = work / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for iteration in (2, 4):
        where = ckpt / f"iter_{iteration:07d}"
        names = {p.name for p in where.iterdir()}
        assert {".metadata", "metadata.json", "common.pt"} <= names, names
        assert len([n for n in names if n.endswith(".distcp")]) == 2, names  # the writer's shards
        common = torch.load(where / "common.pt", weights_only=False)
        assert common["iteration"] == iteration
        assert common["gnmr"]["controller"]["step"] == iteration  # GNMR's checkpoint entry

    # resumed from the checkpoint the writer finished while training went on
    load = ["--load", str(ckpt), "--ckpt-step", "2"]
    launcher, ranks = _run(work, "resumed", _args(work, "resumed", 4, *load))
    assert "gnmr: state restored at controller step 2 from --load" in ranks[0]
    full, resumed = _trace(work / "full" / "trace.jsonl"), _trace(work / "resumed" / "trace.jsonl")
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed, strict=True):
        assert a["active"] == b["active"] and a["norms"] == pytest.approx(b["norms"], rel=1e-5)


# --------------------------------------------------------------------------- the writer's route

DRIVER = '''\
"""megatron-core's async writer on CPU, GNMR's compat enabled under ``__main__`` only (the
writer never imports GNMR through this script): each save is staged by megatron's staging, then
by one that copies nothing, and the trainer changes its state in place before the writer
writes (tests/.../test_async_save.py)."""
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def write(paths, buckets, results_queue):
    """The save: once the trainer has trained on (``go``), write what the writer staged."""
    go, out = paths
    deadline = time.monotonic() + 120
    while not os.path.exists(go):
        assert time.monotonic() < deadline, "the trainer never trained on"
        time.sleep(0.01)
    ((_, _, (_, [(_, staged)])),) = buckets
    Path(out).write_text(json.dumps({"values": staged.tolist(), "pid": os.getpid()}))


def as_is(buckets):
    """A staging that copies nothing."""
    return buckets


def save(queue, work, name, staging):
    state = torch.arange(4.0)  # the trainer's state at the save
    buckets = [("file", "key", ([], [("item", state)]))]
    go, out = work / f"{name}.go", work / f"{name}.json"
    args = ((str(go), str(out)), buckets, None)
    request = AsyncRequest(write, args, [], preload_fn=functools.partial(staging, buckets))
    queue.schedule_async_request(request)  # returns once the writer has staged
    state.add_(100.0)  # the next step, in place
    go.touch()
    queue.maybe_finalize_async_calls(blocking=True)
    return json.loads(out.read_text())


if __name__ == "__main__":
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncCallsQueue,
        AsyncRequest,
    )
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat

    work, methods = Path(sys.argv[1]), sys.argv[2:]
    enable_cpu_compat()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    found = {"trainer": os.getpid()}
    for method in methods:
        queue = AsyncCallsQueue(persistent=method != "fork")  # fork: the temporary worker
        if method in ("forkserver", "spawn") and hasattr(queue, "warmup_persistent_caller"):
            queue.warmup_persistent_caller(0, method)  # as initialize_megatron does
        found[method] = {
            "staged": save(queue, work, f"{method}-staged", FileSystemWriterAsync.preload_tensors),
            "as_is": save(queue, work, f"{method}-as-is", as_is),
        }
        queue.close()
    dist.destroy_process_group()
    print(json.dumps(found))
'''

AT_SAVE, TRAINED_ON = [0.0, 1.0, 2.0, 3.0], [100.0, 101.0, 102.0, 103.0]

WRITERS = {
    "0.17.1": ("forkserver", "spawn", "fork"),
    "0.16.1": ("spawn", "fork"),  # 0.16's persistent worker is always spawned
    "0.19.2": ("forkserver", "fork"),  # the same writer sources as 0.17.1
}
"""The start methods each megatron-core release's writer runs under ("fork": megatron-core's
temporary worker, ``AsyncCallsQueue(persistent=False)``, which Megatron-LM does not use)."""

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compat is off on CUDA")


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("version", list(WRITERS))
def test_megatrons_writer_runs_on_cpu_and_saves_the_state_at_the_save(tmp_path, version):
    """Every start method gets the stand-ins through the worker's target; the writer writes
    the state at the save, though the trainer changed it before the writer wrote. Without a
    copy (``as_is``) a persistent worker writes the trainer's later state: a CPU tensor reaches
    it as the trainer's own memory, hence the staging copy; a forked worker has its own."""
    from tests.integrations.megatron.settings import version_sys_path

    root = str(Path(__file__).resolve().parents[3])
    path = os.pathsep.join([*version_sys_path(version), root])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    (tmp_path / "driver.py").write_text(DRIVER)
    methods = WRITERS[version]
    cmd = [sys.executable, str(tmp_path / "driver.py"), str(tmp_path), *methods]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for method in methods:
        staged, as_is = found[method]["staged"], found[method]["as_is"]
        assert staged["pid"] != found["trainer"] and staged["values"] == AT_SAVE, (method, staged)
        expected = AT_SAVE if method == "fork" else TRAINED_ON
        assert as_is["values"] == expected, (method, as_is)


@cpu_only
def test_the_compat_makes_the_workers_target_gnmrs_loop():
    """A process object names its target by reference: the worker imports GNMR's loop."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    from gnmr_dist.testing.megatron_cpu import disable_cpu_compat, enable_cpu_compat
    from gnmr_dist.testing.megatron_cpu.writer import writer_loop

    disable_cpu_compat()
    megatrons = PersistentAsyncCaller.async_loop
    try:
        enable_cpu_compat()
        target = PersistentAsyncCaller.async_loop
        assert target is writer_loop
        assert pickle.loads(pickle.dumps(target)) is writer_loop
        assert b"gnmr_dist.testing.megatron_cpu.writer" in pickle.dumps(target)
    finally:
        disable_cpu_compat()
    assert PersistentAsyncCaller.async_loop is megatrons


@cpu_only
def test_the_writers_stand_ins_are_megatrons_writer_modules_only():
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    from gnmr_dist.testing.megatron_cpu.writer import writer_stand_ins

    writer = filesystem_async.FileSystemWriterAsync
    state = torch.arange(4.0)
    buckets = [("file", "key", ([("bytes", b"x")], [("item", state)]))]
    megatrons = writer.preload_tensors
    with writer_stand_ins():
        assert async_utils.torch.cuda.device_count() == 1 and torch.cuda.device_count() == 0
        assert async_utils.torch.cuda.set_device(0) is None
        assert filesystem_async.torch.cuda.synchronize() is None
        assert async_utils.torch.distributed is torch.distributed  # the rest is torch's
        ((name, key, (data, [(item, staged)])),) = writer.preload_tensors(buckets)
        assert (name, key, data, item) == ("file", "key", [("bytes", b"x")], "item")
        assert staged.data_ptr() != state.data_ptr() and torch.equal(staged, state)
    assert async_utils.torch is torch and filesystem_async.torch is torch
    assert writer.preload_tensors is megatrons
    # megatron's own staging of a CPU tensor, with synchronize made harmless: no copy
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        ((_, _, (_, [(_, staged)])),) = writer.preload_tensors(buckets)
    assert staged is state
