"""What the three parts of :mod:`benchmarks.overhead` share: the targets, the GNMR policy of the
timed arms, the two backends' options and DeepSpeed's configuration."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.arms import Setup
from benchmarks.harness.recipes import FP6_LOW_COST, FP8_RECOVERY

ERROR_EVERY = 10
"""``error_every`` of the ``gnmr+e/10`` arm: error sums measured on every 10th step."""

ERROR_GAMMA = 0.3
"""``gamma`` of the ``gnmr+e`` arm (its cost does not depend on the value)."""

GNMR_POLICY = {"lock_steps": 8, "window": 8, "warmup_steps": 5, "alpha": 1.5, "beta": 2.0}
"""The policy of the timed GNMR arms: a short warm-up so the plan is used inside the window."""


def backend_options() -> dict[str, dict[str, Any]]:
    """The two backends' option blocks (fp8_emulated: the FP6/FP8 experiment's formats)."""
    return {
        "act_quant": {
            "low_cost": {"bits": 4, "group_size": 128},
            "recovery": {"bits": 8, "group_size": 128},
        },
        "fp8_emulated": {"low_cost": dict(FP6_LOW_COST), "recovery": dict(FP8_RECOVERY)},
    }


def ds_config(setup: Setup, stage: int) -> dict[str, Any]:
    """DeepSpeed's config for ``setup``: fp32, ZeRO ``stage``, AdamW and clipping as the
    harness trains (``torch_adam``: the same optimizer code as the single-process arms)."""
    adamw = {"lr": setup.lr, "torch_adam": True, "weight_decay": setup.weight_decay}
    return {
        "train_micro_batch_size_per_gpu": setup.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": adamw},
        "gradient_clipping": setup.clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
