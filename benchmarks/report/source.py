"""The result files RESULTS.md is rendered from, and the provenance each records
(:mod:`benchmarks.harness.provenance`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.branch_stats import read_records
from benchmarks.harness.provenance import UNKNOWN
from benchmarks.report.words import table

logger = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parents[1] / "results"
HEAD = ("result file", "command", "records or runs", "commits (how many): provenance")


class Source:
    """The result files under ``root``, each read once: ``json(name)`` (``<name>.json``) and
    ``records(regime, family)`` (``<family>/<regime>.jsonl``'s branch records by (arm, seed, point)
    as the sweep reads them; none: {})."""

    def __init__(self, root: Path = RESULTS) -> None:
        self.root = root
        self.json = cache(lambda name: json.loads((root / f"{name}.json").read_text()))
        self.records = cache(lambda r, family="fp4": read_records(root / family / f"{r}.jsonl"))

    def regimes(self, family: str) -> list[str]:
        """The regimes of ``family`` with a records file, by name."""
        return sorted(p.stem for p in (self.root / family).glob("*.jsonl"))

    def has(self, name: str) -> bool:
        """Whether ``<root>/<name>`` exists (a plot, an optional JSON file)."""
        return (self.root / name).exists()

    def image(self, alt: str, name: str) -> str:
        """The markdown of a plot in the results folder, or nothing when the file is missing."""
        if not self.has(name):
            logger.warning("%s is missing: its image is left out", name)
        return f"![{alt}](results/{name})" if self.has(name) else ""

    def provenance_table(self, files: dict[str, str] | Sequence[str]) -> str:
        """A row per result file (``x.json``, ``<family>/<regime>.jsonl``; with a command column
        when ``files`` maps each to the command that wrote it): its records or runs, and per
        distinct provenance (:func:`describe`) its commits with how many records each."""
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
