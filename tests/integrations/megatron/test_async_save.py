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
waits forever) and its preload calls ``torch.cuda.synchronize()``
(``strategies/filesystem_async.py:248``). GNMR's CPU compatibility is not on in the writer (it
is the training process's), so the script below stands those three in, in the writer only.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
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

import torch

from gnmr_dist.integrations.megatron.loop import attached
from gnmr_dist.train.megatron_flags import attach_from_argv
from tests.integrations.megatron.own_pretrain import datasets_provider, forward_step, model_provider

if __name__ == "__mp_main__" and not torch.cuda.is_available():
    # megatron's checkpoint writer on a CPU host (test_async_save.py's docstring)
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None

extra_args_provider = attach_from_argv()  # at module level, as users write it

if __name__ == "__mp_main__":
    said = f"helper {os.getpid()} re-imported the script; GNMR attached: {attached() is not None}"
    print(said, file=sys.stderr, flush=True)

if __name__ == "__main__":
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    pretrain(
        datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=extra_args_provider,
    )
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
