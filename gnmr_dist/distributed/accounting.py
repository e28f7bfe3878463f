"""What a run recovered and where its gradients went non-finite, counted the same on every rank.

The controller counts, per unit, the decided steps it ran on the recovery path and the decided
steps whose norm was non-finite (docs/algorithm.md#accounting). Two things only the runtime
sees complete that count:

* **which GEMMs ran recovered.** A unit on the recovery path recovers the GEMMs of
  ``gnmr.gemms`` (docs/gemms.md), so the runtime counts ``[U, 3]`` steps per unit and GEMM
  (``fprop``, ``dgrad``, ``wgrad``), from the plan each applied step *ran* (after a resume that
  conformed the saved plan to a tighter policy this is what ran, where the controller counts
  what it had decided);
* **steps the framework skipped.** DeepSpeed's ZeRO optimizers and megatron skip a step whose
  gradients hold an inf or NaN, and the controller never sees that step (its history stays
  untouched). The norms were all-reduced before the skip, so the runtime counts the skipped
  step's non-finite units here and, when the run had none before, names the first one.

The run's *first non-finite event* is the earlier of the controller's and the skipped steps'
(same step number: the skipped attempt came first). It is named in one ``logger.warning`` line,
identical on every rank because every rank holds the same reduced norms::

    gnmr: first non-finite gradient norm of the run at step 12: unit 5
    model.layers.0.mlp.down_proj (nan; 1 of 14 units non-finite), a step the framework skipped

The counts live in the runtime's state (``accounting``), so a resume continues them.
:meth:`RunAccounting.summary` gives the end-of-run figures: the recovered share of unit-steps
``sum recovered / (U t)`` and of linear FLOPs ``sum_u sum_g recovered_g(u) size(u) / (3 sum
size t)`` (each GEMM of a unit costs its ``size = sum in x out`` per token), the non-finite
unit-steps and the first non-finite unit.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["GEMM_ORDER", "AccountingSummary", "NonFinite", "RunAccounting"]

GEMM_ORDER = ("fprop", "dgrad", "wgrad")
"""The columns of the per-GEMM counts: the order of ``gnmr_dist.backends.gemms.GEMMS`` (the
backends sit above this layer, so the names are repeated here; a test keeps them equal)."""


@dataclass(frozen=True)
class NonFinite:
    """The run's first non-finite gradient norm (the lowest unit id at that step)."""

    step: int
    """The optimizer step (the controller's 1-based count; a skipped step carries the number
    of the step that was retried)."""
    unit: int
    """The unit id."""
    name: str
    """Its global name."""
    value: float
    """Its norm (NaN or +-inf); NaN when restored from a checkpoint."""
    units: int
    """How many units were non-finite at that step (0 when restored)."""
    skipped: bool
    """Whether the framework skipped that step."""

    def as_dict(self) -> dict[str, Any]:
        """``{"step", "unit", "name", "skipped"}`` (the JSON form in a trace and a summary)."""
        return {"step": self.step, "unit": self.unit, "name": self.name, "skipped": self.skipped}

    def line(self, num_units: int) -> str:
        """The one log line that names it (module docstring)."""
        what = f"{self.value}"
        if self.units:
            what += f"; {self.units} of {num_units} units non-finite"
        where = ", a step the framework skipped" if self.skipped else ""
        return (
            f"gnmr: first non-finite gradient norm of the run at step {self.step}: unit "
            f"{self.unit} {self.name} ({what}){where}"
        )


