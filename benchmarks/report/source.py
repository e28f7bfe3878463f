"""The result files RESULTS.md is rendered from: the JSON files in ``benchmarks/results/`` and the
branch records of every family of branch regimes (``benchmarks/results/fp4/*.jsonl``,
``benchmarks/results/faults/*.jsonl``), read once each, and the provenance each of them records
(:mod:`benchmarks.harness.provenance`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.branch_stats import Records, read_records
from benchmarks.harness.provenance import UNKNOWN

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""The committed result files (``benchmarks/results``)."""


class Source:
    """The result files under ``root``; ``json(name)`` and ``records(regime, family)`` cache what
    they read."""

    def __init__(self, root: Path = RESULTS) -> None:
        self.root = root
        self.json = cache(self._json)
        self.records = cache(self._records)

    def _json(self, name: str) -> dict[str, Any]:
        """``<root>/<name>.json``."""
        return json.loads((self.root / f"{name}.json").read_text())

    def _records(self, regime: str, family: str = "fp4") -> Records:
        """The branch records of a regime of ``family`` (``Regime.family``: ``fp4``, ``faults``)
        by (arm, seed, point), read as the sweep reads them
        (:func:`~benchmarks.harness.branch_stats.read_records`; no file: none)."""
        return read_records(self.root / family / f"{regime}.jsonl")

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
            return ""
        return f"![{alt}](results/{name})"

    def provenance(self, *names: str) -> str:
        """One list item per result file of ``names`` (``x.json``, ``<family>/<regime>.jsonl``) and
        distinct provenance: its commits (with how many records or runs each, where the file
        holds several) and what else the records say."""
        items = []
        for name in names:
            records = self._provenances(name)
            groups: dict[str, Counter[str]] = {}
            for p in records:
                groups.setdefault(describe(p), Counter())[_short(p.get("commit", UNKNOWN))] += 1
            for text, commits in groups.items():
                if len(records) == 1:
                    items.append(f"- `{name}`: commit {next(iter(commits))} {text}")
                else:
                    each = ", ".join(f"{c} ({n})" for c, n in commits.items())
                    items.append(
                        f"- `{name}`, {len(records)} {self._unit(name)}: commits {each} {text}"
                    )
        return "\n".join(items)

    def provenance_table(self, commands: dict[str, str]) -> str:
        """One row per result file of ``commands`` (file -> the command that wrote it, or ``-``):
        its records or runs, its commits with how many each, and what else they record."""
        rows = []
        for name, command in commands.items():
            records = self._provenances(name)
            groups: dict[str, Counter[str]] = {}
            for p in records:
                groups.setdefault(describe(p), Counter())[_short(p.get("commit", UNKNOWN))] += 1
            each = "; ".join(
                ", ".join(f"{c} ({n})" for c, n in commits.items()) + f" {text}"
                for text, commits in groups.items()
            )
            rows.append(f"| `{name}` | {command} | {len(records)} | {each} |")
        head = "| result file | command | records or runs | commits (how many) and provenance |"
        return "\n".join([head, "| --- | --- | --- | --- |", *rows])

    def _provenances(self, name: str) -> list[dict[str, Any]]:
        """The provenance of every record (``.jsonl``), run (a file of runs) or the file."""
        if name.endswith(".jsonl"):
            family, _, regime = name.removesuffix(".jsonl").rpartition("/")
            records = self.records(regime, family=family or "fp4")
            return [r.get("provenance", {}) for r in records.values()]
        data = self.json(name.removesuffix(".json"))
        return [r.get("provenance", {}) for r in data.get("runs", [data])]

    @staticmethod
    def _unit(name: str) -> str:
        return "records" if name.endswith(".jsonl") else "runs"


def _short(commit: str) -> str:
    """A commit hash cut to 10 characters (anything else as it is)."""
    return commit[:10] if commit != UNKNOWN else commit


def describe(p: dict[str, Any]) -> str:
    """A provenance record in words, after its commit: how the commit is known, whether the tree
    was edited, the versions and the host."""
    if not p:
        return "(no provenance recorded)"
    text = f"({p.get('commit_source', UNKNOWN)}"
    text += ", with uncommitted changes)" if p.get("dirty") is True else ")"
    v = p.get("versions", UNKNOWN)
    text += "; versions " + (
        ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else v
    )
    h = p.get("host", UNKNOWN)
    if isinstance(h, dict):
        h = f"{h['cpu']}, ISA {h['isa']}, {h['threads']} torch threads of {h['cores']} cores"
    return f"{text}; host {h}"
