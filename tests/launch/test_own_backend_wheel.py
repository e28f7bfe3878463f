"""An own backend shipped as a package (issue 33, item 3): a wheel built here, installed, and run
by ``gnmr-ds-pretrain`` and ``gnmr-megatron-pretrain`` with no flag and no ``PYTHONPATH``; a bad
option value of it is refused before training, naming the key, the value and the type.

The plug-in is a project written into a temporary folder (a ``pyproject.toml`` declaring its
module in the ``gnmr_dist.backends`` entry-point group, and that module: a backend with an option
dataclass, through gnmr-dist's public API only, nothing from this repository's ``tests``). pip
builds its wheel offline (``pip wheel --no-build-isolation --no-index``: setuptools is the
venv's) and installs it into a throwaway virtual environment:

- ``python -m venv --system-site-packages`` made from this venv's interpreter would see the
  *base* interpreter's site-packages (``pyvenv.cfg``'s ``home``), not this venv's, so it has no
  torch and no gnmr-dist. The throwaway venv is made ``--without-pip`` instead, and its
  site-packages holds one ``.pth`` line, ``import site; site.addsitedir(<this venv's
  site-packages>)``: this venv's packages become installed packages of the new one (after its
  own site-packages), ``.pth`` files included, so gnmr-dist's editable install resolves as it
  does here. Nothing goes into this venv, which other test runs share.
- pip (this venv's, seen through that ``.pth``) run by the new interpreter installs the wheel
  there with ``--no-deps --no-index``: a real ``*.dist-info`` with its ``entry_points.txt``.
- The programs are the installed console scripts (``bin/gnmr-ds-pretrain``,
  ``bin/gnmr-megatron-pretrain`` next to this interpreter) run by the new venv's interpreter (a
  console script is a Python file; its ``#!`` names this venv's interpreter, which does not
  have the plug-in: the control run shows it refused there). They run in a temporary working
  directory with ``PYTHONPATH`` removed from the environment.

The training runs are torchrun on one process (DeepSpeed's ``init_distributed`` needs a
launcher's environment), three steps of the smallest models the programs' other tests use; the
refusals run the console script alone, as they end before any process group. 30 to 40 s in all
on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gnmr_dist.telemetry import read_trace
from tests.requires import missing

pytestmark = pytest.mark.slow

BACKEND = "wheel_rounded"
MARKS = "GNMR_WHEEL_PLUGIN_MARKS"
"""The variable naming the file where the plug-in notes, per process, each path its GEMM ran."""
BAD = "gnmr.low_cost.mantissa_bits: '2' is str, expected int"
"""The refusal of ``"mantissa_bits": "2"`` (the dataclass says ``int``)."""

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "gnmr-wheel-plugin"
version = "0.1"
description = "A precision backend of its own, found through its entry point"

[project.entry-points."gnmr_dist.backends"]
{BACKEND} = "gnmr_wheel_plugin"

[tool.setuptools]
py-modules = ["gnmr_wheel_plugin"]
"""

PLUGIN = f'''
"""The plug-in's backend: GEMM operands rounded to mantissa_bits on the low-cost path."""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gnmr_dist.backends import LOW_COST, PrecisionBackend, register_backend

_NOTED = set()


def _note(path):
    """Write "<pid> <path>" to the file ${MARKS} names, once per path and process."""
    if path not in _NOTED and os.environ.get("{MARKS}"):
        _NOTED.add(path)
        with open(os.environ["{MARKS}"], "a") as marks:
            marks.write(f"{{os.getpid()}} {{path}}\\n")


@dataclass(frozen=True)
class Rounding:
    mantissa_bits: int = 3


@dataclass(frozen=True)
class Exact:
    pass


def round_mantissa(t, bits):
    mantissa, exponent = torch.frexp(t.detach().float())
    rounded = torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent).to(t.dtype)
    return t + (rounded - t).detach()


@register_backend("{BACKEND}")
class WheelRounded(PrecisionBackend):
    LowCost = Rounding
    Recovery = Exact
    adapted_gemms = True

    def make_gemm(self, op, path):
        bits = self.low_cost.mantissa_bits if path == LOW_COST else None

        def gemm(x, weight, bias):
            _note(path)
            if bits is not None:
                x, weight = round_mantissa(x, bits), round_mantissa(weight, bits)
            return F.linear(x, weight, bias)

        return gemm
'''

