"""What the shadow route costs: ``te_fp8`` with ``gamma`` at ``error_every`` 1, 10 and 50.

    python -m benchmarks.overhead.shadow [--steps 60] [--warm 4] [--threads 1]
        [--recipes tensorwise,blockwise,mxfp8,nvfp4]

Transformer Engine does not run on a CPU, so the harness's Llama gets Transformer Engine
``Linear`` stand-ins for its projections (``tests/backends/test_te_fp8.py``: TE's module type and
autocast regions, the GEMM a plain ``F.linear``): the ``te_fp8`` backend and the shadow route run
as they run on a GPU, around a GEMM that costs what a CPU GEMM costs. Against a GPU's FP8 GEMMs
the route's elementwise casts weigh more here, so the ratios are an upper bound of the GPU's.

Per recipe, seven arms from the same weights, fed the same batch each round, their steps
interleaved in an order that rotates every round (:func:`benchmarks.overhead.step_time.
interleave`): the low-cost path without GNMR, GNMR with norms only (``max_active`` 3), and
GNMR with the shadow scores measured every 1, 10, 50, 100 and 200 steps. The ratios are paired
per round (CPU time, median and quartiles). Writes ``benchmarks/results/overhead_shadow.json``; the
default ``error_every`` of ``te_fp8`` is, per recipe, the smallest timed interval whose ratio to
the low-cost path is at most 1.01, judged on the every-step arm's cost spread over the interval
(``1 + (r_1 - 1) / N``: the paired ratio of one measuring step is the tight figure, and with
GNMR's own share in ``r_1`` an upper bound on what the route adds; the sparse arms' own ratios
sit inside a few percent of noise) and shown beside the sparse arms' measured
ratios (docs/algorithm.md#damage-term).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import start_cli
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.model import PROJECTIONS, Batches, build_model
from benchmarks.harness.provenance import record
from benchmarks.overhead.config import ERROR_GAMMA, GNMR_POLICY
from benchmarks.overhead.step_time import (
    ArmSpec,
    LocalArm,
    interleave,
    summarize,
    timing_parser,
)

logger = logging.getLogger(__name__)

INTERVALS = (1, 10, 50, 100, 200)
"""The ``error_every`` values timed."""
TARGET = 1.01
"""The default interval's ratio to the low-cost path must be at most this."""
BUDGET = 3


def install_te_stand_in() -> Any:
    """TE's stand-in package in ``sys.modules`` (a B200 for ``nvfp4``); its ``pytorch`` module."""
    from gnmr_dist.backends import te_runtime
    from tests.backends.te_stand_ins import build_fake_te

    modules, _ = build_fake_te()
    sys.modules.update(modules)
    te_runtime.cuda_device = lambda: ("stand-in B200", (10, 0))  # nvfp4's device check
    return modules["transformer_engine.pytorch"]


def te_model(setup: Setup, te: Any) -> nn.Module:
    """The harness Llama with every projection a TE ``Linear`` stand-in (the same weights)."""
    model = build_model(setup)
    for name, lin in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if leaf in PROJECTIONS:
            stand_in = te.Linear(lin.in_features, lin.out_features)
            with torch.no_grad():
                stand_in.weight.copy_(lin.weight)
                stand_in.bias.zero_()
            setattr(model.get_submodule(parent), leaf, stand_in)
    return model


class TEArm(LocalArm):
    """One process: the te_fp8 backend on the stand-ins, ``GNMRRuntime(group=None)``; the
    single-process arm of :mod:`benchmarks.overhead.step_time` with TE's operator types and its
    forward inside TE's autocast region."""

    def __init__(self, spec: ArmSpec, setup: Setup, te: Any) -> None:
        super().__init__(spec, setup, te_model(setup, te))

    def operator_types(self) -> frozenset[str]:
        return frozenset(self.backend.operator_names())

    def forward_region(self) -> AbstractContextManager[Any]:
        return self.backend.autocast()


def arm_specs(recipe: str) -> list[ArmSpec]:
    """The seven arms of the module docstring for low-cost ``recipe`` (recovery BF16)."""
    options = {"low_cost": {"recipe": recipe}}

    def arm(name: str, max_active: int | None, **kw: Any) -> ArmSpec:
        return ArmSpec(name, "te_fp8", options, max_active, **kw)

    return [
        arm("low-cost", None),
        arm(f"gnmr k={BUDGET}", BUDGET),
        *(
            arm(f"gnmr+e/{n} k={BUDGET}", BUDGET, gamma=ERROR_GAMMA, error_every=n)
            for n in INTERVALS
        ),
    ]


def amortized(arms: list[dict[str, Any]], n: int) -> float:
    """``1 + (r_1 - 1) / n``: the every-step arm's paired CPU ratio ``r_1`` (the cost of one
    measuring step, the tightest figure) spread over ``n`` steps."""
    every = next(a for a in arms if a["arm"] == f"gnmr+e/1 k={BUDGET}")["cpu_ratio"]
    return 1 + (every - 1) / n


def choose_default(results: dict[str, list[dict[str, Any]]]) -> dict[str, int | None]:
    """Per recipe, the smallest timed interval whose amortized ratio (:func:`amortized`) to
    the low-cost path is <= :data:`TARGET` (``None``: none is)."""
    return {
        recipe: next((n for n in INTERVALS if amortized(arms, n) <= TARGET), None)
        for recipe, arms in results.items()
    }


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Per recipe and arm: CPU ms, the paired ratio to the low-cost path, GNMR's own work."""
    header = ["recipe", "arm", "CPU ms", "CPU / low-cost [IQR]", "amortized", "mean active"]
    rows = []
    for recipe, arms in results.items():
        for a in arms:
            lo, hi = a["cpu_iqr"]
            ratio = f"{a['cpu_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"
            n = int(a["arm"].split("/")[1].split()[0]) if "+e/" in a["arm"] else None
            spread = "-" if n is None else f"{amortized(arms, n):.4f}"
            rows.append([recipe, a["arm"], f"{a['cpu_ms']:.1f}", ratio])
            rows[-1] += [spread, f"{a['mean_active']:.2f}"]
    return markdown_table(header, rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = timing_parser(__doc__, "overhead_shadow.json", steps=60, warm=4)
    p.prog = "python -m benchmarks.overhead.shadow"
    p.add_argument("--recipes", default="tensorwise,blockwise,mxfp8,nvfp4", help="recipes")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli(a.threads)
    te = install_te_stand_in()
    setup = Setup()
    train = Batches(setup.data, setup)
    results: dict[str, list[dict[str, Any]]] = {}
    for recipe in a.recipes.split(","):
        t0 = time.perf_counter()
        arms = [TEArm(spec, setup, te) for spec in arm_specs(recipe)]
        interleave(arms, train, a.steps, a.warm)
        results[recipe] = summarize(arms)
        logger.info(f"  {recipe}: {time.perf_counter() - t0:.0f} s")
    default = choose_default(results)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": a.threads,
        "setup": asdict(setup),
        "gnmr_policy": GNMR_POLICY,
        "budget": BUDGET,
        "gamma": ERROR_GAMMA,
        "intervals": list(INTERVALS),
        "target": TARGET,
        "default_error_every": default,
        "step_time": results,
        "provenance": record(),
    }
    path = a.out
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(table(results))
    print(f"smallest error_every with an amortized ratio <= {TARGET}: {default}; wrote {path}")


if __name__ == "__main__":
    main()
