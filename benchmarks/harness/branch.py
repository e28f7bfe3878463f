"""The branch estimator: what a precision policy costs, measured from shared checkpoints.

Two whole runs that differ only in their precision policy end further apart than any realistic
policy effect at this scale. Here one BF16 trunk per seed saves its whole state (weights, AdamW,
schedule, the GNMR controller that watched it) at every branch point; every arm restarts from
every checkpoint and trains ``horizon`` steps on the batches the trunk would have trained on
next; the estimate is the paired held-out difference (fp32 evaluation), averaged over a seed's
branch points, with a Student-t interval over seeds. :data:`NULL_ARMS` measure the estimator's
own noise. Why it is quieter and what it measures: docs/benchmarks.md#branch-estimator.

Jobs are (arm, seed, branch point), run in a pool and written one JSON file each as they end,
so a sweep stops and resumes at any time (:mod:`benchmarks.sweep.branches`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.arms import Arm, Setup
from benchmarks.harness.model import Batches, build_model, evaluate
from benchmarks.harness.training import ArmRun

__all__ = [
    "Instrument",
    "NULL_ARMS",
    "load_trunk",
    "perturb",
    "run_branch",
    "run_trunk",
    "branch_setup",
    "trunk_file",
]

NULL_ARMS = ("null BF16 (1e-6)", "null low-cost (1e-6)")
"""The two null controls' names (each paired with its unperturbed twin)."""

PERTURBATION = 1e-6
"""Relative size of the null control's move of the weights at the branch point."""


@dataclass(frozen=True)
class Instrument:
    """Where branches start, how long they run, where they are measured."""

    trunk_steps: int = 400
    """Length of the reference run's schedule (warm-up, then cosine to 0.1 at this step)."""
    points: tuple[int, ...] = (100, 175, 250, 325)
    """Branch points: steps after which the trunk's state is saved and branches start."""
    horizon: int = 50
    """Steps every branch trains."""
    evals: tuple[int, ...] = (25, 50)
    """Steps into a branch at which its held-out loss is measured (the last is ``horizon``)."""
    eval_batches: int = 32
    """Held-out batches per measurement (the same batches for every arm)."""
    late_at: str = "branch"
    """Where a late rule's window ends: ``"branch"``, at each branch's end, right before its
    measurement (where it is strongest: the FP4 sweeps' records), or ``"schedule"``, at the
    end of the trunk's schedule, where a run has it (a branch ending before runs low-cost)."""

    def __post_init__(self) -> None:
        if not self.points or max(self.points) > self.trunk_steps:
            raise ValueError(f"branch points {self.points} must lie in 1..{self.trunk_steps}")
        if not self.evals or max(self.evals) != self.horizon or min(self.evals) < 1:
            raise ValueError(f"evals {self.evals} must lie in 1..horizon and end at {self.horizon}")
        if self.late_at not in ("branch", "schedule"):
            raise ValueError(f"late_at must be 'branch' or 'schedule', got {self.late_at!r}")


def trunk_file(root: Path, seed: int, point: int) -> Path:
    """The trunk checkpoint of ``seed`` at ``point``."""
    return root / f"trunk_{seed}" / f"step_{point}.pt"


def branch_setup(setup: Setup, inst: Instrument, seed: int) -> Setup:
    """The regime's setup with the trunk's schedule length, this seed, no periodic evaluation."""
    return replace(setup, steps=inst.trunk_steps, seed=seed, eval_every=10**9)


def _with_outlier(setup: Setup, seed: int, point: int) -> Setup:
    """``setup`` with its outlier plan resolved for the branch of ``seed`` at ``point``."""
    plan = setup.outlier_plan
    if plan is None:
        return setup
    width = setup.ffn if plan.projection.endswith("down_proj") else setup.hidden
    return replace(setup, outliers=(plan.at(seed, point, setup.layers, width),))


def run_trunk(setup: Setup, reference: Arm, inst: Instrument, seed: int, root: Path) -> float:
    """Train the reference arm up to the last branch point, saving a checkpoint at each one
    (written atomically; a trunk whose checkpoints all exist is not run again). Returns its
    wall time in seconds."""
    wanted = [trunk_file(root, seed, b) for b in inst.points]
    # a trunk is never trained twice: the branches already recorded started from these files, and a
    # re-run (another host, another torch) need not reproduce them bit for bit
    if all(p.exists() for p in wanted):
        return 0.0
    t0 = time.perf_counter()
    s = branch_setup(setup, inst, seed)
    run = ArmRun(s, reference, Batches(s.heldout, s), evaluates=False)
    train = Batches(s.data, s)
    # the schedule is trunk_steps long (branch_setup), so the learning rate at each point is the
    # whole run's; no branch starts after the last point, so the trunk stops there
    for step in range(1, max(inst.points) + 1):
        run.step(step, train)
        if step in inst.points:
            _save(run, step, trunk_file(root, seed, step))
    return time.perf_counter() - t0


