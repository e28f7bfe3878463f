"""Where a result file came from: the commit, the library versions and the host that produced it.

Every benchmark that writes a result file stores :func:`record` under the key ``"provenance"``
(per record in an append-only file), and RESULTS.md shows it beside each section. A figure
measured on another machine, another torch or an edited tree is then told apart from the one it
is compared with: ``dirty`` is true when tracked files differed from the commit, the ISA is the
one torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``) and
``threads`` what torch's intra-op pool had when the record was made. A value that cannot be read
is ``"not recorded"``, never a guess.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository the benchmarks run from."""

UNKNOWN = "not recorded"
PACKAGES = ("torch", "megatron-core", "deepspeed")
"""The libraries a figure depends on, by their distribution names."""


def record() -> dict[str, Any]:
    """The provenance of a result written now: commit, versions and host."""
    return {
        **commit(),
        "versions": {"python": platform.python_version(), **versions()},
        "host": host(),
    }


def commit() -> dict[str, Any]:
    """``commit`` (HEAD), ``commit_source`` and ``dirty`` (tracked files differ from it)."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": UNKNOWN, "commit_source": "not a git checkout", "dirty": UNKNOWN}
    # untracked files left out: a result just written or a scratch file is not measured code
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "commit_source": "git rev-parse HEAD (run)", "dirty": bool(status)}


def versions() -> dict[str, str]:
    """The installed version of each of :data:`PACKAGES` (``"not installed"`` when absent)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def host() -> dict[str, Any]:
    """CPU model, the ISA torch dispatches to, torch's threads and the machine's cores."""
    import torch

    return {
        "cpu": _cpu_model(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count() or UNKNOWN,
        "system": platform.platform(),
    }


def _cpu_model() -> str:
    """``model name`` of ``/proc/cpuinfo`` (Linux), else what :mod:`platform` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


def _git(*args: str) -> str | None:
    """The stripped output of ``git args`` in :data:`ROOT`, or None when git cannot answer."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        )
    # no git, not a checkout, or git hung: the record says so rather than failing the benchmark
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
