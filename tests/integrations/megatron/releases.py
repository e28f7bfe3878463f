"""The megatron-core releases the CPU tests run on, where each is installed, and the
environments of Megatron-LM's training loop: ``MEGATRON_VERSIONS`` (the first is the venv's, the
others installed by ``make`` with ``pip install --target .venv/mcore/<version>`` and chosen per
worker with ``multiproc.run(..., sys_path_prepend=version_sys_path(version))``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

MEGATRON_VERSIONS = ("0.17.1", "0.16.1", "0.19.2")
"""megatron-core releases the CPU tests run on; the first is the main venv's."""


def megatron_path(version: str) -> str | None:
    """The ``--target`` directory of an extra release (None for the main venv's release)."""
    if version not in MEGATRON_VERSIONS:
        raise ValueError(f"unknown megatron-core version {version!r}; have {MEGATRON_VERSIONS}")
    if version == MEGATRON_VERSIONS[0]:
        return None
    return str(Path(sys.prefix) / "mcore" / version)


def version_sys_path(version: str) -> list[str]:
    """``sys_path_prepend`` for a worker on ``version``; skips (locally) or fails (CI) if absent.

    An extra release counts as installed when its directory holds the ``.installed`` stamp that
    ``make`` writes after a complete install. With ``CI=true`` a missing one fails the test: CI
    must run every release.
    """
    import pytest

    path = megatron_path(version)
    if path is None:
        return []
    if not Path(path, ".installed").is_file():
        reason = (
            f"megatron-core {version} is not installed in {path} "
            "(`make test` installs it, or `make mcore-versions`)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run every version in MEGATRON_VERSIONS")
        pytest.skip(reason)
    return [path]


TRAINING_VERSION = "0.17.1"
"""The release the ``megatron.training`` tests run on (0.16 ships none; 0.19's does not import on
Python 3.11: it uses ``typing.override``)."""


def training_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess on :data:`TRAINING_VERSION` (the repository importable,
    launcher variables that would change the world size removed); skips or fails as
    :func:`version_sys_path` does when the release is not installed."""
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*version_sys_path(TRAINING_VERSION), root])}
    for name in ("NPROC_PER_NODE", "NNODES", "CUDA_DEVICE_MAX_CONNECTIONS", "WORLD_SIZE"):
        env.pop(name, None)
    return {**env, **extra}


_LAUNCH_CHECKS = """
import contextlib, io, json, sys
from gnmr_dist.train import launch
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = launch.main(argv)
        except SystemExit as stop:
            code = stop.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def launch_checks(
    cases: Sequence[Sequence[str]], cwd: str | Path, **env: str
) -> list[tuple[int, str, str]]:
    """``gnmr-launch`` ``main(argv)`` for each argv, in ONE fresh interpreter on
    :data:`TRAINING_VERSION`: ``[(exit status, stdout, stderr)]`` (one megatron import for all)."""
    import json
    import subprocess

    cmd = [sys.executable, "-c", _LAUNCH_CHECKS, json.dumps([list(c) for c in cases])]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=cwd, timeout=300, env=training_env(**env)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout.splitlines()[-1])]


def megatron_version() -> str:
    """The imported megatron-core's ``major.minor.patch`` (0.19 appends ``+<git hash>``)."""
    from gnmr_dist.integrations.megatron.versions import installed_version

    return installed_version().split("+")[0]
