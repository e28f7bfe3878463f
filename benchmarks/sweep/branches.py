"""The runner of every branch regime (FP4, fault, the paper's): arms branched from shared BF16
trunk checkpoints and measured with the branch estimator.

    python -m benchmarks.sweep.branches --regime nvfp4 [--seeds 1234,7,42,5,11] [--budgets 2,4,7]
        [--points 100,250] [--jobs 2] [--arms "NAME,PREFIX*,..."] [--report-only]
    python -m benchmarks.sweep.branches --step-time [--regime nvfp4] [--steps 40]

For one branch regime (:data:`benchmarks.sweep.regimes.BRANCH_REGIMES`: the FP4 and the fault
regimes) every arm of :func:`make_arms` (controls, NVIDIA's two static rules, first+last, and
``random`` / ``GNMR`` / ``GNMR+e`` / ``oracle`` at every budget, plus the null controls), or
those ``--arms`` names exactly (a trailing ``*``: every arm whose name starts with the rest),
branches from the same checkpoints of one BF16 trunk per seed (:mod:`benchmarks.harness.branch`).
Jobs run in a pool of ``--jobs`` processes; every finished branch is appended to
``results/<family>/<regime>.jsonl`` at once, so a sweep stops and resumes at any time. An FP4
regime's report (:mod:`benchmarks.sweep.fp4_report`) reads exactly the branches of the design
(``--seeds``, ``--points``, ``--budgets``), refuses while any is missing, and goes to
``results/sweep_fp4_<regime><suffix>.json`` and ``.png`` (:func:`design_suffix`: the suffix
names what differs from the default design, so another design never overwrites the published
report); the fault and seed regimes are reported by ``python -m benchmarks.report`` from their
records alone (RESULTS.md's sections, :mod:`benchmarks.report.faults` and
:mod:`benchmarks.report.paper_branch`). ``--step-time`` times ``GNMR+e k`` against NVIDIA's rule
(:mod:`benchmarks.sweep.fp4_step_time`). The arms in detail: docs/benchmarks.md#sweep-fp4.
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
from benchmarks.harness.bases import ensure_base
from benchmarks.harness.branch import run_branch, run_trunk
from benchmarks.harness.branch_stats import Design, Records
from benchmarks.harness.common import RESULTS, arg_parser, start_cli
from benchmarks.harness.provenance import record
from benchmarks.sweep.branch_arms import make_arms, step_time_arms
from benchmarks.sweep.fp4_step_time import save, step_time
from benchmarks.sweep.grid_cells import GRID_REGIMES
from benchmarks.sweep.regimes import BRANCH_REGIMES as SWEEP_REGIMES
from benchmarks.sweep.regimes import Regime

logger = logging.getLogger(__name__)

BRANCH_REGIMES = {**SWEEP_REGIMES, **GRID_REGIMES}
"""The branch regimes and the cells of the fault grid (:mod:`benchmarks.sweep.grid_cells`)."""

SEEDS = (1234, 7, 42, 5, 11)
BUDGETS = (4,)


# ====================================================================== running


TRUNKS = RESULTS / "sweep" / "fp4" / "trunks"
"""The trunks' folder: one for every FP4 regime, whose trunks are the same BF16 runs (the same
setup and recovery path: ``tests/benchmarks/test_branch.py`` checks it), so that branches of
different regimes start from the same checkpoints too."""


def trunks_dir(regime: Regime) -> Path:
    """The trunks of ``regime``: :data:`TRUNKS` for the FP4 and fault regimes (one BF16 trunk
    per seed serves them all), ``results/sweep/<trunk>/trunks`` for a regime with its own."""
    return RESULTS / "sweep" / regime.trunk / "trunks"


def ensure_inputs(regime: Regime) -> None:
    """What a regime's trunks start from: a fine-tuning regime's base model (``init_from``),
    pretrained by its paper experiment when missing (:func:`benchmarks.harness.bases.
    ensure_base`)."""
    if regime.setup.init_from is not None:
        ensure_base(Path(regime.setup.init_from))


def records_file(regime: str) -> Path:
    """The JSON-lines file of the branch regime ``regime``'s finished branches
    (:func:`branch_stats.read_records`), in its family's folder: ``results/<family>/``."""
    r = BRANCH_REGIMES[regime]
    return RESULTS / r.family / f"{r.name}.jsonl"


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("gnmr_dist.core.controller").setLevel(logging.ERROR)  # the trunk's policy


def _job(payload: tuple[str, str, Arm, int, int, bool]) -> dict[str, Any]:
    """A trunk (``point == 0``) or one branch, in a worker process."""
    kind, regime_name, arm, seed, point, perturbed = payload
    regime = BRANCH_REGIMES[regime_name]
    if kind == "trunk":
        wall = run_trunk(regime.setup, arm, regime.instrument, seed, trunks_dir(regime))
        return {"trunk": seed, "wall_s": wall}
    root = trunks_dir(regime)
    branch = run_branch(regime.setup, arm, regime.instrument, seed, point, root, perturbed)
    return {**branch, "provenance": record()}


def run_sweep(
    regime: Regime,
    seeds: Sequence[int],
    budgets: Sequence[int],
    jobs: int,
    arm_filter: str = "",
    points: Sequence[int] | None = None,
) -> Records:
    """Build missing trunks, run (or resume) every missing branch at ``points`` (default: the
    regime's) of the arms ``arm_filter`` names (:func:`select_arms`; empty: all); return all
    records."""
    arms = select_arms(make_arms(regime, budgets, regime.units), arm_filter)
    wanted = [
        (a, s, p, pert)
        for s in seeds
        for p in (points or regime.instrument.points)
        for a, pert in arms
    ]
    return run_branches(regime, seeds, wanted, jobs)


