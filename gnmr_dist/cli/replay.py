"""``gnmr-replay TRACE [--max-active N] [--alpha A] ...``: re-run a recorded trace offline.

The replay itself is :func:`gnmr_dist.telemetry.replay.replay`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gnmr_dist.core import GNMRConfig
from gnmr_dist.telemetry import read_errors, read_trace
from gnmr_dist.telemetry.replay import replay


def _threshold(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number or a JSON schedule like "
            '\'{"schedule": "linear", "start": 3, "end": 1.5, "steps": 500}\''
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a JSON-lines trace written during training (trace.jsonl)")
    p.add_argument("--max-active", type=int, help="budget maxO")
    p.add_argument("--lock-steps", type=int)
    p.add_argument("--window", type=int)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--alpha", type=_threshold, help="number or JSON schedule")
    p.add_argument("--beta", type=_threshold, help="number or JSON schedule")
    p.add_argument(
        "--gamma", type=_threshold, help="number or JSON schedule (traces with error scores)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        header, norms, records = read_trace(args.trace)
        errors = read_errors(args.trace, records, len(header.units))
        given = {k: getattr(args, k, None) for k in GNMRConfig.field_names()}
        overrides = {k: v for k, v in given.items() if v is not None}
        config = replace(header.config, **overrides)
        recorded = [r["active"] for r in records] if not overrides else None
        s = replay(norms, config, header.eligible, header.units, recorded, errors)
    except (OSError, ValueError) as err:
        print(f"gnmr-replay: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**s.__dict__, "config": config.to_dict()}))
        return 0
    units = len(header.units)
    print(f"trace: {args.trace}  ({s.steps} steps, {units} units, {s.eligible_units} eligible)")
    print(f"policy: {json.dumps(config.to_dict())}")
    print(f"exceedance rate: {100 * s.exceedance_rate:.3f}% of eligible unit-steps after warm-up")
    print(
        f"recovery rate:   {100 * s.recovery_rate:.3f}% of eligible unit-steps on the recovery path"
    )
    print(f"steps with a non-finite norm: {s.nonfinite_steps}")
    if s.matches_recorded is not None:
        print(f"decisions equal to the recorded ones: {s.matches_recorded}/{s.steps}")
    for name, n in s.top_units:
        print(f"  most recovered: {name}  ({n} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
