"""Selection policies against controls: budget sweeps over seeds, with intervals (issue 13).

    python -m benchmarks.sweep.selection --regime act_quant [--seeds 1234,7,42] [--budgets 1,3,7,14]
        [--steps N] [--jobs 2] [--arms substring,...] [--fresh]

For one regime (:mod:`benchmarks.sweep.regimes`) every arm (:func:`make_arms`: the static
paths, first+last, and ``random k`` / ``GNMR k`` / ``GNMR+e k`` / ``oracle k`` at every budget)
trains the harness's Llama once per seed, one job per (arm, seed) in a pool, each written to
``results/sweep/<regime>/`` as it ends (an interrupted sweep resumes). The report pairs arms by
seed (:mod:`benchmarks.harness.stats`; tables and plot in
:mod:`benchmarks.sweep.selection_report`) and lands in ``results/sweep_<regime>.json`` and
``.png``. The arms, the verdicts and the selection figures: docs/benchmarks.md#sweep-selection.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.harness.arms import Arm, Setup
from benchmarks.harness.common import RESULTS, arg_parser, jsonable, start_cli
from benchmarks.harness.model import Batches
from benchmarks.harness.provenance import record
from benchmarks.harness.stats import Records, static_gap, summarize, verdicts
from benchmarks.harness.training import run_arm
from benchmarks.sweep.regimes import REGIMES, Regime
from benchmarks.sweep.selection_report import plot, print_report

logger = logging.getLogger(__name__)

SEEDS = (1234, 7, 42)
BUDGETS = (1, 3, 7, 14)
PROBE_EVERY = 10


def make_arms(regime: Regime, budgets: Sequence[int]) -> list[Arm]:
    """The controls and the budgeted policies of one regime (see the module docstring)."""
    q = regime.backend_args()
    probed = {"probe_every": PROBE_EVERY, "probe_steps": fault_probe_steps(regime)}
    arms = [
        Arm("low-cost", "static", **probed, **q),
        Arm("recovery", "recovery", **q),
        Arm("first+last", "first_last", **q),
    ]
    for k in budgets:
        arms += [
            Arm(f"random {k}", "random", max_active=k, **q),
            Arm(f"GNMR {k}", "gnmr", max_active=k, **probed, **q),
            Arm(
                f"GNMR+e {k}", "gnmr", max_active=k, controller=regime.error_policy(), **probed, **q
            ),
            Arm(f"oracle {k}", "oracle", max_active=k, **q),
        ]
    return arms


def fault_probe_steps(regime: Regime) -> tuple[int, ...]:
    """About 10 probe steps inside every fault window (every step of a short one), so that the
    figures during the faults rest on more than the one or two regular probes they hold."""
    steps: set[int] = set()
    for f in regime.setup.faults:
        steps.update(range(f.start, f.stop, max(1, (f.stop - f.start) // 10)))
    return tuple(sorted(steps))


# ====================================================================== running


def _job_path(regime: str, arm: str, seed: int) -> Path:
    safe = arm.replace(" ", "_").replace("+", "p")
    return RESULTS / "sweep" / regime / f"{safe}__{seed}.json"


def _run_job(payload: tuple[str, Setup, Arm, int]) -> str:
    """One (arm, seed) in a worker process; returns the path it wrote."""
    import torch

    torch.set_num_threads(1)
    regime_name, setup, arm, seed = payload
    setup = replace(setup, seed=seed)
    t0 = time.perf_counter()
    result = run_arm(setup, arm, Batches(setup.data, setup), Batches(setup.heldout, setup))
    row = {**asdict(result), "seed": seed, "wall_s": time.perf_counter() - t0}
    path = _job_path(regime_name, arm.name, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    tmp.replace(path)
    return str(path)


def run_sweep(
    regime: Regime,
    seeds: Sequence[int],
    budgets: Sequence[int],
    jobs: int,
    fresh: bool,
    arm_filter: Sequence[str] = (),
) -> Records:
    """Run (or resume) every (arm, seed) job; return the records by (arm name, seed)."""
    arms = make_arms(regime, budgets)
    if arm_filter:
        arms = [a for a in arms if any(f in a.name for f in arm_filter)]
    todo = []
    for arm in arms:
        for seed in seeds:
            path = _job_path(regime.name, arm.name, seed)
            if fresh and path.exists():
                path.unlink()
            if not path.exists():
                todo.append((regime.name, regime.setup, arm, seed))
    logger.info(
        "%s: %d arms x %d seeds, %d jobs to run", regime.name, len(arms), len(seeds), len(todo)
    )
    t0 = time.perf_counter()
    if todo:
        # the oracle arms cost ~4 steps per step: start them first so the pool ends together
        todo.sort(key=lambda t: t[2].policy != "oracle")
        with mp.get_context("spawn").Pool(jobs) as pool:
            for i, path in enumerate(pool.imap_unordered(_run_job, todo), 1):
                logger.info("[%d/%d] %s (%.0f s)", i, len(todo), path, time.perf_counter() - t0)
    return {
        (arm.name, seed): json.loads(_job_path(regime.name, arm.name, seed).read_text())
        for arm in arms
        for seed in seeds
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arg_parser(__doc__)
    p.add_argument("--regime", choices=sorted(REGIMES), required=True)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--steps", type=int, default=None, help="override the regime's steps")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument("--arms", default="", help="only arms whose name contains one of these")
    p.add_argument("--fresh", action="store_true", help="discard finished jobs and start over")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli()
    regime = REGIMES[a.regime]
    if a.steps is not None:
        regime = replace(regime, setup=replace(regime.setup, steps=a.steps))
    seeds = [int(s) for s in a.seeds.split(",")]
    budgets = [int(k) for k in a.budgets.split(",")]
    t0 = time.perf_counter()
    arm_filter = [x.strip() for x in a.arms.split(",") if x.strip()]
    records = run_sweep(regime, seeds, budgets, a.jobs, a.fresh, arm_filter)
    windows = [(f.start, f.stop) for f in regime.setup.faults]
    summary = summarize(records, seeds, windows)
    static = static_gap(records, seeds)
    name = f"sweep_{regime.name}"
    out = {
        "regime": regime.name,
        "description": regime.description,
        "setup": asdict(regime.setup),
        "seeds": seeds,
        "budgets": budgets,
        "static_gap": static,
        "summary": jsonable(summary),
        "verdicts": verdicts(summary, budgets),
        "wall_s": time.perf_counter() - t0,
        "provenance": record(),
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(regime.name, summary, budgets, RESULTS / f"{name}.png")
    logger.info(f"{regime.name}: {regime.description}; seeds {seeds}; {regime.setup.steps} steps")
    print_report(summary, static, out["verdicts"], windows)


if __name__ == "__main__":
    main()
