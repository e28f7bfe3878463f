"""``gnmr-replay TRACE [--max-active N] [--alpha A] ...``: re-run a recorded trace offline.

The replay itself is :func:`gnmr_dist.telemetry.replay.replay`. A trace holds the norms (and
error scores), not the units' costs nor the learning rate, and its controller gets no pinned
mask: a policy that needs one of those (``max_share``, the lr_decay clock, ``pinned`` by name)
is refused with what to replay instead."""

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
            f"{text!r}: give a number, null or a JSON value like "
            '\'{"schedule": "linear", "start": 3, "end": 1.5, "steps": 500}\''
        ) from None


def _replayable(config: GNMRConfig) -> None:
    """``ValueError`` naming the fix for a policy a trace cannot replay (module docstring)."""
    if config.max_share is not None:
        raise ValueError(
            "gnmr.max_share needs the units' costs (GNMRController(costs=, total_cost=)), which "
            "a trace does not record: replay with --max-share null"
        )
    if config.lr_keys():
        raise ValueError(
            f"gnmr.{config.lr_keys()[0]} runs on the lr_decay clock and a trace records no "
            "learning rate: replay it with a schedule or condition on the step clock"
        )
    if config.pinned is not None and config.pinned.units != "all":
        raise ValueError(
            f"gnmr.pinned.units is {config.pinned.to_dict()['units']!r}: gnmr-replay gives its "
            'controller no pinned mask, so it replays only "units": "all" (or --pinned null)'
        )


_POLICY_OPTIONS: dict[str, tuple[Any, str | None]] = {
    "--max-active": (_threshold, "budget maxO: an integer or a JSON budget schedule"),
    "--lock-steps": (int, None),
    "--window": (int, None),
    "--warmup-steps": (int, None),
    "--alpha": (_threshold, "number or JSON schedule"),
    "--beta": (_threshold, "number or JSON schedule"),
    "--gamma": (_threshold, "number, JSON schedule or null (traces with error scores)"),
    "--latch": (_threshold, 'JSON condition {"step": m}, or null'),
    "--pinned": (_threshold, 'JSON {"units": "all", "from": {"step": m}}, or null'),
    "--max-share": (_threshold, "null only: a trace records no unit costs"),
}
"""The policy keys gnmr-replay takes; one left out keeps the recorded value."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gnmr-replay",
        description=__doc__.split("\n\n")[0],
        argument_default=argparse.SUPPRESS,  # a policy option not given is not an override
    )
    p.add_argument("trace", help="a JSON-lines trace written during training (trace.jsonl)")
    policy = p.add_argument_group("policy", "docs/algorithm.md#policy; unset: as recorded")
    for flag, (kind, text) in _POLICY_OPTIONS.items():
        policy.add_argument(flag, type=kind, help=text)
    p.add_argument("--json", action="store_true", default=False, help="summary as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        header, norms, records = read_trace(args.trace)
        errors = read_errors(args.trace, records, len(header.units))
        names = GNMRConfig.field_names()
        overrides = {k: getattr(args, k) for k in names if hasattr(args, k)}
        config = replace(header.config, **overrides)
        _replayable(config)
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
