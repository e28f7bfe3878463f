"""The pip route: the wheel built from this tree holds what the programs need (configs/, the
console scripts, extras that match the programs), and installed in a fresh virtualenv with the
README's extra it runs ``gnmr-ds-pretrain --help``, ``gnmr-launch list`` and ``gnmr-launch check
--world-size 2 demo_deepspeed`` from outside the checkout; without megatron-core,
``gnmr-megatron-pretrain --help`` is a message, not a traceback; ``gnmr-gpu-check --list``
names its checks."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "gnmr-ds-pretrain",
    "gnmr-gpu-check",
    "gnmr-launch",
    "gnmr-megatron-pretrain",
    "gnmr-prepare-data",
    "gnmr-replay",
    "gnmr-report",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run([*cmd, "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("gnmr_dist-*.whl")
    return path


def test_the_wheel_ships_configs_scripts_and_matching_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(info).decode())
        entry = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    shipped = {n.split("gnmr_dist/configs/", 1)[1] for n in names if "gnmr_dist/configs/" in n}
    checkout = {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").rglob("*.*")}
    assert shipped == checkout and "demo_deepspeed.hjson" in shipped
    assert {line.split(" =")[0] for line in entry.splitlines() if " = " in line} == SCRIPTS
    requires = meta.get_all("Requires-Dist")

    def extra(name: str) -> set[str]:
        return {r.split(";")[0].split(">")[0].split("<")[0] for r in requires if name in r}

    # gnmr-ds-pretrain imports transformers (its model), tqdm (its bar), matplotlib (its report)
    assert {"deepspeed", "transformers", "tqdm", "matplotlib", "hjson"} <= extra('"deepspeed"')
    megatron = [r for r in requires if '"megatron"' in r and r.startswith("megatron-core")]
    assert any('python_version >= "3.12"' in r and ">=0.17" in r for r in megatron)
    assert any('python_version < "3.12"' in r for r in megatron)
    assert extra('"torchao"') == {"torchao"}  # the torchao_fp8 backend's one package


def _venv(tmp: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
    return tmp / "bin"


@pytest.mark.slow
def test_a_fresh_venv_with_the_documented_extra_runs_the_programs(
    wheel: Path, tmp_path: Path
) -> None:
    """The README's pip route, as written: torch first (the CPU wheel; an unpinned torch would
    pull a CUDA build), then the wheel with its ``deepspeed`` extra; run from outside the
    checkout, so configs come from the installed package."""
    bin_ = _venv(tmp_path / "venv")
    env = {**os.environ, "DS_BUILD_OPS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip = [str(bin_ / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    for cmd in (
        [*pip, "torch==2.13.0", "setuptools>=64", "wheel"],
        [*pip, "--no-build-isolation", f"{wheel}[deepspeed]"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_ / args[0]), *args[1:]], cwd=work, env=env, capture_output=True, text=True
        )

    assert run("gnmr-ds-pretrain", "--help").returncode == 0
    listed = run("gnmr-launch", "list")
    assert listed.returncode == 0 and "demo_deepspeed.hjson" in listed.stdout.split()
    checked = run("gnmr-launch", "check", "--world-size", "2", "demo_deepspeed")
    assert checked.returncode == 0, checked.stderr[-3000:]
    no_megatron = run("gnmr-megatron-pretrain", "--help")
    assert no_megatron.returncode == 2 and "Traceback" not in no_megatron.stderr
    assert "megatron-core is not installed" in no_megatron.stderr
    assert "--ignore-requires-python megatron-core==0.17.1" in no_megatron.stderr
    listed_checks = run("gnmr-gpu-check", "--list")  # shipped in the package, runs anywhere
    assert listed_checks.returncode == 0 and "megatron_gamma[tensorwise]" in listed_checks.stdout
