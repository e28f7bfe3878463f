"""The error-term threshold ``gamma`` of a branch regime's ``GNMR+e`` arms, measured.

    python -m benchmarks.sweep.gamma --regime paper_lora_int8 [--seed 1234] [--point P] [--steps 3]

Every regime sets ``gamma`` near the median error score ``e = B / G`` of the static low-cost
path's eligible units (docs/algorithm.md#damage-term), so that about half the units are candidates
at any step and the budget goes to the largest scores. This command loads the trunk of
(``--seed``, ``--point``; default: the regime's middle branch point), trains the static low-cost
arm ``--steps`` steps with the recovery-gap probe on each, and logs the median of the units'
``e`` over those steps, with its quartiles: the value to write into the regime.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

import torch

from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import branch_setup, load_trunk, run_trunk, trunk_file
from benchmarks.harness.common import arg_parser, start_cli
from benchmarks.harness.model import Batches
from benchmarks.harness.training import ArmRun
from benchmarks.sweep.branches import ensure_inputs, trunks_dir
from benchmarks.sweep.regimes import BRANCH_REGIMES, Regime

logger = logging.getLogger(__name__)


def error_scores(regime: Regime, seed: int, point: int, steps: int) -> list[float]:
    """``e`` of every eligible unit on each of ``steps`` probed steps after ``point``."""
    inst, root = regime.instrument, trunks_dir(regime)
    ensure_inputs(regime)
    run_trunk(regime.setup, regime.trunk_arm(), inst, seed, root)
    s = branch_setup(regime.setup, inst, seed)
    probed = tuple(range(point + 1, point + steps + 1))
    arm = Arm("low-cost", "static", probe_steps=probed, **regime.backend_args())
    run = ArmRun(s, arm, Batches(s.heldout, s), evaluates=False)
    load_trunk(run, trunk_file(root, seed, point))
    train = Batches(s.data, s)
    for step in probed:
        run.step(step, train)
    eligible = run.elig.tolist()
    return [
        e
        for rec in run.probes
        for e, ok in zip(rec["scores"]["error_global"], eligible, strict=True)
        if ok
    ]


def main(argv: Sequence[str] | None = None) -> None:
    p = arg_parser(__doc__)
    p.add_argument("--regime", choices=sorted(BRANCH_REGIMES), required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--point", type=int, default=0, help="default: the middle branch point")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    start_cli(threads=1)
    torch.manual_seed(0)
    regime = BRANCH_REGIMES[a.regime]
    points = regime.instrument.points
    point = a.point or points[len(points) // 2]
    e = error_scores(regime, a.seed, point, a.steps)
    q1, med, q3 = statistics.quantiles(e, n=4)
    logger.info(
        "%s: e over %d unit-steps after step %d: median %.4g (quartiles %.4g, %.4g); the regime "
        "sets gamma %.4g",
        regime.name,
        len(e),
        point,
        med,
        q1,
        q3,
        regime.gamma,
    )


if __name__ == "__main__":
    main()
