"""Step time of DeepSpeed training with GNMR on vs the same backend with GNMR off.

    python -m benchmarks.overhead.deepspeed [--backend act_quant] [--stage 2] [--steps 30]

Part (a)'s DeepSpeed pair (:class:`benchmarks.overhead.step_time.DeepSpeedArm`) at any ZeRO
stage and backend, interleaved; the medians and their ratio are printed:
docs/benchmarks.md#overhead-deepspeed.
"""

from __future__ import annotations

import logging
import statistics

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import arg_parser, deepspeed_world, start_cli
from benchmarks.harness.model import Batches
from benchmarks.harness.recipes import TARGET
from benchmarks.overhead.config import backend_options
from benchmarks.overhead.step_time import ArmSpec, DeepSpeedArm, interleave

logger = logging.getLogger(__name__)

WARM = 5
"""Untimed steps first."""


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--backend", default="act_quant")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    start_cli()
    setup, options = Setup(), backend_options().get(args.backend, {})
    specs = [ArmSpec(f"gnmr {s}", args.backend, options, k) for s, k in (("on", 2), ("off", None))]
    with deepspeed_world():
        arms = [DeepSpeedArm(spec, setup, args.stage) for spec in specs]
        interleave(arms, Batches(setup.data, setup), args.steps, WARM)
    med = {arm.name: statistics.median(arm.timings.wall) for arm in arms}
    logger.info(
        f"backend {args.backend}, ZeRO stage {args.stage}, {args.steps} steps each, interleaved"
    )
    for name, m in med.items():
        logger.info(f"{name:>9}: median step {m * 1e3:8.1f} ms")
    logger.info(
        f"ratio gnmr on / off = {med['gnmr on'] / med['gnmr off']:.3f}  (target <= {TARGET})"
    )
    gnmr = arms[0].engine.gnmr
    logger.info(
        f"gnmr: {gnmr.controller.step_count} decisions, last active "
        f"{gnmr.telemetry().get('num_active')}"
    )


if __name__ == "__main__":
    main()
