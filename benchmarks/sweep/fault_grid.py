"""The magnitude x onset grid of issue 44: faults as real models have them, on the branch
estimator.

    python -m benchmarks.sweep.fault_grid --cells free_long,m20_rise [--arms statics|arms|NAMES]
        [--gate] [--seeds 1234,7,42,5,11] [--jobs 2]

One regime per cell (:mod:`.grid_cells`), all on ``outlier_delayed``'s setup (per-tensor e4m3
with TE's delayed scaling / BF16 in ``fp8_emulated``, lr 1e-3, ``gamma`` 0.02) and its BF16
trunks, one branch point per seed (:data:`POINT`):

- ``m<m>_<onset>``: the function-preserving outlier of magnitude ``2^m`` with
  the onset ``instant``, ``rise`` (x4 per step) or ``slow`` (emerging over 200 steps)
  (:mod:`benchmarks.harness.fault_shapes`), in the layer and channel ``OutlierPlan`` draws from
  the seed; a 50-step branch (the slow cells: 225 steps, the window of 220 inside it);
- ``m<m>_<onset>_visible``: the same outlier, gradient-visible;
- ``free`` and ``free_long``: no fault, 50 and 225 steps: what each arm costs when nothing is
  wrong. A function-preserving outlier leaves a BF16 path bit for bit alone, so the BF16 branch
  and its null control of every such cell are ``free_long``'s (read at the cell's evaluations:
  a branch's first ``H`` steps do not depend on its horizon); a visible cell runs its own.

Arms (``fault_arms``' own, :data:`STATICS` and :data:`ARMS`): the statics and nulls in every
cell; ``GNMR+e 4``, ``e-only 4`` and ``TE autoswitch 4`` (and ``GNMR 4``, the norms alone, in the
visible cells and the fault-free control) where the cell's static gap is resolved (``--gate``:
its 95% interval over the seeds excludes 0, the rule registered in
:data:`benchmarks.harness.preregistered.GRID_GATE`). Records go to
``results/fault_grid/grid_<cell>.jsonl`` as branches end; RESULTS.md's section is
:mod:`benchmarks.report.fault_grid`. The design: docs/benchmarks.md#sweep-fault-grid.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import branch_stats
from benchmarks.harness.arms import Arm
from benchmarks.harness.common import arg_parser, start_cli
from benchmarks.harness.stats import interval
from benchmarks.sweep.branch_arms import fault_arms
from benchmarks.sweep.grid_cells import (
    ARMS,
    CELLS,
    NORMS,
    POINT,
    SEEDS,
    SHARED,
    STATICS,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ARMS",
    "CELLS",
    "NORMS",
    "SHARED",
    "POINT",
    "SEEDS",
    "STATICS",
    "gap_resolved",
]


def arms_of(cell: str, which: str) -> list[tuple[Arm, bool]]:
    """``(arm, perturbed)`` of ``cell``: ``which`` is ``statics``, ``arms`` or exact names."""
    regime = CELLS[cell]
    visible = cell.endswith("_visible")
    if which == "statics":
        names: tuple[str, ...] = STATICS
        if not visible and cell != "free_long":
            names = tuple(n for n in STATICS if n not in SHARED)
    elif which == "arms":
        names = ARMS + ((NORMS,) if visible or cell.startswith("free") else ())
    else:
        names = tuple(n.strip() for n in which.split(",") if n.strip())
    arms = {a.name: (a, p) for a, p in fault_arms(regime, [4], regime.units)}
    unknown = [n for n in names if n not in arms]
    if unknown:
        raise SystemExit(f"no arm named {unknown}; the arms: {sorted(arms)}")
    return [arms[n] for n in names]


def held_out(
    cell: str, arm: str, seed: int, records: dict[str, branch_stats.Records]
) -> float | None:
    """``arm``'s held-out loss at the end of ``cell``'s branch of ``seed`` (the shared BF16
    arms of a function-preserving cell from ``free_long``, at the cell's horizon)."""
    regime = CELLS[cell]
    h = str(regime.instrument.horizon)
    source = "free_long" if arm in SHARED and not cell.endswith("_visible") else cell
    r = records[source].get((arm, seed, POINT))
    return None if r is None else r["heldout"].get(h)


def gap_resolved(cell: str, records: dict[str, branch_stats.Records], seeds: Sequence[int]) -> bool:
    """The registered gate: ``low-cost - BF16`` over ``seeds``, its 95% interval excludes 0."""
    gaps = []
    for s in seeds:
        lo, hi = held_out(cell, "low-cost", s, records), held_out(cell, "BF16", s, records)
        if lo is None or hi is None:
            return False
        gaps.append(lo - hi)
    m, half = interval(gaps)
    logger.info("%s: static gap %+.4f +- %.4f over %d seeds", cell, m, half, len(gaps))
    return len(gaps) >= 2 and abs(m) > half


def read(cells: Sequence[str]) -> dict[str, branch_stats.Records]:
    """The records of ``cells`` and ``free_long``."""
    from benchmarks.sweep.branches import records_file

    for c in {*cells, "free_long"}:
        records_file(CELLS[c].name).parent.mkdir(parents=True, exist_ok=True)
    return {
        c: branch_stats.read_records(records_file(CELLS[c].name)) for c in {*cells, "free_long"}
    }


def _job(payload: tuple[str, str, Arm, int, int, bool]) -> tuple[str, dict[str, Any]]:
    """One branch in a worker: (its regime's name, its record)."""
    from benchmarks.sweep.branches import _job as branch_job

    return payload[1], branch_job(payload)


def run(cells: Sequence[str], which: str, seeds: Sequence[int], jobs: int, gate: bool) -> None:
    """Every missing branch of ``cells`` (``which`` arms; ``gate``: only the cells whose static
    gap is resolved) in one pool of ``jobs`` processes, in the cells' order, each record
    appended to its cell's file as it ends."""
    import multiprocessing as mp

    from benchmarks.harness.branch import trunk_file
    from benchmarks.sweep.branches import _worker_init, records_file, trunks_dir

    payloads = []
    for cell in cells:
        regime = CELLS[cell]
        have = read([cell])
        if gate and not gap_resolved(cell, have, seeds):
            logger.info("%s: static gap not resolved, its arms are not run (the gate)", cell)
            continue
        for s in seeds:
            if not trunk_file(trunks_dir(regime), s, POINT).exists():
                raise SystemExit(f"no trunk of seed {s}: run benchmarks.sweep.branches on it first")
            for arm, pert in arms_of(cell, which):
                if (arm.name, s, POINT) not in have[cell]:
                    payloads.append(("branch", regime.name, arm, s, POINT, pert))
    logger.info("%d branches to run", len(payloads))
    with mp.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
        for i, (name, r) in enumerate(pool.imap_unordered(_job, payloads), 1):
            with records_file(name).open("a") as f:
                f.write(json.dumps(r) + "\n")
            logger.info(
                "[%d/%d] %s %s seed %d (%.0f s)",
                i,
                len(payloads),
                name,
                r["arm"],
                r["seed"],
                r["wall_s"],
            )


def main(argv: Sequence[str] | None = None) -> None:
    p = arg_parser(__doc__)
    p.add_argument("--cells", required=True, help="comma-separated cells (m20_rise, free, ...)")
    p.add_argument("--arms", default="statics", help="statics, arms, or exact arm names")
    p.add_argument("--gate", action="store_true", help="only cells whose static gap is resolved")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    start_cli()
    cells = [c.strip() for c in a.cells.split(",") if c.strip()]
    bad = [c for c in cells if c not in CELLS]
    if bad:
        raise SystemExit(f"--cells: no cell {bad}; the cells: {sorted(CELLS)}")
    run(cells, a.arms, [int(s) for s in a.seeds.split(",")], a.jobs, a.gate)


if __name__ == "__main__":
    main()
