"""Issue 41: the shipped programs and tools against every policy key of docs/algorithm.md.

Three policies cover every key of :class:`~gnmr_dist.core.GNMRConfig` and every form a key takes
(a number, a schedule on the step clock with and without ``"from"``, a schedule and a condition
on the lr_decay clock; ``pinned`` by ``"all"``, by pattern and by ``last_layers``; ``gemms``
short of three). Each runs through ``gnmr-launch check``, then ``gnmr-ds-pretrain`` (2 ranks,
10 steps; the first policy in 6 steps and a resume to 10) and ``gnmr-megatron-pretrain`` (2
ranks at TP2, 8 iterations), and each trace through ``gnmr-replay`` (which must reproduce every
recorded decision) and ``gnmr-report``. Every program ends with rc 0 or a refusal that names the
key, and none prints a traceback. At 035e91e ``gnmr-ds-pretrain`` ended every such run with rc 1
while drawing ``report.png`` (item 1) and ``gnmr-replay`` / ``gnmr-report`` refused the
traces (item 2).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_dist.core import GNMRConfig
from gnmr_dist.deepspeed import load_ds_config
from tests.multiproc import torchrun
from tests.requires import require

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS, RESUMED = 6, 10

SECOND = {
    "max_active": {"schedule": "linear", "start": 1, "end": 3, "steps": 6},
    "max_share": 0.4,
    "latch": {"step": 3},
    "pinned": {"units": {"last_layers": 1}},
    "gamma": 0.05,
    "error_every": 2,
    "alpha": {"schedule": "cosine", "start": 3.0, "end": 1.5, "steps": 4, "from": 2},
}
"""The compute-share budget, a latch and pinned units on the step clock, with the damage term."""

LR_CLOCK = {
    "max_active": {"schedule": "step", "start": 1, "end": 3, "clock": "lr_decay", "to": 0.3},
    "max_share": {"schedule": "linear", "start": 0.2, "end": 0.5, "steps": 8},
    "latch": {"lr_decay": 0.3},
    "pinned": {"units": ["*.mlp.*", "*.linear_fc1"], "from": {"lr_decay": 0.5}},
    "gamma": {"schedule": "linear", "start": 1.0, "end": 0.1, "clock": "lr_decay"},
    "beta": {"schedule": "step", "start": 3.0, "end": 2.0, "steps": 5},
}
"""Every key on the learning-rate clock (the runs' learning rate decays to 0 by step 10)."""

LATE_SWITCH = {
    "backend": "fp8_emulated",  # per-GEMM recovery (act_quant recovers wgrad or nothing)
    "low_cost": {"format": "e4m3", "granularity": "tensor"},
    "recovery": {},
    "max_active": 0,
    "gemms": ["fprop"],
    "pinned": {"units": "all", "from": {"lr_decay": 0.5}},
    "lock_steps": 0,
    "window": 1,
    "warmup_steps": 0,
}
"""NVIDIA's late switch, forward only (docs/algorithm.md#latch-and-pinned-units)."""

POLICIES = {"second": SECOND, "lr_clock": LR_CLOCK, "late_switch": LATE_SWITCH}

BASE = {
    "backend": "act_quant",
    "units": "operator",
    "max_active": 2,
    "lock_steps": 2,
    "window": 4,
    "alpha": 2.0,
    "beta": 2.5,
    "warmup_steps": 2,
    "low_cost": {"bits": 4, "group_size": 32},
    "recovery": {"bits": 8, "group_size": 32},
}


def test_the_policies_cover_every_key_and_form():
    """A key added to the policy fails here until a policy of the matrix sets it."""
    keys = {k for p in POLICIES.values() for k in p} | set(BASE)
    assert set(GNMRConfig.field_names()) <= keys
    for policy in POLICIES.values():
        GNMRConfig.from_dict(
            {k: v for k, v in {**BASE, **policy}.items() if k in GNMRConfig.field_names()}
        )
    forms = json.dumps(POLICIES)
    for form in (
        '"clock": "lr_decay"',
        '"from": 2',
        '"lr_decay": 0.3',
        '"step": 3',
        '"all"',
        '"last_layers"',
        '"*.mlp.*"',
        '"fprop"',
    ):
        assert form in forms


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-4000:]
    return done


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


def _tools(trace: Path, steps: int) -> None:
    """gnmr-replay reproduces every recorded decision; gnmr-report draws the trace."""
    out = _ok(_run([str(BIN / "gnmr-replay"), str(trace), "--json"], trace.parent))
    replayed = json.loads(out)
    assert replayed["steps"] == steps and replayed["matches_recorded"] == steps
    png = trace.parent / "tool_report.png"
    out = _ok(_run([str(BIN / "gnmr-report"), str(trace), "--out", str(png)], trace.parent))
    assert out.startswith(f"gnmr-report: wrote {png}") and png.stat().st_size > 20_000


def _ds_config(tmp: Path, policy: dict) -> Path:
    config = load_ds_config(ROOT / "configs" / "demo_deepspeed.hjson")
    config["gnmr"] = {**BASE, **policy}
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": RESUMED, "warmup_num_steps": 2, "warmup_max_lr": 3e-3},
    }
    path = tmp / "ds.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", list(POLICIES))