@dataclass(frozen=True)
class AccountingSummary:
    """The run's accounting at one moment (:meth:`RunAccounting.summary`)."""

    steps: int
    """Decided (applied) optimizer steps."""
    num_units: int
    recovered: torch.Tensor
    """int64 [U]: applied steps each unit ran on the recovery path."""
    recovered_gemms: torch.Tensor
    """int64 [U, 3]: the same per GEMM (:data:`GEMM_ORDER`)."""
    nonfinite: torch.Tensor
    """int64 [U]: steps each unit's norm was non-finite, skipped steps included."""
    skipped_nonfinite: torch.Tensor
    """int64 [U]: the part of :attr:`nonfinite` on steps the framework skipped."""
    recovered_share: float
    """``sum recovered / (U t)``; NaN before the first step."""
    recovered_flops_share: float | None
    """Recovered GEMM work over the units' linear work (``None``: sizes unknown; NaN before
    the first step)."""
    first_nonfinite: NonFinite | None

    @property
    def recovered_unit_steps(self) -> int:
        return int(self.recovered.sum())

    @property
    def nonfinite_unit_steps(self) -> int:
        return int(self.nonfinite.sum())

    def per_unit(self, names: Sequence[str]) -> dict[str, dict[str, int]]:
        """``{name: {"recovered": n, "fprop": n, ..., "nonfinite": m}}`` of the units with a
        nonzero count (small logs: the others are all zero)."""
        out: dict[str, dict[str, int]] = {}
        hot = (self.recovered > 0) | (self.nonfinite > 0) | (self.recovered_gemms > 0).any(1)
        for u in torch.nonzero(hot).flatten().tolist():
            entry = {"recovered": int(self.recovered[u])}
            entry.update({g: int(self.recovered_gemms[u, i]) for i, g in enumerate(GEMM_ORDER)})
            entry["nonfinite"] = int(self.nonfinite[u])
            out[names[u]] = entry
        return out

    def as_dict(self, names: Sequence[str]) -> dict[str, Any]:
        """The JSON form (a run's ``summary.json``, a test's comparison)."""
        first = self.first_nonfinite
        return {
            "steps": self.steps,
            "units": self.num_units,
            "recovered_unit_steps": self.recovered_unit_steps,
            "recovered_gemm_steps": {
                g: int(self.recovered_gemms[:, i].sum()) for i, g in enumerate(GEMM_ORDER)
            },
            "recovered_share": self.recovered_share,
            "recovered_flops_share": self.recovered_flops_share,
            "nonfinite_unit_steps": self.nonfinite_unit_steps,
            "skipped_nonfinite_unit_steps": int(self.skipped_nonfinite.sum()),
            "first_nonfinite": None if first is None else first.as_dict(),
            "per_unit": self.per_unit(names),
        }


