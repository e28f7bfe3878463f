"""Step time of ``GNMR+e`` against NVIDIA's static rule at the same budget, side by side.

    python -m benchmarks.sweep_fp4 --step-time [--regime nvfp4] [--steps 40]

Both arms start from the same trunk checkpoint (seed 1234, the regime's second branch point)
and train the same batches, interleaved one step each in turn (the order alternating), in one
process with one torch thread, so both sample the same stretch of machine load:

- ``NVIDIA last-k``: the last ``k`` units in BF16, the rest in FP4, and nothing else: no
  monitor, no controller, no error score (what a user of the static rule runs);
- ``GNMR+e k``: the same backend with GNMR's monitor (one fused norm pass), the controller, and
  the error score measured every ``ERROR_EVERY``-th step (shadow of the recovered units
  included) and carried in between, as in the sweep.

Printed: each arm's median step time over the steps after the first 5, and their ratio. The
ratio is the cost of the runtime policy at the same number of recovered units; on the CPU the
FP4 emulation dominates a step, so the ratio of the GPU (where FP4 GEMMs are fast and the
monitor's norm pass weighs more) is the one ``benchmarks/gpu_te_check.py`` reports for TE.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.branch import _load, run_trunk, trunk_file
from benchmarks.harness_arms import Arm
from benchmarks.harness_model import Batches
from benchmarks.harness_training import ArmRun
from benchmarks.regimes import Regime

WARMUP = 5


def step_time(
    regime: Regime, steps: int, seed: int = 1234, root: Path | None = None
) -> dict[str, float]:
    """Interleave the two arms for ``steps`` steps each; print and return the medians (ms).
    ``root``: where the trunk is (built there when missing; default: the sweep's)."""
    from benchmarks.sweep_fp4 import ERROR_EVERY, _trunk_root, nvidia_k

    torch.set_num_threads(1)
    inst = regime.instrument
    point = inst.points[min(1, len(inst.points) - 1)]
    root, q = root or _trunk_root(regime.name), regime.backend_args()
    run_trunk(regime.setup, Arm("trunk", "recovery", **q), inst, seed, root)
    k = nvidia_k(regime.units)
    arms = {
        f"NVIDIA last-{k}": (Arm(f"NVIDIA last-{k}", "last_units", max_active=k, **q), False),
        f"GNMR+e {k}": (
            Arm(
                f"GNMR+e {k}",
                "gnmr",
                max_active=k,
                controller=regime.error_policy(),
                error_every=ERROR_EVERY,
                **q,
            ),
            True,
        ),
    }
    setup = replace(regime.setup, steps=inst.trunk_steps, seed=seed, eval_every=10**9)
    train, heldout = Batches(setup.data, setup), Batches(setup.heldout, setup)
    runs = {}
    for name, (arm, monitors) in arms.items():
        run = ArmRun(setup, arm, heldout, evaluates=False, monitors=monitors)
        start = _load(run, trunk_file(root, seed, point))
        runs[name] = run
    order = list(runs.values())
    for i in range(1, steps + 1):
        for run in order if i % 2 else order[::-1]:
            run.step(start + i, train)
    ms = {
        name: 1e3 * statistics.median(run.times[WARMUP:] or run.times) for name, run in runs.items()
    }
    (a, ta), (b, tb) = ms.items()
    recovered = {n: int(r.unit_recovered.sum()) for n, r in runs.items()}
    print(
        f"{regime.name}, seed {seed}, from step {point}, {steps} steps each, interleaved: "
        f"{a} {ta:.1f} ms, {b} {tb:.1f} ms, ratio {b} / {a} = {tb / ta:.3f} "
        f"(recovered unit-steps {recovered})"
    )
    return {**ms, "ratio": tb / ta}
