"""The result files RESULTS.md is rendered from: the JSON files in ``benchmarks/results/`` and the
branch records in ``benchmarks/results/fp4/*.jsonl``, read once each, and the provenance each of
them records (:mod:`benchmarks.harness.provenance`)."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.branch_stats import Records, read_records
from benchmarks.report.words import listing

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""The committed result files (``benchmarks/results``)."""


class Source:
    """The result files under ``root``; ``json(name)`` and ``records(regime)`` cache what they
    read."""

    def __init__(self, root: Path = RESULTS) -> None:
        self.root = root
        self.json = cache(self._json)
        self.records = cache(self._records)

    def _json(self, name: str) -> dict[str, Any]:
        """``<root>/<name>.json``."""
        return json.loads((self.root / f"{name}.json").read_text())

    def _records(self, regime: str) -> Records:
        """The branch records of an FP4 regime by (arm, seed, point), read as the sweep reads
        them (:func:`~benchmarks.harness.branch_stats.read_records`)."""
        return read_records(self.root / "fp4" / f"{regime}.jsonl")

    def has(self, name: str) -> bool:
        """Whether ``<root>/<name>`` exists (a plot, an optional JSON file)."""
        return (self.root / name).exists()

    def image(self, alt: str, name: str) -> str:
        """The markdown of a plot in the results folder, or nothing when the file is missing."""
        if not self.has(name):
            logger.warning("%s is missing: its image is left out", name)
            return ""
        return f"![{alt}](results/{name})"

    def provenance(self, *names: str) -> str:
        """One list item per distinct provenance among the result files ``names`` (``x.json``;
        ``fp4/<regime>.jsonl`` counts its records; a file of runs, each run's)."""
        seen: dict[str, list[str]] = {}
        for name in names:
            for where, record in self._provenances(name):
                seen.setdefault(describe(record), []).append(where)
        return "\n".join(f"- {listing(w)}: {text}" for text, w in seen.items())

    def _provenances(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        if name.endswith(".jsonl"):
            regime = name.removeprefix("fp4/").removesuffix(".jsonl")
            records = list(self.records(regime).values())
            by: dict[str, tuple[int, dict[str, Any]]] = {}
            for r in records:
                p = r.get("provenance", {})
                n, _ = by.get(describe(p), (0, p))
                by[describe(p)] = (n + 1, p)
            return [(f"`{name}` ({n} of {len(records)} records)", p) for n, p in by.values()]
        data = self.json(name.removesuffix(".json"))
        if "runs" in data:
            runs = enumerate(data["runs"], 1)
            return [(f"`{name}` run {i}", r.get("provenance", {})) for i, r in runs]
        return [(f"`{name}`", data.get("provenance", {}))]


def describe(p: dict[str, Any]) -> str:
    """A provenance record in words: commit, dirty tree, versions, host."""
    if not p:
        return "no provenance recorded"
    commit = p.get("commit", "not recorded")
    text = f"commit {commit[:10]} ({p.get('commit_source', 'source not recorded')}"
    text += ", with uncommitted changes)" if p.get("dirty") is True else ")"
    v = p.get("versions", "not recorded")
    text += "; versions " + (
        ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else v
    )
    h = p.get("host", "not recorded")
    if isinstance(h, dict):
        text += (
            f"; host {h['cpu']}, ISA {h['isa']}, {h['threads']} torch threads of {h['cores']} cores"
        )
    else:
        text += f"; host {h}"
    return text
