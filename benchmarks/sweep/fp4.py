"""FP4 regimes: what recovering a few units buys back, measured with the branch estimator.

    python -m benchmarks.sweep.fp4 --regime nvfp4 [--seeds 1234,7,42,5,11] [--budgets 2,4,7]
        [--jobs 2] [--arms substring,...] [--report-only]
    python -m benchmarks.sweep.fp4 --step-time [--regime nvfp4] [--steps 40]

For one FP4 regime (:data:`benchmarks.sweep.regimes.FP4_REGIMES`) every arm of :func:`make_arms`
(controls, NVIDIA's two static rules, first+last, and ``random`` / ``GNMR`` / ``GNMR+e`` /
``oracle`` at every budget, plus the null controls) branches from the same checkpoints of one
BF16 trunk per seed (:mod:`benchmarks.harness.branch`). Jobs run in a pool of ``--jobs``
processes; every finished branch is appended to ``results/fp4/<regime>.jsonl`` at once, so a
sweep stops and resumes at any time. The report (:mod:`benchmarks.sweep.fp4_report`) goes to
``results/sweep_fp4_<regime>.json`` and ``.png``; ``--step-time`` times ``GNMR+e k`` against
NVIDIA's rule (:mod:`benchmarks.sweep.fp4_step_time`). The arms in detail:
docs/benchmarks.md#sweep-fp4.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import branch_stats
from benchmarks.harness.arms import Arm
from benchmarks.harness.branch import run_branch, run_trunk
from benchmarks.harness.branch_stats import Design, Records
from benchmarks.harness.common import RESULTS, arg_parser, start_cli
from benchmarks.harness.provenance import record
from benchmarks.sweep.branch_arms import make_arms, step_time_arms
from benchmarks.sweep.fp4_step_time import save, step_time
from benchmarks.sweep.regimes import FP4_REGIMES, Regime

logger = logging.getLogger(__name__)

SEEDS = (1234, 7, 42, 5, 11)
BUDGETS = (4,)


# ====================================================================== running


TRUNKS = RESULTS / "sweep" / "fp4" / "trunks"
"""The trunks' folder: one for every FP4 regime, whose trunks are the same BF16 runs (the same
setup and recovery path: ``tests/benchmarks/test_branch.py`` checks it), so that branches of
different regimes start from the same checkpoints too."""


def records_file(regime: str) -> Path:
    """The JSON-lines file of ``regime``'s finished branches (:func:`branch_stats.read_records`)."""
    return RESULTS / "fp4" / f"{regime}.jsonl"


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("gnmr_dist.core.controller").setLevel(logging.ERROR)  # the trunk's policy


def _job(payload: tuple[str, str, Arm, int, int, bool]) -> dict[str, Any]:
    """A trunk (``point == 0``) or one branch, in a worker process."""
    kind, regime_name, arm, seed, point, perturbed = payload
    regime = FP4_REGIMES[regime_name]
    if kind == "trunk":
        wall = run_trunk(regime.setup, arm, regime.instrument, seed, TRUNKS)
        return {"trunk": seed, "wall_s": wall}
    branch = run_branch(regime.setup, arm, regime.instrument, seed, point, TRUNKS, perturbed)
    return {**branch, "provenance": record()}


def run_sweep(
    regime: Regime,
    seeds: Sequence[int],
    budgets: Sequence[int],
    jobs: int,
    arm_filter: Sequence[str] = (),
    points: Sequence[int] | None = None,
) -> Records:
    """Build missing trunks, run (or resume) every missing branch at ``points`` (default: the
    regime's); return all records."""
    arms = make_arms(regime, budgets, regime.units)
    if arm_filter:
        arms = [(a, p) for a, p in arms if any(f in a.name for f in arm_filter)]
    done = branch_stats.read_records(records_file(regime.name))
    reference = Arm("trunk", "recovery", **regime.backend_args())
    trunks = [("trunk", regime.name, reference, s, 0, False) for s in seeds]
    branches = [
        ("branch", regime.name, a, s, p, pert)
        for s in seeds
        for p in (points or regime.instrument.points)
        for a, pert in arms
        if (a.name, s, p) not in done
    ]
    branches.sort(key=lambda t: t[2].policy != "oracle")  # the longest first
    logger.info("%s: %d branches to run (%d done)", regime.name, len(branches), len(done))
    t0, out = time.perf_counter(), records_file(regime.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with mp.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
        for r in pool.imap_unordered(_job, trunks):
            logger.info("trunk %s ready (%.0f s)", r["trunk"], r["wall_s"])
        for i, r in enumerate(pool.imap_unordered(_job, branches), 1):
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
            logger.info(
                "[%d/%d] %s seed %d point %d (%.0f s)",
                i,
                len(branches),
                r["arm"],
                r["seed"],
                r["point"],
                time.perf_counter() - t0,
            )
    return branch_stats.read_records(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arg_parser(__doc__)
    p.add_argument("--regime", choices=sorted(FP4_REGIMES), default="nvfp4")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument("--arms", default="", help="only arms whose name contains one of these")
    p.add_argument("--points", default="", help="a subset of the regime's branch points")
    p.add_argument("--report-only", action="store_true", help="report the records as they are")
    p.add_argument("--step-time", action="store_true", help="GNMR+e vs NVIDIA's rule, timed")
    p.add_argument("--steps", type=int, default=40, help="--step-time: steps per arm")
    return p.parse_args(argv)


def _points(text: str, regime: Regime) -> tuple[int, ...]:
    """``--points``: branch points the trunks save (the regime's), a subset of them or all."""
    have = tuple(regime.instrument.points)
    points = tuple(int(p) for p in text.split(",") if p.strip()) or have
    if not set(points) <= set(have):
        raise SystemExit(
            f"--points {text!r}: the trunks of {regime.name!r} are saved at {list(have)}; "
            "choose branch points among them"
        )
    return points


def design_suffix(regime: Regime, budgets: Sequence[int], points: Sequence[int]) -> str:
    """The report files' suffix: what the design changes from the default (all the regime's
    branch points, NVIDIA's budget), so that reports of two designs do not overwrite each other."""
    out = "" if tuple(budgets) == BUDGETS else "_k" + "-".join(map(str, budgets))
    if tuple(points) != tuple(regime.instrument.points):
        out += "_p" + "-".join(map(str, points))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli()
    regime = FP4_REGIMES[a.regime]
    if a.step_time:
        got = step_time(regime, *step_time_arms(regime), a.steps, TRUNKS)
        logger.info("written to %s", save(regime, got, a.steps))
        return
    seeds = [int(s) for s in a.seeds.split(",")]
    budgets = [int(k) for k in a.budgets.split(",")]
    points = _points(a.points, regime)
    if a.report_only:
        records = branch_stats.read_records(records_file(regime.name))
    else:
        arm_filter = [x.strip() for x in a.arms.split(",") if x.strip()]
        records = run_sweep(regime, seeds, budgets, a.jobs, arm_filter, points)
    from benchmarks.sweep.fp4_report import report

    design = Design(tuple(seeds), points, regime.instrument.horizon)
    arms = [arm.name for arm, _ in make_arms(regime, budgets, regime.units)]
    report(regime, design, records, arms, budgets, suffix=design_suffix(regime, budgets, points))


if __name__ == "__main__":
    main()
