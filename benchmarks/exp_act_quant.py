"""Seed experiment 1 at CPU scale: activation-quantization stress (DESIGN.md 6.1).

    python -m benchmarks.exp_act_quant [--steps 400] [--bits 4] [--group-size 128]

A small Llama (4 layers x 128, 28 projection units) pretrained on the embedded corpus; every
projection saves its input for backward at ``--bits`` (per-group min/scale, ``--group-size``
values per group) on the low-cost path and at 8 bits on the recovery path. Arms: FP32 (no
quantization), static 8-bit, static low-bit, GNMR low/8-bit with a budget of ``--budget`` of
the units, Megatron's first/last-layers-in-high-precision recipe, and a ZClip-style global
spike guard on the static low-bit path.

Stress knob: ``--bits`` and ``--group-size``. The seed's 4-bit setting is mild at this scale
(a 1M-parameter model trained for a few hundred steps), so the default adds stress with coarse
groups; the README's results section says which setting each table used.
"""

from __future__ import annotations

import argparse
import logging

from benchmarks.harness import Arm, Setup, run_experiment, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.1, help="max_active / units for GNMR")
    p.add_argument("--arms", default=None, help="comma-separated subset of arm names")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    setup = Setup(steps=a.steps, gnmr={"lock_steps": 8, "window": 8, "warmup_steps": 20,
                                       "alpha": {"schedule": "cosine", "start": 3.0, "end": 1.5,
                                                 "steps": a.steps // 2}, "beta": 2.0})  # fmt: skip
    units = 7 * setup.layers
    low = {"bits": a.bits, "group_size": a.group_size}
    rec = {"bits": 8, "group_size": a.group_size}
    q = {"backend": "act_quant", "low_cost": low, "recovery": rec}
    arms = [
        Arm("fp32", "full"),
        Arm("static 8-bit", "recovery", **q),
        Arm(f"static {a.bits}-bit", "static", **q),
        Arm(f"GNMR {a.bits}/8", "gnmr", max_active=max(1, round(a.budget * units)), **q),
        Arm("first+last 8-bit", "first_last", **q),
        Arm(f"ZClip {a.bits}-bit", "zclip", **q),
    ]
    if a.arms:
        keep = {x.strip() for x in a.arms.split(",")}
        arms = [x for x in arms if x.name in keep]
    out = run_experiment("act_quant", setup, arms)
    from benchmarks.harness import ArmResult

    results = [ArmResult(**r) for r in out["results"]]
    names = [r.name for r in results]
    ref = "fp32" if "fp32" in names else names[0]
    low_arm = f"static {a.bits}-bit" if f"static {a.bits}-bit" in names else names[0]
    print(table(results, ref, low_arm))


if __name__ == "__main__":
    main()