def run_branches(
    regime: Regime, seeds: Sequence[int], wanted: Sequence[tuple[Arm, int, int, bool]], jobs: int
) -> Records:
    """Build the trunks of ``seeds``, run every (arm, seed, point, perturbed) of ``wanted``
    not yet recorded in a pool of ``jobs`` processes, appending each record as it ends; return
    all records."""
    done = branch_stats.read_records(records_file(regime.name))
    ensure_inputs(regime)
    reference = regime.trunk_arm()
    trunks = [("trunk", regime.name, reference, s, 0, False) for s in seeds]
    branches = [
        ("branch", regime.name, a, s, p, pert)
        for a, s, p, pert in wanted
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
    p.add_argument("--regime", choices=sorted(SWEEP_REGIMES), default="nvfp4")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument(
        "--arms",
        default="",
        help="run only these arms: exact names, comma-separated (quote names with spaces: "
        "'GNMR+e 4,NVIDIA last-4'); a name ending in * is a prefix ('GNMR+e*': GNMR+e at every "
        "budget; 'null*': both null controls); an unknown name lists the valid ones",
    )
    p.add_argument("--points", default="", help="a subset of the regime's branch points")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing; report the records of exactly --seeds, --points and --budgets "
        "(refused while a branch is missing; seeds other than the default name the file)",
    )
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


def design_suffix(
    regime: Regime, budgets: Sequence[int], points: Sequence[int], seeds: Sequence[int] = SEEDS
) -> str:
    """The report files' suffix: what the design changes from the default (NVIDIA's budget, all
    the regime's branch points, the :data:`SEEDS`), so that reports of two designs do not
    overwrite each other: ``_k2-4-7``, ``_p100-250``, ``_s1234-7``."""
    out = "" if tuple(budgets) == BUDGETS else "_k" + "-".join(map(str, budgets))
    if tuple(points) != tuple(regime.instrument.points):
        out += "_p" + "-".join(map(str, points))
    if set(seeds) != set(SEEDS):
        out += "_s" + "-".join(map(str, seeds))
    return out


def select_arms(arms: list[tuple[Arm, bool]], names: str) -> list[tuple[Arm, bool]]:
    """``--arms``: the arms named exactly in the comma-separated ``names`` (empty: all); a name
    ending in ``*`` takes every arm whose name starts with the rest. A name that matches no arm
    exits with the valid names."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        return arms

    def match(name: str, arm: str) -> bool:
        return arm.startswith(name[:-1]) if name.endswith("*") else arm == name

    unknown = [n for n in wanted if not any(match(n, a.name) for a, _ in arms)]
    if unknown:
        valid = ", ".join(repr(a.name) for a, _ in arms)
        raise SystemExit(f"--arms: no arm named {', '.join(map(repr, unknown))}; the arms: {valid}")
    return [(a, p) for a, p in arms if any(match(n, a.name) for n in wanted)]


def design_records(records: Records, arms: Sequence[str], d: Design) -> tuple[Records, list[Any]]:
    """The records of exactly the design ``d`` (its seeds and points) and ``arms``, and the
    (arm, seed, point) of the design's branches that are missing."""
    keys = [(a, s, p) for a in arms for s in d.seeds for p in d.points]
    return {k: records[k] for k in keys if k in records}, [k for k in keys if k not in records]


def missing_text(missing: Sequence[Any], shown: int = 12) -> str:
    """``N branches missing: (arm, seed, point), ...`` (the first ``shown`` of them)."""
    more = f", and {len(missing) - shown} more" if len(missing) > shown else ""
    return f"{len(missing)} branches missing: {', '.join(map(str, missing[:shown]))}{more}"


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli()
    regime = BRANCH_REGIMES[a.regime]
    if a.step_time:
        got = step_time(regime, *step_time_arms(regime), a.steps, TRUNKS)
        logger.info("written to %s", save(regime, got, a.steps))
        return
    seeds = list(dict.fromkeys(int(s) for s in a.seeds.split(",")))
    budgets = [int(k) for k in a.budgets.split(",")]
    points = _points(a.points, regime)
    everything = make_arms(regime, budgets, regime.units)
    select_arms(everything, a.arms)  # an unknown name exits before anything runs
    if a.report_only:
        records = branch_stats.read_records(records_file(regime.name))
    else:
        records = run_sweep(regime, seeds, budgets, a.jobs, a.arms, points)
    if regime.family != "fp4":
        logger.info(
            "%s: its report is benchmarks/RESULTS.md's %s section, rendered from %s by "
            "`python -m benchmarks.report` (%d records)",
            regime.name,
            regime.family,
            records_file(regime.name),
            len(records),
        )
        return
    from benchmarks.sweep.fp4_report import report

    design = Design(tuple(seeds), points, regime.instrument.horizon, high=regime.high)
    arms = [arm.name for arm, _ in everything]
    records, missing = design_records(records, arms, design)
    if missing:
        text = f"{regime.name}: {missing_text(missing)}; the report needs every arm's branches"
        if a.report_only:
            raise SystemExit(f"{text} (run them without --report-only, or pick --seeds/--points)")
        logger.warning("%s: not written (run the other arms, then --report-only)", text)
        return
    suffix = design_suffix(regime, budgets, points, seeds)
    report(regime, design, records, arms, budgets, suffix=suffix)


if __name__ == "__main__":
    main()
