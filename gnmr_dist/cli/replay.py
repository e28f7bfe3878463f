"""``gnmr-replay TRACE [--max-active N] [--alpha A] ...``: re-run a recorded trace offline.

The replay itself is :func:`gnmr_dist.telemetry.replay.replay`, over the controller the run
built (:class:`gnmr_dist.telemetry.replay.Recording`): every policy key of docs/algorithm.md
can be replayed or re-tuned, ``max_share``, ``pinned`` and the lr_decay clock included, from
what the trace records (the unit sizes and GEMMs in its header, each step's learning rate and
error scores). A policy whose inputs the trace lacks is refused, naming the key."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from gnmr_dist.core import GNMRConfig
from gnmr_dist.telemetry.replay import Recording, rate_text, replay


def _threshold(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number, null or a JSON value like "
            '\'{"schedule": "linear", "start": 3, "end": 1.5, "steps": 500}\''
        ) from None


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
    "--max-share": (
        _threshold,
        "share of the units' FLOPs: a number in [0, 1], a schedule or null",
    ),
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
        recording = Recording.read(args.trace)
        names = GNMRConfig.field_names()
        given = {k: getattr(args, k) for k in names if hasattr(args, k)}
        config = GNMRConfig.from_dict({**recording.header.config.to_dict(), **given})
        s = replay(recording, config, compare=not given)
    except (OSError, ValueError) as err:
        print(f"gnmr-replay: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**s.__dict__, "config": config.to_dict()}))
        return 0
    units = len(recording.header.units)
    print(f"trace: {args.trace}  ({s.steps} steps, {units} units, {s.eligible_units} eligible)")
    print(f"policy: {json.dumps(config.to_dict())}")
    print(f"exceedance rate: {rate_text(s.exceedance_rate)} of eligible unit-steps after warm-up")
    print(f"recovery rate:   {rate_text(s.recovery_rate)} of eligible unit-steps after warm-up")
    print(
        f"steps with a non-finite norm: {s.nonfinite_steps}; attempts the framework skipped "
        f"(non-finite gradients): {s.skipped_attempts}"
    )
    if s.matches_recorded is not None:
        print(f"decisions equal to the recorded ones: {s.matches_recorded}/{s.steps}")
    for name, n in s.top_units:
        print(f"  most recovered: {name}  ({n} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