GNMR = {"backend": BACKEND, "low_cost": {"mantissa_bits": 4}, "max_active": 1, "warmup_steps": 2}
DS_ARGS = shlex.split(
    "--steps 3 --layers 1 --hidden 32 --seq-len 32 --max-bytes 200000 --heldout-batches 1"
)
MEGATRON_ARGS = shlex.split("""
--num-layers 1 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 64 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3
--train-iters 3 --tokenizer-type NullTokenizer --vocab-size 64 --mock-data --eval-iters 0
--log-interval 1
""")
LAUNCHER_VARS = (
    "PYTHONPATH",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NPROC_PER_NODE",
    "NNODES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


@dataclass(frozen=True)
class Installed:
    python: Path
    """The throwaway venv's interpreter, with the plug-in's wheel installed."""


def _script(name: str) -> str:
    """The console script ``name`` installed next to this interpreter."""
    path = Path(sys.executable).with_name(name)
    if not path.is_file():
        missing(f"{path} is not installed (`make venv` installs gnmr-dist's console scripts)")
    return str(path)


def _env(marks: Path | None = None) -> dict[str, str]:
    """This environment without ``PYTHONPATH`` or a launcher's variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != MARKS}
    env.update(OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if marks is not None:
        env[MARKS] = str(marks)
    return env


def _run(cmd: list[Any], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _ok(done: subprocess.CompletedProcess) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"exit {done.returncode}:\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The plug-in built as a wheel and installed into a throwaway venv (module docstring)."""
    root = tmp_path_factory.mktemp("own_backend_wheel")
    project = root / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "gnmr_wheel_plugin.py").write_text(PLUGIN)
    offline = ["--no-deps", "--no-index", "--disable-pip-version-check", "--quiet"]
    build = [sys.executable, "-m", "pip", "wheel", *offline, "--no-build-isolation"]
    _ok(_run([*build, "--wheel-dir", root / "wheels", project], root, _env()))
    (wheel,) = (root / "wheels").glob("gnmr_wheel_plugin-0.1-*.whl")

    venv = root / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], root, _env()))
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_ok(_run([python, "-c", where], root, _env())).strip())
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    lines = [f"import site; site.addsitedir({path!r})\n" for path in ours]
    (site / "_gnmr_dist_base_venv.pth").write_text("".join(lines))
    _ok(_run([python, "-m", "pip", "install", *offline, wheel], root, _env()))

    check = (
        "import importlib.metadata as m, json; "
        "d = m.distribution('gnmr-wheel-plugin'); "
        "print(json.dumps([str(d.locate_file('gnmr_wheel_plugin.py')), "
        "[(p.name, p.value) for p in m.entry_points(group='gnmr_dist.backends')]]))"
    )
    located, points = json.loads(_ok(_run([python, "-c", check], root, _env())))
    assert Path(located).parent == site  # installed into the throwaway venv, not this one
    assert points == [[BACKEND, "gnmr_wheel_plugin"]]
    assert importlib.util.find_spec("gnmr_wheel_plugin") is None  # this venv lacks it
    return Installed(python=python)


def _paths_noted(marks: Path) -> set[str]:
    return {line.split()[1] for line in marks.read_text().splitlines()} if marks.exists() else set()


def _ds_config(tmp_path: Path, low_cost: dict[str, Any]) -> Path:
    path = tmp_path / "ds.json"
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    block = {**GNMR, "low_cost": low_cost}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "gnmr": block}
    path.write_text(json.dumps(config))
    return path


