"""The result files RESULTS.md is rendered from: the JSON files in ``benchmarks/results/`` and the
branch records in ``benchmarks/results/fp4/*.jsonl``, read once each."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.branch_stats import Records, read_records

logger = logging.getLogger("benchmarks.results_md")

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
