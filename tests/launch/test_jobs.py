"""Real jobs through the launch scripts: torchrun and the DeepSpeed launcher on CPU, a job whose
rank 0 is killed at every phase of a checkpoint save in turn under ``torchrun --max-restarts``
and resumes each time, and the Megatron engine through the same script."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gnmr_dist.deepspeed import load_ds_config
from gnmr_dist.telemetry import read_trace
from tests.integrations.megatron.settings import training_env
from tests.multiproc import launcher_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NETNS_PORT = 29400
"""The two-host rendezvous port: bound inside the test's own network namespaces, where no other
process lives, so a fixed port cannot be taken (a port probed in the machine's namespace would
say nothing about them)."""
KILLPOINTS = Path(__file__).resolve().parent / "killpoints"
STEPS = 16
KILL_PHASES = (
    "before-gnmr",
    "gnmr-unrenamed",
    "before-framework",
    "mid-framework",
    "before-latest",
    "after-latest",
)
"""The phases of ``tests/launch/killpoints/sitecustomize.py``, one per attempt."""


def _job_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job whose trace is compared bit for bit with another launch's.

    ``MASTER_PORT`` removed: a one-node launch then runs ``torchrun --standalone``, whose agent
    binds a port the OS assigns (``tests.multiproc.torchrun`` says why). One thread per
    process: torchrun sets it only with several processes per node and DeepSpeed's launcher
    not at all, and the thread count decides how reductions and GEMMs are split, so two
    launches compare bit for bit only at the same count."""
    return {**{k: v for k, v in env.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1"}


def launch(*argv: str, **env: str) -> subprocess.CompletedProcess:
    full = {**_job_env(dict(os.environ)), **env}
    out = subprocess.run(
        list(argv), capture_output=True, text=True, cwd=ROOT, env=full, timeout=540
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The demo config with a tight policy (decisions from step 3) and a tiny model in its
    ``"pretrain"`` block, checkpointing every 2 steps."""
    cfg = load_ds_config(ROOT / "configs" / "demo_deepspeed.hjson")
    cfg["gnmr"].update(warmup_steps=2, alpha=1.05, beta=1.2, max_active=2, lock_steps=2)
    cfg["pretrain"] = {
        "steps": STEPS,
        "save_interval": 2,
        "layers": 2,
        "hidden": 64,
        "seq_len": 32,
        "max_bytes": 200_000,
        "no_progress": True,
    }
    path = tmp_path_factory.mktemp("job") / "tight.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def reference(job) -> Path:
    """An uninterrupted run through the DeepSpeed launcher with a localhost hostfile."""
    hosts = job.parent / "hostfile"
    hosts.write_text("localhost slots=2\n")
    run = job.parent / "reference"
    port = str(launcher_port())  # DeepSpeed's launcher binds the port it is told, later
    out = launch(
        "launch/deepspeed.sh", str(hosts), str(job), "--run-dir", str(run), MASTER_PORT=port
    )
    assert f"gnmr-ds-pretrain: {STEPS} steps on 2 processes" in out.stdout
    return run


def test_deepspeed_launcher_with_a_localhost_hostfile(reference):
    _, norms, records = read_trace(reference / "trace.jsonl")
    assert norms.shape == (STEPS, 14)
    assert any(r["active"] for r in records)  # the tight policy acts, so the state is not trivial
    assert (reference / "checkpoint" / "latest").read_text().strip() == f"global_step{STEPS}"
    assert json.loads((reference / "summary.json").read_text())["decisions"] == STEPS


def test_a_kill_at_every_phase_of_a_save_resumes_with_the_uninterrupted_decisions(
    job, reference, hosts, tmp_path
):
    """Attempt r of one torchrun job (``MAX_RESTARTS=6``) kills rank 0 at phase r of its second
    save: before GNMR's file, with it written but not renamed, before DeepSpeed's files,
    between them, before ``latest``, after ``latest``. Each restart resumes from the checkpoint
    ``latest`` names, which is always complete; the trace the job leaves (records after a
    resume point are dropped and rewritten) and every checkpoint's GNMR state equal the
    uninterrupted run's. The job runs on two hosts (2 x 1 processes, ``NNODES=2``) where
    network namespaces can be made, else on this one (1 x 2)."""
    run = tmp_path / "killed"
    path = os.pathsep.join(filter(None, [str(KILLPOINTS), os.environ.get("PYTHONPATH")]))
    kill_env = {"GNMR_TEST_KILL_PHASES": ",".join(KILL_PHASES), "PYTHONPATH": path}
    argv = ["launch/torchrun.sh", str(job), "--run-dir", str(run)]
    restarts = str(len(KILL_PHASES))
    if hosts:
        out = _on_two_hosts(
            hosts, [str(ROOT / argv[0]), *argv[1:]], tmp_path, {**os.environ, **kill_env}, restarts
        )
    else:
        done = launch(*argv, NPROC_PER_NODE="2", MAX_RESTARTS=restarts, **kill_env)
        out = done.stdout + done.stderr
    for phase in KILL_PHASES:
        assert f"kill point {phase}: rank 0 sends itself SIGKILL" in out
    # the checkpoint each attempt restarts from: the one before the killed save, except after
    # 'latest' was written
    assert "resumed at step 14" in out  # the last attempt's summary
    resumed = [int(x) for x in re.findall(r"resumed from \S+ at step (\d+)", out)]
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


MEGATRON_RUN = shlex.split(
    "megatron/demo_cpu --train-iters 16 --lr-warmup-iters 2 --save-interval 5 --log-interval 4 "
    "--gnmr-inject-grad-spike 11:1:100"
)
"""The Megatron demo, short: checkpoints at 5, 10, 15 and 16, a spike GNMR acts on at 11."""


@pytest.fixture(scope="module")
def megatron_reference(tmp_path_factory) -> Path:
    """``launch/torchrun.sh megatron/demo_cpu`` run from another directory, uninterrupted."""
    work = tmp_path_factory.mktemp("megatron_reference")
    env = _job_env(training_env(NPROC_PER_NODE="2"))
    cmd = [str(ROOT / "launch" / "torchrun.sh"), *MEGATRON_RUN]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return work / "runs" / "megatron_demo"


def test_megatron_demo_through_torchrun_from_outside_the_repository(megatron_reference):
    """The set's GNMR block is found next to it, the outputs land under the working
    directory."""
    run = megatron_reference
    header, norms, records = read_trace(run / "trace.jsonl")
    assert norms.shape[0] == 16 and len(header.units) == norms.shape[1] == 16
    assert any(r["active"] for r in records)  # the spike at iteration 11 is acted on
    assert (run / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "16"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


# ------------------------------------------------------------------ two hosts on one machine


@dataclass(frozen=True)
class Host:
    netns: str
    addr: str
    iface: str


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair: each host sees only its own loopback and
    the 10.213.N.0/24 link between them. ``[]`` where namespaces cannot be made (no root, no
    CAP_NET_ADMIN, no ``ip``); the reason is printed."""
    tag = os.getpid() % 10_000
    net = f"10.213.{tag % 250}"
    made = [Host(f"gnmr{tag}{x}", f"{net}.{i + 1}", f"gv{tag}{x}") for i, x in enumerate("ab")]
    a, b = made
    setup = [
        ["ip", "netns", "add", a.netns],
        ["ip", "netns", "add", b.netns],
        ["ip", "link", "add", a.iface, "type", "veth", "peer", "name", b.iface],
    ]
    for h in made:
        setup += [
            ["ip", "link", "set", h.iface, "netns", h.netns],
            ["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.iface],
            ["ip", "-n", h.netns, "link", "set", h.iface, "up"],
            ["ip", "-n", h.netns, "link", "set", "lo", "up"],
        ]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as err:
        _drop_netns(made)
        reason = getattr(err, "stderr", "") or str(err)
        print(f"network namespaces are not available here: {reason.strip()}")
        yield []
        return
    yield made
    _drop_netns(made)


def _drop_netns(hosts: list[Host]) -> None:
    for h in hosts:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)


def _on_two_hosts(
    hosts: list[Host], argv: list[str], cwd: Path, env: dict[str, str], restarts: str = "1"
) -> str:
    """Run ``argv`` on both hosts at once as a 2-node torchrun job (c10d rendezvous on the
    first host, ``restarts`` restarts allowed); both must succeed. Returns both hosts' output. The
    namespaces share the machine's hostname, which resolves to neither link address, so each
    node names its address (``LOCAL_ADDR``, ``GLOO_SOCKET_IFNAME``) and the first one says it
    serves the rendezvous (``RDZV_CONF=is_host=1``), as on multi-homed cluster nodes."""
    rdzv = f"gnmr-{os.getpid()}-{cwd.name}"
    procs, logs = [], []
    for h in hosts:
        host_env = {
            **_job_env(env),
            "NNODES": "2",
            "NPROC_PER_NODE": "1",
            "MAX_RESTARTS": restarts,
            "RDZV_ENDPOINT": f"{hosts[0].addr}:{NETNS_PORT}",
            "RDZV_ID": rdzv,
            "LOCAL_ADDR": h.addr,
            "GLOO_SOCKET_IFNAME": h.iface,
            "RDZV_CONF": f"is_host={int(h is hosts[0])}",
        }
        log = cwd / f"host_{h.addr}.log"  # a file, not a pipe: neither host may block on it
        logs.append(log)
        cmd = ["ip", "netns", "exec", h.netns, *argv]
        with open(log, "w") as fh:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=host_env, stdout=fh, stderr=fh))
    try:
        for p in procs:
            p.wait(timeout=540)
    finally:
        for p in procs:
            p.kill()
    parts = zip(hosts, logs, strict=True)
    text = "\n".join(f"--- host {h.addr}:\n{log.read_text()}" for h, log in parts)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    return text


def test_two_hosts_resume_a_killed_megatron_worker_with_the_uninterrupted_decisions(
    hosts, megatron_reference, tmp_path
):
    """A Megatron-LM job (the demo, TP2 across the hosts) of 2 x 1 processes under
    ``launch/torchrun.sh`` with ``NNODES=2``; the worker of the last rank SIGKILLs itself
    before iteration 13 on the first attempt, torchrun restarts both hosts' workers, both
    resume from iteration 10, and every trace record equals the single-host uninterrupted
    run's. (The DeepSpeed job runs on the two hosts in the kill-at-every-phase test.)"""
    if not hosts:
        pytest.skip("network namespaces are not available here")
    out = _on_two_hosts(
        hosts,
        [str(ROOT / "launch" / "torchrun.sh"), *MEGATRON_RUN, "--gnmr-fail-at", "13"],
        tmp_path,
        training_env(),
    )
    assert "--gnmr-fail-at 13: rank 1 sends itself SIGKILL" in out
    assert _records(tmp_path / "runs" / "megatron_demo") == _records(megatron_reference)
