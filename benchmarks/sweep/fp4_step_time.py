"""Step time of ``GNMR+e`` against NVIDIA's static rule at the same budget, side by side.

    python -m benchmarks.sweep.branches --step-time [--regime nvfp4] [--steps 40]

Both arms, and ``GNMR+e``'s own plan replayed without GNMR's work, start from the same trunk
checkpoint (seed 1234, the regime's second branch point) and train the same batches, interleaved
one step each in turn, in one process with one torch thread. Printed: each arm's median step time
after the first 5 steps and the two ratios; the command appends the run to
``results/sweep_fp4_step_time_<regime>.json`` (:func:`save`). Why the replayed ratio is the
runtime's cost on a CPU: docs/benchmarks.md#sweep-fp4-step-time.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import load_trunk, run_trunk, trunk_file
from benchmarks.harness.common import RESULTS
from benchmarks.harness.model import Batches
from benchmarks.harness.provenance import record
from benchmarks.harness.recipes import ERROR_TARGET
from benchmarks.harness.training import ArmRun
from benchmarks.sweep.regimes import Regime

logger = logging.getLogger(__name__)

WARMUP = 5


def step_time(
    regime: Regime, nvidia: Arm, gnmr: Arm, steps: int, root: Path, seed: int = 1234
) -> dict[str, float]:
    """Interleave ``nvidia`` (NVIDIA's static rule, timed without GNMR's work), ``gnmr`` and
    ``gnmr``'s plan replayed for ``steps`` steps each; print and return the medians (ms) and the
    two ratios. ``root``: where the trunk is (built there when missing)."""
    torch.set_num_threads(1)
    inst, point = regime.instrument, start_point(regime)
    run_trunk(regime.setup, regime.trunk_arm(), inst, seed, root)
    setup = replace(regime.setup, steps=inst.trunk_steps, seed=seed, eval_every=10**9)
    train, heldout = Batches(setup.data, setup), Batches(setup.heldout, setup)
    runs = {
        arm.name: ArmRun(setup, arm, heldout, evaluates=False, monitors=arm is gnmr)
        for arm in (nvidia, gnmr)
    }
    replayed = replace(gnmr, name=f"{gnmr.name} replayed", policy="static")
    runs[replayed.name] = Replayed(setup, replayed, heldout, runs[gnmr.name])
    (start,) = {load_trunk(run, trunk_file(root, seed, point)) for run in runs.values()}
    order = list(runs.values())
    for i in range(1, steps + 1):
        for run in order if i % 2 else order[::-1]:
            run.step(start + i, train)
    ms = {n: 1e3 * statistics.median(r.times[WARMUP:] or r.times) for n, r in runs.items()}
    ends = [runs[name].model.state_dict().values() for name in (gnmr.name, replayed.name)]
    same = all(torch.equal(a, b) for a, b in zip(*ends, strict=True))
    ratios = {
        "vs_nvidia": ms[gnmr.name] / ms[nvidia.name],
        "vs_replayed": ms[gnmr.name] / ms[replayed.name],
    }
    recovered = {n: int(r.unit_recovered.sum()) for n, r in runs.items()}
    logger.info(
        f"{regime.name}, seed {seed}, from step {point}, {steps} steps each, interleaved: "
        + ", ".join(f"{n} {t:.1f} ms" for n, t in ms.items())
        + f"; GNMR+e / NVIDIA's rule {ratios['vs_nvidia']:.3f}, GNMR+e / its plan replayed "
        f"{ratios['vs_replayed']:.3f} (same weights at the end: {same}; recovered unit-steps "
        f"{recovered})"
    )
    return {**ms, **ratios}


def start_point(regime: Regime) -> int:
    """The branch point both arms start from: the regime's second (its only one if it has one)."""
    points = regime.instrument.points
    return points[min(1, len(points) - 1)]


def save(
    regime: Regime, got: dict[str, float], steps: int, seed: int = 1234, path: Path | None = None
) -> Path:
    """Append one run of :func:`step_time` (its medians and ratios, and how it ran) to
    ``results/sweep_fp4_step_time_<regime>.json``; return the file."""
    path = path or RESULTS / f"sweep_fp4_step_time_{regime.name}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append(
        {
            "date": time.strftime("%Y-%m-%d"),
            "seed": seed,
            "point": start_point(regime),
            "steps": steps,
            "warmup": WARMUP,
            "ms": {k: v for k, v in got.items() if not k.startswith("vs_")},
            **{k: v for k, v in got.items() if k.startswith("vs_")},
            "provenance": record(),
        }
    )
    out = {"regime": regime.name, "target": ERROR_TARGET, "runs": runs}
    path.write_text(json.dumps(out, indent=1))
    return path


class Replayed(ArmRun):
    """A static arm that runs, each step, the plan a GNMR run (``source``, stepped in the same
    rounds) has for that step: GNMR's decisions without GNMR's work."""

    def __init__(self, setup: Any, arm: Arm, heldout: Batches, source: ArmRun) -> None:
        super().__init__(setup, arm, heldout, evaluates=False, monitors=False)
        self.source = source
        self.fixed = None  # chosen every step, from the source

    def _planned(self) -> frozenset[int]:
        plan = self.source.runtime.plan
        if plan.step == self.current_step:  # the source has not run this step yet
            return frozenset(plan.active)
        report = self.source.backend.report() if self.source.backend else None
        assert report is not None and report.step == self.current_step, "out of step"
        return report.planned
