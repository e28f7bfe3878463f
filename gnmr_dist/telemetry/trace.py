"""JSON-lines trace of per-step norms and decisions, for offline analysis and replay.

Line 1 is a header, every further line one optimizer step::

    {"format": "gnmr-trace", "version": 1, "units": ["layers.0.q_proj", ...],
     "eligible": [true, ...], "config": {...GNMRConfig.to_dict()...}, "meta": {...}}
    {"step": 1, "norms": [0.12, ...], "active": [3], "telemetry": {...}, "extra": {"loss": 2.3}}

Norms are the exact per-unit global norms the controller received, so ``gnmr-replay`` can run the
same controller with other settings and reproduce, or re-tune, every decision. Non-finite norms
are written as JSON's ``NaN``/``Infinity`` tokens. Runs with the damage term add ``"errors"``
(:func:`read_errors`), probe steps add ``"probe"`` (:class:`ProbeRecord`, :func:`read_probes`),
steps with a non-finite norm add the accounting's ``"nonfinite"``, ``"skipped_nonfinite"`` and
``"first_nonfinite"`` (:func:`read_accounting`); records without them read as before.
docs/telemetry.md#the-trace shows every field.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch

from gnmr_dist.core import Decision, GNMRConfig
from gnmr_dist.telemetry.selection import set_figures

logger = logging.getLogger(__name__)

__all__ = [
    "ProbeRecord",
    "TraceHeader",
    "TraceReader",
    "TraceWriter",
    "read_accounting",
    "read_errors",
    "read_lrs",
    "read_probes",
    "read_trace",
]

FORMAT = "gnmr-trace"
VERSION = 1
GEMM_NAMES = ("fprop", "dgrad", "wgrad")
"""A header without ``meta.gemms`` recovered all three."""


@dataclass(frozen=True)
class TraceHeader:
    """What a trace was recorded with."""

    units: tuple[str, ...]
    eligible: tuple[bool, ...]
    config: GNMRConfig
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "units": list(self.units),
            "eligible": list(self.eligible),
            "config": self.config.to_dict(),
            "meta": dict(self.meta),
        }


_PROBE_VECTORS = ("grad_gap", "grad_low_norm", "grad_high_norm")
_PROBE_KEYS = ("k", *_PROBE_VECTORS, "update_gap", "loss_low", "loss_high", "sets", "probe_ms")


@dataclass(frozen=True)
class ProbeRecord:
    """One probe step as a trace records it (the ``"probe"`` object; module docstring)."""

    step: int
    """The optimizer step probed (the decision record's step)."""
    k: int
    """Size of the k-sets (``gnmr.probe.k``)."""
    grad_gap: torch.Tensor
    """float64 [U]: ``||g_low,u - g_high,u||``."""
    update_gap: torch.Tensor | None
    """float64 [U], the gap after Adam's normalisation; ``None``: not measured."""
    grad_low_norm: torch.Tensor
    """float64 [U]: every unit on the low-cost path."""
    grad_high_norm: torch.Tensor
    """float64 [U]: every eligible unit on the recovery path."""
    loss_low: float
    loss_high: float
    sets: Mapping[str, frozenset[int]]
    """The graded sets by name (``risk_topk``, ``active``, ``decided``)."""
    probe_ms: float
    """Wall time of the probe (both passes and their reductions) in milliseconds."""

    def figures(self) -> dict[str, dict[str, float]]:
        """:func:`~gnmr_dist.telemetry.selection.set_figures` of every set in :attr:`sets`."""
        return {n: set_figures(s, self.grad_gap, self.update_gap) for n, s in self.sets.items()}

    def to_json(self) -> dict[str, Any]:
        """The ``"probe"`` object of the step's record."""

        def vec(t: torch.Tensor | None) -> list[float] | None:
            return None if t is None else t.double().cpu().tolist()

        return {
            "k": self.k,
            "grad_gap": vec(self.grad_gap),
            "update_gap": vec(self.update_gap),
            "grad_low_norm": vec(self.grad_low_norm),
            "grad_high_norm": vec(self.grad_high_norm),
            "loss_low": float(self.loss_low),
            "loss_high": float(self.loss_high),
            "probe_ms": float(self.probe_ms),
            "sets": {n: sorted(s) for n, s in self.sets.items()},
            "figures": self.figures(),
        }

    @classmethod
    def from_json(cls, step: int, obj: Mapping[str, Any], units: int, where: str) -> ProbeRecord:
        """Parse a record's ``"probe"`` object; ``ValueError`` naming ``where`` when malformed."""
        missing = [key for key in _PROBE_KEYS if key not in obj]
        if missing:
            raise ValueError(f"{where}: step {step}: the probe record lacks {missing}")

        def vec(key: str) -> torch.Tensor:
            v = torch.tensor(obj[key], dtype=torch.float64)
            if v.shape != (units,):
                raise ValueError(
                    f"{where}: step {step}: probe {key} has shape {tuple(v.shape)} (U={units})"
                )
            return v

        return cls(
            step=step,
            k=int(obj["k"]),
            grad_gap=vec("grad_gap"),
            update_gap=None if obj["update_gap"] is None else vec("update_gap"),
            grad_low_norm=vec("grad_low_norm"),
            grad_high_norm=vec("grad_high_norm"),
            loss_low=float(obj["loss_low"]),
            loss_high=float(obj["loss_high"]),
            sets={n: frozenset(int(i) for i in s) for n, s in obj["sets"].items()},
            probe_ms=float(obj["probe_ms"]),
        )


class TraceWriter:
    """Writes one line per decision to ``path``.

    A new run writes the header to a new file. A trace already at ``path`` (an earlier run in
    the same folder, or a restart whose GNMR state was missing or corrupt and started fresh) is
    never overwritten: it is renamed to the first free ``<stem>.<n><suffix>`` (``trace.1.jsonl``)
    and the new header names it (``meta["previous_trace"]``). A resumed run passes
    ``resume_after`` (the last step the restored controller had decided): records after it,
    written by the interrupted run after its checkpoint, are dropped so every step appears once
    and a replay reproduces the run.
    """

    def __init__(
        self, path: str | Path, header: TraceHeader, resume_after: int | None = None
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after is not None and self.path.is_file() and self.path.stat().st_size > 0:
            self._truncate_after(resume_after)
            self._fh: IO[str] = self.path.open("a", encoding="utf-8")
        else:
            previous = self._set_aside()
            if previous is not None:
                header = replace(header, meta={**header.meta, "previous_trace": previous.name})
            self._fh = self.path.open("w", encoding="utf-8")
            self._write(header.to_json())

    def _set_aside(self) -> Path | None:
        """Rename a non-empty trace at :attr:`path` to the first free numbered name."""
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return None
        n = 1
        while (kept := self.path.with_name(f"{self.path.stem}.{n}{self.path.suffix}")).exists():
            n += 1
        self.path.rename(kept)
        logger.warning(
            "gnmr: %s already held a trace (an earlier run, or a restart whose GNMR state "
            "started fresh); it is kept as %s and this run's trace starts anew",
            self.path,
            kept,
        )
        return kept

    def _truncate_after(self, step: int) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = lines[:1] + [x for x in lines[1:] if x.strip() and json.loads(x)["step"] <= step]
        self.path.write_text("".join(kept), encoding="utf-8")

    def _write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def write(
        self,
        norms: torch.Tensor,
        decision: Decision,
        extra: Mapping[str, Any] | None = None,
        probe: ProbeRecord | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the norms (and error scores) the controller saw at ``decision.step``, what it
        chose and, on a probe step, the probe's measurements (``probe.step`` must match).
        ``fields``: further top-level fields (the accounting's ``nonfinite``,
        ``skipped_nonfinite`` and ``first_nonfinite``), which may not replace one of these."""
        record: dict[str, Any] = {
            "step": decision.step,
            "norms": norms.double().cpu().tolist(),
            "active": list(decision.active),
            "telemetry": decision.telemetry.as_dict(),
            "extra": dict(extra or {}),
        }
        if decision.error is not None:
            record["errors"] = decision.error.tolist()
        if probe is not None:
            if probe.step != decision.step:
                raise ValueError(
                    f"probe of step {probe.step} written with the decision of {decision.step}"
                )
            record["probe"] = probe.to_json()
        clash = sorted(set(fields or {}) & set(record))
        if clash:
            raise ValueError(f"trace fields {clash} would replace the record's own")
        record.update(fields or {})
        self._write(record)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TraceReader:
    """Reads a trace: ``.header`` then iterate over the step records."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open(encoding="utf-8") as fh:
            first = fh.readline()
        self.header = self._parse_header(first)

    def _parse_header(self, line: str) -> TraceHeader:
        try:
            head = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{self.path}: line 1 is not JSON ({err}); is this a gnmr trace?"
            ) from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise ValueError(f"{self.path}: not a gnmr trace (line 1 lacks format={FORMAT!r})")
        if head.get("version") != VERSION:
            raise ValueError(
                f"{self.path}: trace version {head.get('version')!r}, expected {VERSION}"
            )
        return TraceHeader(
            units=tuple(head["units"]),
            eligible=tuple(head["eligible"]),
            config=GNMRConfig.from_dict(head["config"]),
            meta=head.get("meta", {}),
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self.path.open(encoding="utf-8") as fh:
            fh.readline()
            for lineno, line in enumerate(fh, start=2):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(
                        f"{self.path}:{lineno}: truncated or corrupted record"
                    ) from None


def read_trace(path: str | Path) -> tuple[TraceHeader, torch.Tensor, list[dict[str, Any]]]:
    """The header, a float64 ``[steps, U]`` tensor of norms and the raw step records."""
    reader = TraceReader(path)
    records = list(reader)
    u = len(reader.header.units)
    steps = [r["step"] for r in records]
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"{path}: steps are not 1, 2, 3, ... (a step is missing or repeated)")
    return reader.header, _matrix(path, records, "norms", "a norms", u), records


def _matrix(
    path: str | Path, records: Sequence[Mapping[str, Any]], key: str, what: str, u: int
) -> torch.Tensor:
    """float64 ``[steps, U]`` of one per-unit vector of every record, lengths checked."""
    bad = [r["step"] for r in records if len(r[key]) != u]
    if bad:
        raise ValueError(f"{path}: steps {bad[:5]} have {what} vector of the wrong length (U={u})")
    rows: Sequence[Sequence[float]] = [r[key] for r in records]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(records), u)


def _in_all_or_none(
    path: str | Path, records: Sequence[Mapping[str, Any]], key: str, what: str
) -> bool:
    """Whether the records carry ``key`` (``what`` in messages): ``True`` when every one does,
    ``False`` when none does (or there are none), ``ValueError`` naming the first five steps
    without it when only some do."""
    have = sum(key in r for r in records)
    if have == 0:
        return False
    if have < len(records):
        missing = [r["step"] for r in records if key not in r][:5]
        raise ValueError(f"{path}: steps {missing} have no {what} while others do")
    return True


def read_errors(
    path: str | Path, records: Sequence[Mapping[str, Any]], units: int
) -> torch.Tensor | None:
    """float64 ``[steps, U]`` of the recorded error scores, or ``None`` when no record has them.

    Raises ``ValueError`` when only some records carry them or a vector has the wrong length.
    """
    if not _in_all_or_none(path, records, "errors", "error scores"):
        return None
    return _matrix(path, records, "errors", "an errors", units)


def read_probes(
    path: str | Path, records: Sequence[Mapping[str, Any]], units: int
) -> list[ProbeRecord]:
    """The probe steps' :class:`ProbeRecord` in step order (empty for a trace without probes).

    Raises ``ValueError`` for a probe object that lacks a key or has a vector of the wrong
    length.
    """
    return [
        ProbeRecord.from_json(int(r["step"]), r["probe"], units, str(path))
        for r in records
        if r.get("probe") is not None
    ]


def read_lrs(path: str | Path, records: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """Each record's ``lr`` (the learning rate the optimizer applied at the step, which the
    lr_decay clock reads), or ``None`` when no record has one; ``ValueError`` when only some
    do."""
    if not _in_all_or_none(path, records, "lr", "learning rate"):
        return None
    return [float(r["lr"]) for r in records]


def read_accounting(header: TraceHeader, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's accounting as its trace tells it, independently of the controller: per unit,
    the recorded steps it ran recovered (in the previous record's ``active``) and per GEMM of
    the header's ``gemms``, the steps its recorded norm was non-finite plus those of skipped
    attempts (``skipped_nonfinite``), and the ``first_nonfinite`` records. A run resumed with a
    tighter policy ran a conformed plan, which the records do not hold: there the counts are
    those of the decided plans."""
    u = len(header.units)
    recovered = [0] * u
    nonfinite = [0] * u
    firsts = []
    previous: Sequence[int] = ()
    for r in records:
        for unit in previous:
            recovered[unit] += 1
        previous = r["active"]
        for unit, norm in enumerate(r["norms"]):
            nonfinite[unit] += not math.isfinite(norm)
        for unit in r.get("skipped_nonfinite", ()):
            nonfinite[unit] += 1
        if "first_nonfinite" in r:
            firsts.append(dict(r["first_nonfinite"]))
    gemms = list(header.meta.get("gemms", GEMM_NAMES))
    return {
        "recovered": recovered,
        "recovered_gemms": {g: recovered if g in gemms else [0] * u for g in GEMM_NAMES},
        "nonfinite": nonfinite,
        "first_nonfinite": firsts,
    }
