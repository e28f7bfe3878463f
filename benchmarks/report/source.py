"""The result files RESULTS.md is rendered from, and the provenance each records
(:mod:`benchmarks.harness.provenance`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.harness.branch_stats import Records, read_records
from benchmarks.harness.provenance import UNKNOWN
from benchmarks.report.words import table

logger = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parents[1] / "results"
T = TypeVar("T")
HEAD = ("result file", "command", "records or runs", "commits (how many): provenance")


class Source:
    """The result files under ``root``, each read once: ``json(name)``, ``records(regime, family)``
    (``<family>/<regime>.jsonl`` by (arm, seed, point); none: {}); :meth:`once`: built from them."""

    def __init__(self, root: Path = RESULTS) -> None:
        self.root, self.built = root, dict[str, Any]()
        self.json = cache(lambda name: json.loads((root / f"{name}.json").read_text()))
        self._read = cache(read_records)  # by path: the same file however a caller names it

    def records(self, regime: str, family: str = "fp4") -> Records:
        return self._read(self.root / family / f"{regime}.jsonl")

    def once(self, key: str, build: Callable[[], T]) -> T:
        """``build()`` the first time ``key`` is asked for, the same object after."""
        if key not in self.built:
            self.built[key] = build()
        return self.built[key]  # type: ignore[no-any-return]

    def regimes(self, family: str) -> list[str]:
        """The regimes of ``family`` with a records file, by name."""
        return sorted(p.stem for p in (self.root / family).glob("*.jsonl"))

    def has(self, name: str) -> bool:
        """Whether ``<root>/<name>`` exists (a plot, an optional JSON file)."""
        return (self.root / name).exists()

    def image(self, alt: str, name: str) -> str:
        """The markdown of a plot in the results folder, or nothing when the file is missing."""
        if self.has(name):
            return f"![{alt}](results/{name})"
        logger.warning("%s is missing: its image is left out", name)
        return ""

    def provenance_table(self, files: dict[str, str] | Sequence[str]) -> str:
        """A row per result file (with a command column when ``files`` maps each to its command):
        its records or runs, per distinct provenance (:func:`describe`) its commits (how many)."""
        rows = []
        for name, command in (files if isinstance(files, dict) else dict.fromkeys(files)).items():
            records = self.provenances(name)
            seen = Counter((describe(p), p.get("commit", UNKNOWN)) for p in records)
            groups: dict[str, list[str]] = {}  # per description, its commits (how many records)
            for (text, c), k in seen.items():
                groups.setdefault(text, []).append(f"{c if c == UNKNOWN else c[:10]} ({k})")
            each = " / ".join(f"{', '.join(cs)}: {t}" for t, cs in groups.items())
            cells = (f"`{name}`", command, str(len(records)), each)
            rows.append(dict(zip(HEAD, cells, strict=True)))
        return table(rows)

    def provenances(self, name: str) -> list[dict[str, Any]]:
        """The provenance of every record (``.jsonl``), run (a file of runs) or the file."""
        if name.endswith(".jsonl"):
            family, _, regime = name.removesuffix(".jsonl").rpartition("/")
            return [r.get("provenance", {}) for r in self.records(regime, family).values()]
        data = self.json(name.removesuffix(".json"))
        return [r.get("provenance", {}) for r in data.get("runs", [data])]


def describe(p: dict[str, Any]) -> str:
    """A provenance in words: how the commit is known, any uncommitted edit, versions, host."""
    if not p:
        return "no provenance recorded"
    v, h = p.get("versions", UNKNOWN), p.get("host", UNKNOWN)
    if isinstance(h, dict):
        h = f"{h['cpu']}, ISA {h['isa']}, {h['threads']} torch threads of {h['cores']} cores"
    versions = ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else v
    dirty = ", with uncommitted changes" if p.get("dirty") is True else ""
    return f"{p.get('commit_source', UNKNOWN)}{dirty}; versions {versions}; host {h}"
