"""The paper-experiment section (issue 8): the three experiments of :mod:`benchmarks.paper`
(``results/act_quant.json``, ``fp6_fp8.json``, ``lora_int8.json``), one seed each, a table row
each (set-ups: docs/benchmarks.md#paper-act_quant, #paper-fp6_fp8, #paper-lora_int8)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.paper_figures import figures
from benchmarks.harness.verdicts import PAPER_EXCEEDANCE, TIME_RATIO
from benchmarks.report.source import Source

EXPERIMENTS = ("act_quant", "fp6_fp8", "lora_int8")
REFERENCE = {"act_quant": "full", "fp6_fp8": "full", "lora_int8": "recovery"}
"""The policy of the arm each experiment's losses are relative to (as its command prints them)."""


def context(src: Source) -> dict[str, Any]:
    """The paper section's names: per experiment its :func:`.paper_figures.figures` (the table's
    row, worded in ``paper.md.j2``), the exceedance rates' range, the plots and the files."""
    runs = {n: src.json(n) for n in EXPERIMENTS}
    rates = [100 * a["exceedance_rate"] for r in runs.values() for a in r["results"]]
    return {
        "paper": {
            "experiments": [
                {"name": n, "date": r["date"], "steps": r["setup"]["steps"]}
                | figures(r, REFERENCE[n])
                for n, r in runs.items()
            ],
            "exceedance": (min(rates), max(rates)),
            "paper_rate": 100 * PAPER_EXCEEDANCE,
            "time_ratio": TIME_RATIO,
            "plots": [src.image(n, f"{n}.png") for n in EXPERIMENTS],
            "files": src.provenance_table(
                {f"{n}.json": f"`python -m benchmarks.paper.{n}`" for n in EXPERIMENTS}
            ),
        }
    }
