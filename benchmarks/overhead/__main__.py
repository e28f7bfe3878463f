"""What GNMR costs: step time against the low-cost path, the monitor against clipping, collectives.

    python -m benchmarks.overhead [--steps 30] [--budget 0.1] [--threads 1] [--parts abc]

(a) step time (:mod:`benchmarks.overhead.step_time`), (b) the monitor against plain gradient
clipping on the same gradients (:func:`benchmarks.overhead.monitor.part_b`), (c) the collectives
of a step in a real 2-process gloo run under DeepSpeed ZeRO-1, GNMR on vs off
(:mod:`benchmarks.overhead.collectives`): the extra per step must be exactly one all-reduce of
U + 1 float64 values. Writes ``benchmarks/results/overhead.json``; the parts and why
``--threads 1`` is the default: docs/benchmarks.md#overhead.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import RESULTS, start_cli
from benchmarks.harness.provenance import record
from benchmarks.harness.recipes import TARGET
from benchmarks.harness.tables import collectives_table as table_c
from benchmarks.harness.tables import monitor_table as table_b
from benchmarks.overhead.collectives import Call, CollectiveSpec, part_c
from benchmarks.overhead.config import GNMR_POLICY, backend_options
from benchmarks.overhead.monitor import part_b
from benchmarks.overhead.step_time import part_a, table_a, timing_parser, verdict

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = timing_parser(__doc__, "overhead.json", steps=30, warm=4, rounds="per arm in (a)")
    p.prog = "python -m benchmarks.overhead"  # not __main__.py
    p.add_argument("--budget", type=float, default=0.1, help="max_active / units of GNMR")
    p.add_argument("--repeats", type=int, default=30, help="repeats per arm in (b)")
    p.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run")
    p.add_argument("--local-only", action="store_true", help="(a) without the DeepSpeed arms")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli(a.threads)
    setup = Setup()
    units = 7 * setup.layers
    budget = max(1, round(a.budget * units))
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": a.threads,
        "setup": asdict(setup),
        "gnmr_policy": GNMR_POLICY,
        "budget": budget,
        "backends": backend_options(),
        "target": TARGET,
        "provenance": record(),
    }
    text = []
    if "c" in a.parts:
        t0 = time.perf_counter()
        out["collectives"] = res = part_c(CollectiveSpec(max_active=budget))
        text.append(
            f"(c) collectives per step, 2 processes (gloo), DeepSpeed ZeRO-1, GNMR on vs off; "
            f"U = {res['units_independent']} (registry {res['units_registry']}); plain ZeRO-1 "
            f"step ops {res['plain_step_ops']}\n{table_c(res)}\n"
            f"extra = exactly one all_reduce of 8(U+1) = {res['expected_extra_bytes']} bytes on "
            f"every rank and step: {'yes' if res['ok'] else 'NO'}"
        )
        logger.info(f"  (c) {time.perf_counter() - t0:.0f} s")
    if "b" in a.parts:
        out["monitor_vs_clip"] = rows = part_b(setup, a.repeats)
        text.append(f"(b) monitor vs clip_grad_norm_ on the same gradients\n{table_b(rows)}")
    if "a" in a.parts:
        out["step_time"] = res_a = part_a(setup, a.steps, a.warm, budget, a.local_only)
        text.append(
            f"(a) step time, {a.steps} interleaved rounds per arm after {a.warm} warm-up, "
            f"{a.threads} thread(s), budget K = {budget} of {units} units\n{table_a(res_a)}\n"
            + "\n".join(verdict(k, v, budget) for k, v in res_a.items())
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=_json))
    logger.info("\n\n".join(text))


def _json(obj: Any) -> Any:
    if isinstance(obj, Call):
        return asdict(obj)
    if isinstance(obj, Counter):
        return sorted(obj.elements())
    raise TypeError(type(obj).__name__)


if __name__ == "__main__":
    main()
