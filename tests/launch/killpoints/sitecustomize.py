"""Kill points for ``tests/launch/test_jobs.py``: SIGKILL rank 0 at one phase of a checkpoint save.

Python imports this module at start-up when its directory is on ``PYTHONPATH`` (the test puts
it there for the workers torchrun starts); without ``GNMR_TEST_KILL_PHASES`` it does nothing.
With ``GNMR_TEST_KILL_PHASES=p0,p1,...`` the worker of global rank 0 in attempt ``r``
(``TORCHELASTIC_RESTART_COUNT``) kills itself at phase ``p_r`` of the second checkpoint save of
that attempt (the first one completes, so every attempt moves the run on). A save on rank 0
is, in order:

    before-gnmr        open(<tag>/.gnmr_state.pt.tmp.<pid>)   GNMR's temporary file
    gnmr-unrenamed     os.replace(tmp -> gnmr_state.pt)       written and synced, not renamed
    before-framework   torch.save(<tag>/mp_rank_00_model_states.pt)   DeepSpeed's first file
    mid-framework      torch.save(<tag>/..._optim_states.pt)  after the model states
    before-latest      open(<dir>/latest, "w")                DeepSpeed's tag, not written
    after-latest       close of <dir>/latest                  the checkpoint is complete

The kill happens just before the named call (after it, for ``after-latest``).
"""

from __future__ import annotations

import builtins
import os
import signal
import sys


def _kill(phase: str) -> None:
    sys.stderr.write(f"kill point {phase}: rank 0 sends itself SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _KillAfterClose:
    def __init__(self, fh, phase: str) -> None:
        self.fh, self.phase = fh, phase

    def __enter__(self):
        return self.fh.__enter__()

    def __exit__(self, *exc):
        self.fh.__exit__(*exc)
        _kill(self.phase)


def _install(phase: str) -> None:
    import torch

    saves = [0]
    real_open, real_replace, real_save = builtins.open, os.replace, torch.save

    def due(name: str) -> bool:
        return saves[0] == 2 and phase == name

    def gnmr_open(file, mode="r", *args, **kwargs):
        name = os.fspath(file) if isinstance(file, str | os.PathLike) else ""
        if ".gnmr_state.pt.tmp." in name and "w" in mode:
            saves[0] += 1
            if due("before-gnmr"):
                _kill(phase)
        if os.path.basename(name) == "latest" and "w" in mode:
            if due("before-latest"):
                _kill(phase)
            if due("after-latest"):
                return _KillAfterClose(real_open(file, mode, *args, **kwargs), phase)
        return real_open(file, mode, *args, **kwargs)

    def gnmr_replace(src, dst, *args, **kwargs):
        if os.fspath(dst).endswith("gnmr_state.pt") and due("gnmr-unrenamed"):
            _kill(phase)
        return real_replace(src, dst, *args, **kwargs)

    def gnmr_save(obj, f, *args, **kwargs):
        name = os.fspath(f) if isinstance(f, str | os.PathLike) else ""
        if name.endswith("model_states.pt") and due("before-framework"):
            _kill(phase)
        if name.endswith("optim_states.pt") and due("mid-framework"):
            _kill(phase)
        return real_save(obj, f, *args, **kwargs)

    builtins.open, os.replace, torch.save = gnmr_open, gnmr_replace, gnmr_save


def _phase() -> str | None:
    phases = [p for p in os.environ.get("GNMR_TEST_KILL_PHASES", "").split(",") if p]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not phases or os.environ.get("RANK") != "0" or attempt >= len(phases):
        return None
    return phases[attempt]


_chosen = _phase()
if _chosen is not None:
    _install(_chosen)