def _save(run: ArmRun, step: int, path: Path) -> None:
    state = {
        "step": step,
        "model": run.model.state_dict(),
        "opt": run.opt.state_dict(),
        "sched": run.sched.state_dict(),
        # the controller that watched the trunk: a GNMR arm branches with the norm history it would
        # have had at this step, not from a cold warm-up in which it cannot act
        "runtime": run.runtime.state_dict(),
        "loss": run.losses[-1],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # written, then renamed: a sweep killed mid-save leaves no truncated file that run_trunk's
    # all-exist check would take for a finished checkpoint
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_trunk(run: ArmRun, path: Path) -> int:
    """The trunk's state into ``run`` (the GNMR controller's history included); its step."""
    state = torch.load(path, weights_only=True)
    run.model.load_state_dict(state["model"])
    # AdamW's moments and the schedule's step as well: from the weights alone every arm would
    # restart Adam at zero and the learning rate at warm-up, a different step from the trunk's
    run.opt.load_state_dict(state["opt"])
    run.sched.load_state_dict(state["sched"])
    run.runtime.load_state_dict(state["runtime"])
    return int(state["step"])


def perturb(model: torch.nn.Module, relative: float, seed: int) -> None:
    """Move every weight by ``relative`` times its tensor's RMS in a random direction (a
    generator seeded by ``seed``): a change that does nothing on average."""
    # its own generator: the move takes no draw from torch's global stream, so every other draw of
    # the perturbed twin (batches, random-k, stochastic rounding keyed by step) is its unperturbed
    # twin's and the weight move is the only difference: what makes the null a null
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            # relative to each tensor's scale: a norm gain near 1 and an embedding near 0.02 move
            # alike
            rms = p.detach().float().square().mean().sqrt()
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_((noise * rms * relative).to(p.dtype))


def run_branch(
    setup: Setup, arm: Arm, inst: Instrument, seed: int, point: int, root: Path, perturbed: bool
) -> dict[str, Any]:
    """One branch: ``arm`` from the trunk checkpoint of (``seed``, ``point``) for ``horizon``
    steps; held-out losses (fp32) at ``evals``. ``perturbed``: the null control's weight move."""
    # the outlier is placed from (seed, point) before the run is built, so every arm of one branch
    # meets the same fault at the same step
    s = _with_outlier(branch_setup(setup, inst, seed), seed, point)
    heldout = Batches(s.heldout, s)
    run = ArmRun(s, arm, heldout, evaluates=False)  # last_step: the trunk's schedule end
    start = load_trunk(run, trunk_file(root, seed, point))
    if inst.late_at == "branch":
        run.last_step = start + inst.horizon  # the late switch: the branch's last steps
    # reseeded per branch, not carried from the trunk (which draws none): the random arms of one
    # (seed, point) draw alike, different points draw apart
    run.draw_gen.manual_seed(seed * 100_003 + point)  # random-k: its own draws per branch
    if perturbed:
        perturb(run.model, PERTURBATION, seed * 7 + point)
    # a plain model (no backend) to evaluate on, in fp32 for every arm: the figure is what training
    # in low precision did to the weights, not what a low-precision forward costs at evaluation
    reference = build_model(s)
    train = Batches(s.data, s)
    losses: dict[int, float] = {}
    t0 = time.perf_counter()
    for i in range(1, inst.horizon + 1):
        run.step(start + i, train)
        if i in inst.evals:
            reference.load_state_dict(run.model.state_dict())
            losses[i] = evaluate(reference, heldout, inst.eval_batches)
    return {
        "arm": arm.name,
        "seed": seed,
        "point": point,
        "heldout": {str(k): v for k, v in losses.items()},
        "train_loss": run.losses,
        "recovered_unit_steps": int(run.unit_recovered.sum()),  # the backend's count, not the plan
        "unit_recovered": [int(x) for x in run.unit_recovered.tolist()],  # per unit, in order
        "unit_steps": run.n_elig * inst.horizon,
        "flops_recovered": run.flops_recovered / inst.horizon,  # share of the linear work
        "gemms_high": [int(x) for x in run.gemm_high.tolist()],  # fprop, dgrad, wgrad
        "outliers": [asdict(o) for o in s.outliers],
        # the median step: on a shared host load bursts move the mean, not the middle
        "step_ms": 1e3 * sorted(run.times)[len(run.times) // 2],
        "nonfinite": sum(1 for x in run.losses if not math.isfinite(x)),
        "wall_s": time.perf_counter() - t0,
        "arm_spec": asdict(arm),
    }