def _megatron_config(tmp_path: Path, low_cost: dict[str, Any]) -> Path:
    path = tmp_path / "gnmr.json"
    path.write_text(json.dumps({"gnmr": {**GNMR, "low_cost": low_cost}}))
    return path


def _require_megatron_training() -> None:
    """gnmr-megatron-pretrain is Megatron-LM's loop: megatron-core 0.17+ in this venv."""
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.training") is None
    ):
        missing(
            f"megatron-core with megatron.training (0.17+) is not installed in {sys.prefix}, "
            "which gnmr-megatron-pretrain needs (`make venv` installs 0.17.1)"
        )


def _torchrun(installed: Installed) -> list[Any]:
    """torchrun of one process, on the throwaway venv's interpreter (so are its workers)."""
    return [installed.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]


def test_ds_pretrain_trains_with_the_installed_backend(installed, tmp_path):
    program = _script("gnmr-ds-pretrain")
    config, run = _ds_config(tmp_path, {"mantissa_bits": 4}), tmp_path / "run"
    marks = tmp_path / "m"
    args = ["--config", config, "--run-dir", run, *DS_ARGS, "--no-progress"]
    bare = _run([sys.executable, program, *args], tmp_path, _env(marks))  # this venv: no plug-in
    assert bare.returncode == 2 and f"unknown backend {BACKEND!r}" in bare.stderr, bare.stderr
    assert not run.exists()

    out = _ok(_run([*_torchrun(installed), program, *args], tmp_path, _env(marks)))
    assert f"gnmr-ds-pretrain: 3 steps on 1 processes ({BACKEND} backend, 7 units)" in out
    header, norms, _ = read_trace(run / "trace.jsonl")
    assert header.meta["backend"] == BACKEND and norms.shape == (3, 7)
    assert all(header.eligible)  # the plug-in runs every projection of the model
    assert "low_cost" in _paths_noted(marks)  # its GEMM ran the forwards


def test_megatron_pretrain_trains_with_the_installed_backend(installed, tmp_path):
    _require_megatron_training()
    program = _script("gnmr-megatron-pretrain")
    config, trace = _megatron_config(tmp_path, {"mantissa_bits": 4}), tmp_path / "trace.jsonl"
    marks = tmp_path / "m"
    args = [*MEGATRON_ARGS, "--gnmr-config", config, "--gnmr-trace", trace]
    env = {**_env(marks), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    _ok(_run([*_torchrun(installed), program, *args], tmp_path, env))
    header, norms, _ = read_trace(trace)
    assert header.meta["backend"] == BACKEND and header.meta["source"] == "megatron.training"
    assert norms.shape == (3, 4) and all(header.eligible)  # qkv, proj, fc1, fc2 of one layer
    assert "low_cost" in _paths_noted(marks)


@pytest.mark.parametrize("program", ["gnmr-ds-pretrain", "gnmr-megatron-pretrain"])
def test_a_bad_option_value_is_refused_before_training(installed, tmp_path, program):
    """``"mantissa_bits": "2"`` where the plug-in's dataclass says ``int``: exit status 2 with
    the key, the value and the type named, and nothing trained (no trace, no run folder, no
    GEMM of the plug-in, no process group)."""
    marks = tmp_path / "m"
    if program == "gnmr-ds-pretrain":
        config, run = _ds_config(tmp_path, {"mantissa_bits": "2"}), tmp_path / "run"
        args = ["--config", config, "--run-dir", run, *DS_ARGS]
        trace = run / "trace.jsonl"
    else:
        _require_megatron_training()
        config, trace = _megatron_config(tmp_path, {"mantissa_bits": "2"}), tmp_path / "t.jsonl"
        args = [*MEGATRON_ARGS, "--gnmr-config", config, "--gnmr-trace", trace]
    done = _run([installed.python, _script(program), *args], tmp_path, _env(marks))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-4000:]
    assert BAD in done.stderr, done.stderr[-4000:]
    assert not trace.exists() and not marks.exists() and not (tmp_path / "run").exists()
    assert "initializing torch distributed" not in out
