"""The paper experiments' shared runs: experiment 1's pretraining, whose FP32 arm is the base model
of experiment 3's LoRA fine-tuning, and that fine-tuning's setup. The paper's studies
(:mod:`benchmarks.paper`) and the branch sweeps' seed regimes (:mod:`benchmarks.sweep.regimes`)
both build on them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness.arms import Arm, Setup
from benchmarks.harness.common import RESULTS
from benchmarks.harness.model import Batches
from benchmarks.harness.recipes import act_quant_policy
from benchmarks.harness.training import run_arm

__all__ = ["BASE", "ensure_base", "lora_policy", "lora_setup", "pretrain_setup"]

logger = logging.getLogger(__name__)

BASE = RESULTS / "act_quant_fp32.pt"
"""Experiment 1's FP32 arm's final weights: the base model of the LoRA experiment."""
PRETRAIN_STEPS = 300
PRETRAIN_SEED = 1234
LORA_DOMAIN = "idlelib"
"""The corpus domain the LoRA experiment fine-tunes on, absent from pretraining."""
LORA_STEPS = 200


def pretrain_setup(steps: int = PRETRAIN_STEPS, seed: int = PRETRAIN_SEED) -> Setup:
    """The pretraining run (its FP32 arm is also the LoRA experiment's base)."""
    return Setup(steps=steps, seed=seed, gnmr=act_quant_policy())


def lora_policy() -> dict[str, Any]:
    """The LoRA experiment's GNMR policy (docs/benchmarks.md#paper-lora_int8 for the choice)."""
    return {"lock_steps": 8, "window": 8, "warmup_steps": 20, "alpha": 4.0, "beta": 3.0}


def lora_setup(base: Path, steps: int = LORA_STEPS, domain: str = LORA_DOMAIN) -> Setup:
    """The fine-tuning run: experiment 1's model and seed, LoRA adapters, one unseen domain."""
    return replace(
        pretrain_setup(),
        steps=steps,
        lr=2e-3,
        warmup_lr=10,
        weight_decay=0.0,
        lora_rank=8,
        data=f"embedded:train:{domain}",
        heldout=f"embedded:heldout:{domain}",
        init_from=os.path.relpath(base),
        eval_every=25,
        eval_batches=32,
        gnmr=lora_policy(),
    )


def ensure_base(path: Path) -> None:
    """Pretrain experiment 1's FP32 arm and save it to ``path``, unless it is there already."""
    if path.is_file():
        logger.info("base model: %s", path)
        return
    pre = pretrain_setup()
    logger.info(
        "base model %s missing: pretraining act_quant's FP32 arm (%d steps)", path, pre.steps
    )
    t0 = time.perf_counter()
    fp32 = Arm("fp32", "full", save_to=str(path))  # run_arm saves its weights there at the end
    base = run_arm(pre, fp32, Batches(pre.data, pre), Batches(pre.heldout, pre))
    logger.info(
        "base pretrained in %.0f s, held-out loss %.4f", time.perf_counter() - t0, base.heldout_loss
    )
