"""JSON-lines trace of per-step norms and decisions, for offline analysis and replay.

Line 1 is a header, every further line one optimizer step::

    {"format": "gnmr-trace", "version": 1, "units": ["layers.0.q_proj", ...],
     "eligible": [true, ...], "config": {...GNMRConfig.to_dict()...}, "meta": {...}}
    {"step": 1, "norms": [0.12, ...], "active": [3], "telemetry": {...}, "extra": {"loss": 2.3}}

Norms are the exact per-unit global norms the controller received, so ``gnmr-replay`` can run the
same controller with other settings and reproduce, or re-tune, every decision. Non-finite norms
are written as JSON's ``NaN``/``Infinity`` tokens (Python's ``json`` reads them back).

With ``gnmr.gamma`` set (DESIGN.md section 2.1) a record also holds ``"errors"``: the error scores
``e_t(u)`` the controller scored (``Decision.error``, non-finite ones as ``Infinity``), which a
replay passes back (:func:`read_errors`). Records without the key are those of runs without the
term; the format version is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from gnmr_dist.core import Decision, GNMRConfig

__all__ = ["TraceHeader", "TraceReader", "TraceWriter", "read_errors", "read_trace"]

FORMAT = "gnmr-trace"
VERSION = 1


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


class TraceWriter:
    """Writes one line per decision to ``path``.

    A new run truncates the file and writes the header. A resumed run passes ``resume_after``
    (the last step the restored controller had decided): records after it, written by the
    interrupted run after its checkpoint, are dropped so every step appears once and a replay
    reproduces the run.
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
            self._fh = self.path.open("w", encoding="utf-8")
            self._write(header.to_json())

    def _truncate_after(self, step: int) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = lines[:1] + [x for x in lines[1:] if x.strip() and json.loads(x)["step"] <= step]
        self.path.write_text("".join(kept), encoding="utf-8")

    def _write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def write(
        self, norms: torch.Tensor, decision: Decision, extra: Mapping[str, Any] | None = None
    ) -> None:
        """Record the norms (and error scores) the controller saw at ``decision.step`` and what
        it chose."""
        record: dict[str, Any] = {
            "step": decision.step,
            "norms": norms.double().cpu().tolist(),
            "active": list(decision.active),
            "telemetry": decision.telemetry.as_dict(),
            "extra": dict(extra or {}),
        }
        if decision.error is not None:
            record["errors"] = decision.error.tolist()
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


def read_errors(
    path: str | Path, records: Sequence[Mapping[str, Any]], units: int
) -> torch.Tensor | None:
    """float64 ``[steps, U]`` of the recorded error scores, or ``None`` when no record has them.

    Raises ``ValueError`` when only some records carry them or a vector has the wrong length.
    """
    have = [r for r in records if "errors" in r]
    if not have:
        return None
    if len(have) != len(records):
        missing = [r["step"] for r in records if "errors" not in r][:5]
        raise ValueError(f"{path}: steps {missing} have no error scores while others do")
    return _matrix(path, records, "errors", "an errors", units)
