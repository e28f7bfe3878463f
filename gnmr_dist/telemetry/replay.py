"""``gnmr-replay TRACE [--max-active N] [--alpha A] ...``: re-run a recorded trace offline.

A trace holds the exact per-unit norms of a run. Replaying it through a controller with other
settings shows, before a big run, how often units would exceed the thresholds and how much of
the model would sit on the recovery path, without touching a GPU. With the recorded settings the
replay reproduces the recorded decisions exactly (the controller is deterministic), which the
command checks and reports. A trace recorded with ``gnmr.gamma`` (docs/algorithm.md#damage-term)
also holds each step's error scores; they are passed back to the controller, so ``--gamma`` re-tunes
that threshold too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gnmr_dist.core import Decision, GNMRConfig, GNMRController


@dataclass(frozen=True)
class ReplaySummary:
    """Fractions over eligible unit-steps after warm-up."""

    steps: int
    eligible_units: int
    exceedance_rate: float
    recovery_rate: float
    nonfinite_steps: int
    matches_recorded: int | None
    top_units: list[tuple[str, int]]


def decisions(
    norms: torch.Tensor,
    config: GNMRConfig,
    eligible: Sequence[bool],
    errors: torch.Tensor | None = None,
) -> Iterator[Decision]:
    """A fresh controller's decision for every row of ``norms`` ([steps, U]).

    ``errors`` ([steps, U], the recorded error scores) are required with ``config.gamma`` set
    and ignored without it.
    """
    if config.gamma is not None and errors is None:
        raise ValueError(
            "gnmr.gamma is set but the trace holds no error scores (it was recorded without the "
            "section 2.1 term): replay it without gamma"
        )
    ctrl = GNMRController(norms.shape[1], config, eligible=list(eligible))
    for i, row in enumerate(norms):
        yield (
            ctrl.step(row)
            if errors is None or config.gamma is None
            else ctrl.step(row, errors=errors[i])
        )


def replay(
    norms: torch.Tensor,
    config: GNMRConfig,
    eligible: Sequence[bool],
    units: Sequence[str],
    recorded: Sequence[Sequence[int]] | None = None,
    errors: torch.Tensor | None = None,
) -> ReplaySummary:
    """Run ``norms`` ([steps, U]) through a controller and summarise what it chose.

    ``errors`` ([steps, U], the recorded error scores) are required with ``config.gamma`` set
    and ignored without it.
    """
    n_elig = max(1, sum(bool(e) for e in eligible))
    counts = torch.zeros(norms.shape[1], dtype=torch.int64)
    exceed = active = scored = nonfinite = 0
    same = 0
    for i, d in enumerate(decisions(norms, config, eligible, errors)):
        counts[list(d.active)] += 1
        nonfinite += int(d.telemetry.num_nonfinite > 0)
        same += int(recorded is not None and tuple(recorded[i]) == d.active)
        if d.step > config.warmup_steps:
            scored += 1
            exceed += d.telemetry.num_exceed_eligible
            active += d.telemetry.num_active
    denom = max(1, scored * n_elig)
    order = torch.argsort(counts, descending=True, stable=True)[:5]
    top = [(units[i], int(counts[i])) for i in order.tolist() if counts[i] > 0]
    return ReplaySummary(
        len(norms),
        n_elig,
        exceed / denom,
        active / denom,
        nonfinite,
        same if recorded is not None else None,
        top,
    )
