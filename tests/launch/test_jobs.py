"""Real jobs through the launch scripts: torchrun and the DeepSpeed launcher on CPU, a job whose
rank 0 is killed at every phase of a checkpoint save in turn under ``torchrun --max-restarts``
and resumes each time, and the Megatron engine through the same script."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gnmr_dist.deepspeed import load_ds_config
from gnmr_dist.telemetry import read_trace
from tests.megatron.settings import training_env
from tests.multiproc import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KILLPOINTS = Path(__file__).resolve().parent / "killpoints"
STEPS = 16
KILL_PHASES = ("before-gnmr", "gnmr-unrenamed", "before-framework", "mid-framework",
               "before-latest", "after-latest")  # fmt: skip
"""The phases of ``tests/launch/killpoints/sitecustomize.py``, one per attempt."""


def launch(*argv: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "MASTER_PORT": str(free_port()), **env}
    out = subprocess.run(list(argv), capture_output=True, text=True, cwd=ROOT, env=full,
                         timeout=540)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The demo config with a tight policy (decisions from step 3) and a tiny model in its
    ``"pretrain"`` block, checkpointing every 2 steps."""
    cfg = load_ds_config(ROOT / "configs" / "demo_deepspeed.hjson")
    cfg["gnmr"].update(warmup_steps=2, alpha=1.05, beta=1.2, max_active=2, lock_steps=2)
    cfg["pretrain"] = {"steps": STEPS, "save_interval": 2, "layers": 2, "hidden": 64,
                       "seq_len": 32, "max_bytes": 200_000, "no_progress": True}  # fmt: skip
    path = tmp_path_factory.mktemp("job") / "tight.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def reference(job) -> Path:
    """An uninterrupted run through the DeepSpeed launcher with a localhost hostfile."""
    hosts = job.parent / "hostfile"
    hosts.write_text("localhost slots=2\n")
    run = job.parent / "reference"
    out = launch("launch/deepspeed.sh", str(hosts), str(job), "--run-dir", str(run))
    assert f"gnmr-ds-pretrain: {STEPS} steps on 2 processes" in out.stdout
    return run


def test_deepspeed_launcher_with_a_localhost_hostfile(reference):
    _, norms, records = read_trace(reference / "trace.jsonl")
    assert norms.shape == (STEPS, 14)
    assert any(r["active"] for r in records)  # the tight policy acts, so the state is not trivial
    assert (reference / "checkpoint" / "latest").read_text().strip() == f"global_step{STEPS}"
    assert json.loads((reference / "summary.json").read_text())["decisions"] == STEPS


def test_a_kill_at_every_phase_of_a_save_resumes_with_the_uninterrupted_decisions(
    job, reference, tmp_path
):
    """Attempt r of one torchrun job (``MAX_RESTARTS=6``) kills rank 0 at phase r of its second
    save: before GNMR's file, with it written but not renamed, before DeepSpeed's files,
    between them, before ``latest``, after ``latest``. Each restart resumes from the checkpoint
    ``latest`` names, which is always complete; the trace the job leaves (records after a
    resume point are dropped and rewritten) and every checkpoint's GNMR state equal the
    uninterrupted run's."""
    run = tmp_path / "killed"
    path = os.pathsep.join(filter(None, [str(KILLPOINTS), os.environ.get("PYTHONPATH")]))
    kill_env = {"GNMR_TEST_KILL_PHASES": ",".join(KILL_PHASES), "PYTHONPATH": path}
    out = launch("launch/torchrun.sh", str(job), "--run-dir", str(run),
                 NPROC_PER_NODE="2", MAX_RESTARTS=str(len(KILL_PHASES)), **kill_env)  # fmt: skip
    for phase in KILL_PHASES:
        assert f"kill point {phase}: rank 0 sends itself SIGKILL" in out.stderr
    # the checkpoint each attempt restarts from: the one before the killed save, except after
    # 'latest' was written
    assert "resumed at step 14" in out.stdout  # the last attempt's summary
    resumed = [int(x) for x in re.findall(r"resumed from \S+ at step (\d+)", out.stderr)]
    assert sorted(set(resumed)) == [2, 4, 6, 8, 10, 14], resumed
    assert _records(run) == _records(reference)
    for step in range(2, STEPS + 1, 2):
        tag = f"global_step{step}"
        got = torch.load(run / "checkpoint" / tag / "gnmr_state.pt", weights_only=True)
        want = torch.load(reference / "checkpoint" / tag / "gnmr_state.pt", weights_only=True)
        _assert_same(got, want)


def _records(run: Path) -> list[dict]:
    lines = (run / "trace.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[1:]]


def _assert_same(got, want) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


def test_megatron_demo_through_torchrun_from_outside_the_repository(tmp_path):
    """``launch/torchrun.sh megatron/demo_cpu`` run from another directory: the set's GNMR block
    is found next to it, the outputs land under the working directory."""
    env = training_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    cmd = [str(ROOT / "launch" / "torchrun.sh"), "megatron/demo_cpu", "--train-iters", "6",
           "--lr-warmup-iters", "2",
           "--save-interval", "6", "--log-interval", "3"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run = tmp_path / "runs" / "megatron_demo"
    header, norms, _ = read_trace(run / "trace.jsonl")
    assert norms.shape[0] == 6 and len(header.units) == norms.shape[1] == 16
    assert (run / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
