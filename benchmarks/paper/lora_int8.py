"""Paper experiment 3 at CPU scale: LoRA fine-tuning stress on the int8 backend
(docs/algorithm.md#lora-fine-tuning-with-int8).

    python -m benchmarks.paper.lora_int8 [--steps 200] [--granularity tensor] [--budget 0.1]

Base: the FP32 arm of experiment 1 (``results/act_quant_fp32.pt``; pretrained first when it is
missing). peft LoRA adapters of rank 8 on all seven projections of each layer fine-tune for 200
steps on one corpus domain absent from pretraining (``idlelib/``). Arms: FP32, BF16, INT8,
GNMR INT8/BF16, Megatron's first+last recipe in BF16 and a ZClip guard on INT8. The data, the
``--granularity`` stress knob, the GNMR policy and why the CPU's BF16 is faster than its int8:
docs/benchmarks.md#paper-lora_int8.
"""

from __future__ import annotations

import logging
from pathlib import Path

from benchmarks.harness.arms import Arm, Setup, with_budget
from benchmarks.harness.bases import (
    BASE,
    LORA_DOMAIN,
    LORA_STEPS,
    ensure_base,
    lora_setup,
    pretrain_setup,
)
from benchmarks.harness.common import start_cli
from benchmarks.harness.experiment import experiment_parser, report, run_chosen
from benchmarks.harness.model import Batches, build_model, evaluate
from benchmarks.paper import act_quant
from gnmr_dist.data.corpus import embedded_corpus, stdlib_root

logger = logging.getLogger(__name__)

DOMAIN = LORA_DOMAIN
STEPS = LORA_STEPS


def pretraining_files_in(domain: str, pretrain: Setup) -> int:
    """How many files of ``domain/`` the pretraining data holds (0: the domain is unseen)."""
    root = stdlib_root()
    files = embedded_corpus("train", max_bytes=pretrain.max_bytes)
    return sum(p.relative_to(root).as_posix().startswith(domain.strip("/") + "/") for p in files)


def make_arms(granularity: str, budget: float) -> list[Arm]:
    """FP32, BF16, INT8, GNMR INT8/BF16, first+last BF16, ZClip INT8."""
    weight, act = ("row", "token") if granularity == "row" else ("tensor", "tensor")
    q = {
        "backend": "int8",
        "low_cost": {"weight_granularity": weight, "act_granularity": act},
        "recovery": {"dtype": "bf16"},
    }
    return [
        Arm("fp32", "full"),
        Arm("BF16", "recovery", **q),
        Arm("INT8", "static", **q),
        with_budget(Arm("GNMR INT8/BF16", "gnmr", **q), budget, act_quant.UNITS),
        Arm("first+last BF16", "first_last", **q),
        Arm("ZClip INT8", "zclip", **q),
    ]


def main() -> None:
    p = experiment_parser(__doc__, STEPS)
    p.add_argument(
        "--granularity",
        choices=("row", "tensor"),
        default="tensor",
        help="int8 scales: per row/token, or per tensor (the stress knob)",
    )
    p.add_argument("--base", type=Path, default=BASE)
    a = p.parse_args()
    start_cli(a.threads)
    ensure_base(a.base)
    setup = lora_setup(a.base, a.steps)
    seen = pretraining_files_in(DOMAIN, pretrain_setup())
    logger.info("pretraining files under %s/: %d", DOMAIN, seen)
    before = evaluate(build_model(setup), Batches(setup.heldout, setup), setup.eval_batches)
    logger.info("base model's held-out loss on %s/ before fine-tuning: %.4f", DOMAIN, before)
    out = run_chosen("lora_int8", setup, make_arms(a.granularity, a.budget), a.arms)
    report(out, "BF16", "INT8", "GNMR INT8/BF16")


if __name__ == "__main__":
    main()
