"""Paper experiment 2 at CPU scale: DeepSeek-style dynamic FP6/FP8 pretraining
(docs/algorithm.md#dynamic-fp6-to-fp8-pretraining).

    python -m benchmarks.paper.fp6_fp8 [--steps 200] [--stress tensor|none] [--budget 0.1]

The harness's Llama pretrained with the ``fp8_emulated`` backend (every projection's three GEMMs
take FP6 or FP8 inputs and accumulate in fp32). Arms, interleaved from the same init on the same
batches: FP32, fixed FP8, fixed FP6, GNMR FP6/FP8, Megatron's first/last layers in FP8 and a
ZClip guard on fixed FP6. The FP6 recipe's formats (with their measured SQNR) and the
``--stress`` knob: docs/benchmarks.md#paper-fp6_fp8.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from benchmarks.harness.arms import Arm, Setup
from benchmarks.harness.common import start_cli
from benchmarks.harness.experiment import experiment_parser, report, run_chosen
from benchmarks.harness.recipes import FP6_LOW_COST, FP6_STRESS, FP8_RECOVERY, fp6_fp8_policy

logger = logging.getLogger(__name__)

STEPS = 200


def low_cost(stress: str, block: int) -> dict[str, Any]:
    """The low-cost options for a stress setting."""
    return dict(FP6_STRESS) if stress == "tensor" else {**FP6_LOW_COST, "block": block}


def main() -> None:
    p = experiment_parser(__doc__, STEPS)
    p.add_argument("--stress", choices=("tensor", "none"), default="tensor")
    p.add_argument("--block", type=int, default=128, help="low-cost tile length (--stress none)")
    a = p.parse_args()
    start_cli(a.threads)
    setup = Setup(steps=a.steps, eval_every=50, gnmr=fp6_fp8_policy())
    units = 7 * setup.layers
    q = {
        "backend": "fp8_emulated",
        "low_cost": low_cost(a.stress, a.block),
        "recovery": FP8_RECOVERY,
    }
    arms = [
        Arm("fp32", "full"),
        Arm("fixed FP8", "recovery", **q),
        Arm("fixed FP6", "static", **q),
        Arm("GNMR FP6/FP8", "gnmr", max_active=max(1, round(a.budget * units)), **q),
        Arm("first+last FP8", "first_last", **q),
        Arm("ZClip FP6", "zclip", **q),
    ]
    t0 = time.perf_counter()
    out = run_chosen("fp6_fp8", setup, arms, a.arms)
    logger.info(
        f"stress={a.stress}, low-cost {q['low_cost']}, recovery {FP8_RECOVERY}, {a.steps} steps, "
        f"{a.threads} thread(s), {time.perf_counter() - t0:.0f} s"
    )
    report(out, "fp32", "fixed FP6")


if __name__ == "__main__":
    main()