def test_gnmr_ds_pretrain_runs_resumes_and_its_trace_replays(tmp_path, name):
    config, run = _ds_config(tmp_path, POLICIES[name]), tmp_path / "run"
    check = [str(BIN / "gnmr-launch"), "check", "--world-size", "2", str(config)]
    assert "valid" in _ok(_run(check, ROOT))
    program = [*torchrun(2), "-m", "gnmr_dist.cli.ds_pretrain", "--config", str(config)]
    shape = shlex.split("--layers 2 --hidden 32 --seq-len 32 --max-bytes 200000 --no-progress")
    # One policy stops and resumes; the others run straight through (the resume's own keys are
    # the same for every policy, and each launch costs CI about 12 s of startup).
    for steps in (STEPS, RESUMED) if name == "second" else (RESUMED,):
        cmd = [*program, *shape, "--run-dir", str(run), "--steps", str(steps)]
        _ok(_run(cmd, ROOT))
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == steps and summary["decisions"] == steps
        assert summary["model"].startswith("Llama 2 x 32, ")
        assert (run / "report.png").stat().st_size > 20_000
    assert summary["resumed_from"] == (STEPS if name == "second" else 0)
    assert summary["accounting"]["recovered_unit_steps"] > 0
    _tools(run / "trace.jsonl", RESUMED)


MEGATRON = """
--tensor-model-parallel-size 2 --sequence-parallel --num-layers 2 --hidden-size 64
--num-attention-heads 4 --ffn-hidden-size 128 --swiglu --normalization RMSNorm
--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
--seq-length 32 --max-position-embeddings 32 --bf16 --micro-batch-size 2 --global-batch-size 4
--lr 3e-3 --min-lr 0 --lr-warmup-iters 2 --lr-decay-style linear --lr-decay-iters 8
--train-iters 8 --tokenizer-type NullTokenizer --vocab-size 256 --mock-data --eval-iters 0
--eval-interval 1000 --log-interval 4 --seed 1234
"""


@pytest.mark.parametrize("name", list(POLICIES))
def test_gnmr_megatron_pretrain_runs_and_its_trace_replays(tmp_path, name):
    require("megatron.training")
    from tests.integrations.megatron.settings import training_env

    block = {**BASE, **POLICIES[name], "attribution": {"max_rest_share": 0.999}}
    (tmp_path / "gnmr.json").write_text(json.dumps({"gnmr": block}))
    args = tmp_path / "job.args"
    trace = tmp_path / "trace.jsonl"
    args.write_text(f"{MEGATRON}\n--gnmr-config gnmr.json --gnmr-trace {trace}\n")
    check = [str(BIN / "gnmr-launch"), "check", "--world-size", "2", str(args)]
    assert "valid" in _ok(_run(check, tmp_path))
    env = training_env(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    run = [str(BIN / "gnmr-launch"), "torchrun", "--nproc-per-node", "2", str(args)]
    done = _run(run, tmp_path, env)
    _ok(done)
    assert "gnmr: 8 steps, 8 units: recovered" in done.stdout + done.stderr
    _tools(trace, 8)


REFUSED = [
    ({"backend": None, "gamma": 0.5}, "gnmr.gamma"),
    ({"backend": "te_fp8", "low_cost": {}, "gamma": 0.5, "gemms": ["fprop"]}, "gnmr.gamma"),
    ({"max_share": 1.5}, "gnmr.max_share must be a number >= 0 and <= 1, got 1.5"),
    ({"pinned": {"units": {"last_layers": 0}}}, "gnmr.pinned.units.last_layers"),
    ({"latch": {"lr_decay": 2}}, "gnmr.latch.lr_decay"),
    ({"max_active": {**LR_CLOCK["max_active"], "steps": 5}}, "gnmr.max_active"),
    ({"alpha": {"schedule": "cosine", "start": 3, "end": 1, "steps": 4, "to": 9}}, "gnmr.alpha"),
    ({"include": ["*.no_such_proj"]}, "fix gnmr.include / gnmr.exclude"),
]
"""Policies every program refuses before it starts, and the key the refusal names."""


@pytest.mark.parametrize("policy, key", REFUSED, ids=[k for _, k in REFUSED])
def test_a_bad_policy_is_refused_by_name_before_anything_starts(tmp_path, policy, key):
    config = _ds_config(tmp_path, policy)
    for verb in (["check", "--world-size", "2"], ["torchrun", "--nproc-per-node", "2"]):
        done = _run([str(BIN / "gnmr-launch"), *verb, str(config), "--layers", "1"], ROOT)
        assert done.returncode == 2 and key in done.stderr, done.stderr[-3000:]
    bad = json.loads(config.read_text())["gnmr"]
    bad.pop("include", None)  # gnmr-replay takes the policy keys only
    trace = tmp_path / "trace.jsonl"
    rows = [{"step": 1, "norms": [1.0], "active": [], "telemetry": {}, "extra": {}, "lr": 1.0}]
    good = {k: v for k, v in BASE.items() if k in GNMRConfig.field_names()}
    header = {"format": "gnmr-trace", "version": 1, "units": ["layers.0.q"], "eligible": [True]}
    trace.write_text("\n".join(map(json.dumps, [{**header, "config": good}, *rows])) + "\n")
    flags = [f"--{k.replace('_', '-')}" for k in policy if k in GNMRConfig.field_names()]
    for flag in flags:
        value = json.dumps(bad[flag[2:].replace("-", "_")])
        done = _run([str(BIN / "gnmr-replay"), str(trace), flag, value], ROOT)
        assert done.returncode == 2 and done.stderr.startswith("gnmr-replay: "), done.stderr