class RunAccounting:
    """The runtime's part of the accounting (module docstring): per-GEMM recovered steps and
    the non-finite norms of skipped steps, over ``names`` (the units, in id order), with
    ``gemms`` (the names in ``gnmr.gemms``) recovered and ``sizes`` (each unit's ``sum in x
    out``, ``None``: unknown) for the FLOPs share."""

    def __init__(
        self, names: Sequence[str], gemms: Collection[str], sizes: Sequence[int] | None
    ) -> None:
        unknown = sorted(set(gemms) - set(GEMM_ORDER))
        if unknown or not gemms:
            raise ValueError(f"gemms must name some of {list(GEMM_ORDER)}, got {list(gemms)}")
        self.names = tuple(names)
        self.gemms = np.array([g in gemms for g in GEMM_ORDER])
        known = sizes is not None and all(int(s) > 0 for s in sizes)
        self.sizes = np.asarray(sizes, dtype=np.int64) if known else None
        self.reset()

    def reset(self) -> None:
        """Zero counts and no first event (a fresh start)."""
        u = len(self.names)
        self.gemm_steps = np.zeros((u, len(GEMM_ORDER)), dtype=np.int64)
        self.skipped_nonfinite = np.zeros(u, dtype=np.int64)
        self.skipped_first = (0, -1)
        self._seen: NonFinite | None = None  # the run's first event, when this process saw it

    def ran(self, units: Collection[int]) -> None:
        """An applied step ran ``units`` on the recovery path."""
        if units:
            ids = np.fromiter(units, dtype=np.int64)
            # only the GEMMs gnmr.gemms recovers count for a recovered unit
            self.gemm_steps[np.ix_(ids, np.flatnonzero(self.gemms))] += 1

    def note(
        self,
        step: int,
        norms: torch.Tensor,
        controller_first: tuple[int, int] | None,
        skipped: bool,
    ) -> NonFinite | None:
        """Step ``step``'s reduced ``norms``, a step the framework ``skipped`` (its non-finite
        units are counted here) or one the controller decided (``controller_first``: its first
        non-finite ``(step, unit)`` after that decision). Returns the run's first non-finite
        event when it is this step's, with its value, else ``None``: the one place that event
        is decided (module docstring)."""
        if skipped:
            return self._skipped(step, norms, controller_first is not None)
        # not this step's event, or a skipped attempt came before it and was the first
        if controller_first is None or controller_first[0] != step or self.skipped_first[0]:
            return None
        unit = controller_first[1]
        bad = int((~torch.isfinite(norms)).sum())
        self._seen = NonFinite(step, unit, self.names[unit], float(norms[unit]), bad, False)
        return self._seen

    def _skipped(self, step: int, norms: torch.Tensor, first_known: bool) -> NonFinite | None:
        """Count a skipped step's non-finite units; the run's first event when there was none."""
        bad = ~torch.isfinite(norms.detach().cpu().double())
        if not bool(bad.any()):
            return None
        self.skipped_nonfinite += bad.numpy()
        # counted above either way; named only when it is the run's first
        if first_known or self.skipped_first[0]:
            return None
        unit = int(torch.nonzero(bad)[0])
        self.skipped_first = (step, unit)
        value = float(norms[unit])
        self._seen = NonFinite(step, unit, self.names[unit], value, int(bad.sum()), True)
        return self._seen

    def first(self, controller_first: tuple[int, int] | None) -> NonFinite | None:
        """The run's first non-finite event: the earlier of the controller's (``(step,
        unit)``) and the skipped steps' (module docstring); with its value when this process
        saw it, else (after a resume) with NaN and 0."""
        if self._seen is not None:
            return self._seen
        events = []
        if self.skipped_first[0]:
            events.append((self.skipped_first[0], 0, self.skipped_first[1]))
        if controller_first is not None:
            events.append((controller_first[0], 1, controller_first[1]))
        if not events:
            return None
        step, kind, unit = min(events)
        return NonFinite(step, unit, self.names[unit], math.nan, 0, kind == 0)

    def summary(
        self, steps: int, recovered: torch.Tensor, nonfinite: torch.Tensor, first: NonFinite | None
    ) -> AccountingSummary:
        """The figures after ``steps`` decisions, with the controller's ``recovered`` and
        ``nonfinite`` counts (module docstring)."""
        u = len(self.names)
        unit_steps = u * steps
        share = int(recovered.sum()) / unit_steps if unit_steps else math.nan
        flops: float | None = None
        if self.sizes is not None:
            work = 3 * int(self.sizes.sum()) * steps
            done = int((self.gemm_steps.sum(axis=1) * self.sizes).sum())
            flops = done / work if work else math.nan
        return AccountingSummary(
            steps=steps,
            num_units=u,
            recovered=recovered.clone(),
            recovered_gemms=torch.from_numpy(self.gemm_steps.copy()),
            nonfinite=nonfinite + torch.from_numpy(self.skipped_nonfinite),
            skipped_nonfinite=torch.from_numpy(self.skipped_nonfinite.copy()),
            recovered_share=share,
            recovered_flops_share=flops,
            first_nonfinite=first,
        )

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, torch.Tensor]:
        """The counts as plain tensors (``weights_only``-safe)."""
        return {
            "gemm_steps": torch.from_numpy(self.gemm_steps.copy()),
            "skipped_nonfinite": torch.from_numpy(self.skipped_nonfinite.copy()),
            "skipped_first": torch.tensor(self.skipped_first, dtype=torch.int64),
        }

    def load(self, state: Mapping[str, torch.Tensor] | None, recovered: torch.Tensor) -> None:
        """Take over a checked :meth:`state` (:func:`gnmr_dist.state.read_run` checked it);
        ``None`` (a state from before this accounting): every GEMM of ``gnmr.gemms`` is taken to
        have run the controller's ``recovered`` steps, no skipped step was non-finite."""
        self.reset()
        if state is None:
            # a state from before the per-GEMM counts: every recovered step ran the gemms
            self.gemm_steps = np.outer(recovered.numpy(), self.gemms).astype(np.int64)
            return
        self.gemm_steps = state["gemm_steps"].numpy().copy()
        self.skipped_nonfinite = state["skipped_nonfinite"].numpy().copy()
        at, unit = state["skipped_first"].tolist()
        self.skipped_first = (int(at), int(unit))
