"""The result files RESULTS.md is rendered from: the JSON files in ``benchmarks/results/`` and the
branch records of every family of branch regimes (``benchmarks/results/fp4/*.jsonl``,
``benchmarks/results/faults/*.jsonl``), read once each, and the provenance each of them records
(:mod:`benchmarks.harness.provenance`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.branch_stats import Records, read_records
from benchmarks.harness.markdown import markdown_table
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

    def groups(self, name: str) -> tuple[int, dict[str, Counter[str]]]:
        """(records or runs, per distinct provenance in words (:func:`describe`) its commits with
        how many records each) of the result file ``name`` (``x.json``, ``<family>/<r>.jsonl``)."""
        records, out = self._provenances(name), {}
        for p in records:
            out.setdefault(describe(p), Counter())[_short(p.get("commit", UNKNOWN))] += 1
        return len(records), out

    def provenance_table(self, commands: dict[str, str]) -> str:
        """One row per result file of ``commands`` (file -> the command that wrote it, or ``-``):
        its records or runs, its commits with how many each, and what else they record."""
        rows = []
        for name, command in commands.items():
            n, groups = self.groups(name)
            each = "; ".join(
                ", ".join(f"{c} ({k})" for c, k in commits.items()) + f" {text}"
                for text, commits in groups.items()
            )
            rows.append([f"`{name}`", command, str(n), each])
        head = ["result file", "command", "records or runs", "commits (how many) and provenance"]
        return markdown_table(head, rows)

    def records_table(self, names: Sequence[str]) -> str:
        """One row per records file: its records, and per distinct provenance its commits (with
        how many records each): how the commit, the versions and the host are recorded."""
        rows = []
        for name in names:
            n, groups = self.groups(name)
            each = [
                f"{', '.join(f'{c} ({k})' for c, k in commits.items())}: "
                + text.lstrip("(").replace(")", "", 1)
                for text, commits in groups.items()
            ]
            rows.append([f"`{name}`", str(n), " / ".join(each)])
        return markdown_table(["records file", "records", "commits: provenance"], rows)

    def _provenances(self, name: str) -> list[dict[str, Any]]:
        """The provenance of every record (``.jsonl``), run (a file of runs) or the file."""
        if name.endswith(".jsonl"):
            family, _, regime = name.removesuffix(".jsonl").rpartition("/")
            records = self.records(regime, family=family or "fp4")
            return [r.get("provenance", {}) for r in records.values()]
        data = self.json(name.removesuffix(".json"))
        return [r.get("provenance", {}) for r in data.get("runs", [data])]


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
