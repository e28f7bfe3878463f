"""The loss oracle of a fault regime: the best ``k`` units by measured held-out gain, the real
upper bound of any selection at budget ``k``.

    python -m benchmarks.sweep.loss_oracle --regime outlier_fp8_tensor [--seeds 1234,7]
        [--points 175] [--budgets 4] [--jobs 2]

For every (seed, branch point) of the design each eligible unit is recovered alone over the
whole branch (``single <u>``, policy ``fixed``); its gain is ``h(low-cost) - h(single u)``
(held-out, paired on the branch). ``loss oracle k`` then recovers the ``k`` units of largest
gain over the same branch. The gains of units recovered together need not add up, so the
oracle is the best set by single gains, measured as a set. It costs ``units + 1`` branches per
(seed, point): run it on a subset of the design's points. Records join the regime's
(``results/<family>/<regime>.jsonl``); the sweep's report reads them as any arm's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from benchmarks.harness import branch_stats
from benchmarks.harness.arms import Arm
from benchmarks.harness.branch_stats import Records
from benchmarks.harness.common import arg_parser, start_cli
from benchmarks.sweep.branches import records_file, run_branches
from benchmarks.sweep.regimes import BRANCH_REGIMES, Regime

__all__ = ["oracle_arm", "single_arms"]

logger = logging.getLogger(__name__)


def single_arms(regime: Regime, units: int) -> list[Arm]:
    """One arm per unit: that unit alone on the recovery path at every step of the branch."""
    q = regime.backend_args()
    return [Arm(f"single {u}", "fixed", units=(u,), **q) for u in range(units)]


def gains(records: Records, seed: int, point: int, units: int, horizon: int) -> list[float]:
    """Per unit: ``h(low-cost) - h(single u)`` on the branch of (``seed``, ``point``)."""
    low = branch_stats.heldout(records, "low-cost", seed, point, horizon)
    return [
        low - branch_stats.heldout(records, f"single {u}", seed, point, horizon)
        for u in range(units)
    ]


def oracle_arm(regime: Regime, records: Records, seed: int, point: int, k: int) -> Arm:
    """``loss oracle k`` of the branch (``seed``, ``point``): the ``k`` units of largest single
    gain (ties by unit id)."""
    g = gains(records, seed, point, regime.units, regime.instrument.horizon)
    best = sorted(range(regime.units), key=lambda u: (-g[u], u))[:k]
    return Arm(f"loss oracle {k}", "fixed", units=tuple(sorted(best)), **regime.backend_args())


def run(regime: Regime, seeds: Sequence[int], points: Sequence[int], k: int, jobs: int) -> Records:
    """The singles (and the low-cost arm) of every (seed, point), then the oracle's branches."""
    low = Arm("low-cost", "static", **regime.backend_args())
    arms = [low, *single_arms(regime, regime.units)]
    first = [(a, s, p, False) for s in seeds for p in points for a in arms]
    records = run_branches(regime, seeds, first, jobs)
    second = [(oracle_arm(regime, records, s, p, k), s, p, False) for s in seeds for p in points]
    for arm, s, p, _ in second:
        logger.info("seed %d point %d: loss oracle %d recovers units %s", s, p, k, arm.units)
    return run_branches(regime, seeds, second, jobs)


def main(argv: Sequence[str] | None = None) -> None:
    p = arg_parser(__doc__)
    p.add_argument("--regime", choices=sorted(BRANCH_REGIMES), required=True)
    p.add_argument("--seeds", default="1234,7")
    p.add_argument("--points", default="175")
    p.add_argument("--budgets", default="4")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    start_cli()
    regime = BRANCH_REGIMES[a.regime]
    points = [int(x) for x in a.points.split(",")]
    if not set(points) <= set(regime.instrument.points):
        raise SystemExit(f"--points {a.points}: choose among {list(regime.instrument.points)}")
    seeds = [int(x) for x in a.seeds.split(",")]
    for k in (int(x) for x in a.budgets.split(",")):
        run(regime, seeds, points, k, a.jobs)
    logger.info("records in %s", records_file(regime.name))


if __name__ == "__main__":
    main()
