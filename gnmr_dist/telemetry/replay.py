"""Re-running a recorded trace offline: :class:`Recording` and :func:`replay`.

A trace holds the exact per-unit norms of a run, and everything else its controller was built
over and fed: the unit names and eligibility (the header), each unit's size and the GEMMs a
recovery covers (``meta.unit_sizes``, ``meta.gemms``: the compute-share costs of
docs/algorithm.md#compute-share), the learning rate of every step (``lr``: the lr_decay clock)
and, with the damage term, each step's error scores (``errors``). :meth:`Recording.controller`
rebuilds the controller with :meth:`~gnmr_dist.core.GNMRController.for_units`, the constructor
every integration uses, so ``pinned`` resolves over the same names and ``max_share`` gets the
same costs. Replaying with the recorded settings therefore reproduces the recorded decisions
exactly (the controller is deterministic), which ``gnmr-replay`` checks and reports; with other
settings it shows, before a big run, how often units would exceed and how much of the model
would sit on the recovery path.

A policy that needs an input the trace lacks (``max_share`` on a trace without
``meta.unit_sizes``, written by a run whose units' shapes were not all readable; the lr_decay
clock on a trace without ``lr``; ``gamma`` on a trace without ``errors``) is refused with a
``ValueError`` naming the key and what to replay instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.core import Decision, GNMRConfig, GNMRController
from gnmr_dist.telemetry.trace import (
    GEMM_NAMES,
    TraceHeader,
    read_errors,
    read_lrs,
    read_trace,
)

__all__ = ["Recording", "ReplaySummary", "replay"]


@dataclass(frozen=True)
class Recording:
    """A trace read whole: the header, the norms ``[steps, U]``, the raw records, the error
    scores (``None`` without the damage term) and the learning rates (``None`` when the records
    carry none)."""

    path: Path
    header: TraceHeader
    norms: torch.Tensor
    records: list[dict[str, Any]]
    errors: torch.Tensor | None
    lrs: list[float] | None

    @classmethod
    def read(cls, path: str | Path) -> Recording:
        """Read and check a trace file (``ValueError`` naming the file when it is malformed)."""
        header, norms, records = read_trace(path)
        errors = read_errors(path, records, len(header.units))
        return cls(Path(path), header, norms, records, errors, read_lrs(path, records))

    @property
    def gemms(self) -> int:
        """How many GEMMs a recovered unit recovered (``meta.gemms``; all three without it)."""
        return len(self.header.meta.get("gemms", GEMM_NAMES))

    @property
    def sizes(self) -> list[int] | None:
        """Each unit's summed ``in x out`` (``meta.unit_sizes``), ``None`` when not recorded."""
        sizes = self.header.meta.get("unit_sizes")
        if sizes is None:
            return None
        if len(sizes) != len(self.header.units):
            raise ValueError(
                f"{self.path}: meta.unit_sizes has {len(sizes)} entries for "
                f"{len(self.header.units)} units"
            )
        return [int(s) for s in sizes]

    @property
    def skipped_attempts(self) -> int:
        """Attempts the framework skipped for non-finite gradients: a record's
        ``skipped_steps`` when written, else one per record with ``skipped_nonfinite``."""
        return sum(
            int(r.get("skipped_steps", 1 if r.get("skipped_nonfinite") else 0))
            for r in self.records
        )

    def controller(self, config: GNMRConfig) -> GNMRController:
        """A fresh controller over the recorded units with ``config``, built as the run built
        its own; ``ValueError`` for a policy whose inputs the trace lacks (module docstring)."""
        self._check_inputs(config)
        return GNMRController.for_units(
            self.header.units,
            config,
            list(self.header.eligible),
            sizes=self.sizes if config.max_share is not None else None,
            gemms=self.gemms,
        )

    def _check_inputs(self, config: GNMRConfig) -> None:
        if config.max_share is not None and self.sizes is None:
            raise ValueError(
                f"gnmr.max_share needs the units' costs, and {self.path.name} records no "
                "meta.unit_sizes (the run could not read every unit's linear shapes): replay "
                "with --max-share null"
            )
        if config.lr_keys() and self.lrs is None:
            raise ValueError(
                f"gnmr.{config.lr_keys()[0]} runs on the lr_decay clock and {self.path.name} "
                "records no learning rate (no 'lr' in its records): replay it with a schedule "
                "or condition on the step clock"
            )
        if config.gamma is not None and self.errors is None:
            raise ValueError(
                f"gnmr.gamma is set but {self.path.name} holds no error scores (it was recorded "
                "without the damage term, docs/algorithm.md#damage-term): replay it with "
                "--gamma null"
            )

    def decisions(self, config: GNMRConfig | None = None) -> Iterator[Decision]:
        """A fresh controller's decision for every record, with ``config`` (default: the
        recorded policy), fed the recorded norms, error scores and learning rates."""
        cfg = config if config is not None else self.header.config
        ctrl = self.controller(cfg)
        for i, row in enumerate(self.norms):
            errors = self.errors[i] if self.errors is not None and cfg.gamma is not None else None
            lr = self.lrs[i] if self.lrs is not None else None
            yield ctrl.step(row, errors=errors, lr=lr)


@dataclass(frozen=True)
class ReplaySummary:
    """Fractions over eligible unit-steps after warm-up (``None`` when every step is in the
    warm-up, where no unit is a candidate and the rates are undefined)."""

    steps: int
    scored_steps: int
    eligible_units: int
    exceedance_rate: float | None
    recovery_rate: float | None
    nonfinite_steps: int
    skipped_attempts: int
    matches_recorded: int | None
    top_units: list[tuple[str, int]]


def replay(
    recording: Recording, config: GNMRConfig | None = None, *, compare: bool = False
) -> ReplaySummary:
    """Run ``recording`` through a controller with ``config`` (default: the recorded policy)
    and summarise what it chose; ``compare``: count the decisions equal to the recorded ones."""
    cfg = config if config is not None else recording.header.config
    units: Sequence[str] = recording.header.units
    n_elig = max(1, sum(bool(e) for e in recording.header.eligible))
    counts = torch.zeros(len(units), dtype=torch.int64)
    exceed = active = scored = nonfinite = same = 0
    for d, r in zip(recording.decisions(cfg), recording.records, strict=True):
        counts[list(d.active)] += 1
        nonfinite += int(d.telemetry.num_nonfinite > 0)
        same += int(tuple(r["active"]) == d.active)
        if d.step > cfg.warmup_steps:
            scored += 1
            exceed += d.telemetry.num_exceed_eligible
            active += d.telemetry.num_active
    order = torch.argsort(counts, descending=True, stable=True)[:5]
    top = [(units[i], int(counts[i])) for i in order.tolist() if counts[i] > 0]
    return ReplaySummary(
        steps=len(recording.records),
        scored_steps=scored,
        eligible_units=n_elig,
        exceedance_rate=exceed / (scored * n_elig) if scored else None,
        recovery_rate=active / (scored * n_elig) if scored else None,
        nonfinite_steps=nonfinite,
        skipped_attempts=recording.skipped_attempts,
        matches_recorded=same if compare else None,
        top_units=top,
    )


def rate_text(rate: float | None) -> str:
    """A rate as the tools print it: a percentage, or why there is none."""
    if rate is None or math.isnan(rate):
        return "n/a (every step is in the warm-up)"
    return f"{100 * rate:.3f}%"
