"""Paper experiment 1 at CPU scale: activation-quantization stress
(docs/algorithm.md#activation-quantization-stress).

    python -m benchmarks.paper.act_quant [--steps 300] [--bits 2] [--group-size 128] [--budget 0.1]

The harness's Llama pretrained from scratch for 300 steps; every projection saves its input for
backward at ``--bits`` on the low-cost path and at 8 bits on the recovery path. Arms, interleaved
from the same initial weights and batches: FP32, static 8 / 4 / ``--bits``-bit, two GNMR arms
(the paper's thresholds and ``a=b=2``), Megatron's first+last recipe and a ZClip guard. The FP32
arm's final weights go to ``results/act_quant_fp32.pt``: the LoRA experiment's base. The setup,
the stress knob and the choice of the GNMR policy: docs/benchmarks.md#paper-act_quant.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.arms import Arm, with_budget
from benchmarks.harness.bases import BASE, PRETRAIN_SEED, PRETRAIN_STEPS, pretrain_setup
from benchmarks.harness.common import start_cli
from benchmarks.harness.experiment import experiment_parser, report, run_chosen

STEPS = PRETRAIN_STEPS
SEED = PRETRAIN_SEED
UNITS = 28


TIGHT = {"alpha": 2.0, "beta": 2.0}
"""A second GNMR arm with thresholds low enough to spend its budget (see the docstring)."""


def make_arms(bits: int, group_size: int, budget: float, save: bool) -> list[Arm]:
    """FP32, static 8 / 4 / ``bits``-bit, GNMR ``bits``/8, first+last, ZClip."""

    def quant(low_bits: int) -> dict[str, Any]:
        return {
            "backend": "act_quant",
            "low_cost": {"bits": low_bits, "group_size": group_size},
            "recovery": {"bits": 8, "group_size": group_size},
        }

    q = quant(bits)
    arms = [
        Arm("fp32", "full", save_to=str(BASE) if save else None),
        Arm("static 8-bit", "recovery", **q),
        Arm("static 4-bit", "static", **quant(4)),
        Arm(f"static {bits}-bit", "static", **q),
        with_budget(Arm(f"GNMR {bits}/8", "gnmr", **q), budget, UNITS),
        with_budget(Arm(f"GNMR {bits}/8 a=b=2", "gnmr", controller=TIGHT, **q), budget, UNITS),
        Arm("first+last 8-bit", "first_last", **q),
        Arm(f"ZClip {bits}-bit", "zclip", **q),
    ]
    names = [a.name for a in arms]
    return [a for i, a in enumerate(arms) if a.name not in names[:i]]  # bits == 4: once


def main() -> None:
    p = experiment_parser(__doc__, STEPS)
    p.add_argument("--bits", type=int, default=2, help="low-cost bits: the stress knob")
    p.add_argument("--group-size", type=int, default=128, help="values per (min, scale) group")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--no-save", action="store_true", help=f"do not write {BASE.name}")
    a = p.parse_args()
    start_cli(a.threads)
    arms = make_arms(a.bits, a.group_size, a.budget, save=not a.no_save)
    out = run_chosen("act_quant", pretrain_setup(a.steps, a.seed), arms, a.arms)
    report(out, "fp32", f"static {a.bits}-bit", f"GNMR {a.bits}/8")


if __name__ == "__main__":
    main()
