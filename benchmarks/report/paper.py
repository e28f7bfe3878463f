"""The paper-experiment section's data (issue 8): the three experiments of :mod:`benchmarks.paper`
(``results/act_quant.json``, ``fp6_fp8.json``, ``lora_int8.json``), one seed each, as one table:
a row per experiment with every arm's held-out loss against its reference arm, GNMR's recovery
and exceedance rates, its step time and the targets of issue 8 (docs/benchmarks.md#paper-act_quant,
#paper-fp6_fp8, #paper-lora_int8)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.verdicts import PAPER_EXCEEDANCE, TIME_RATIO, TOLERANCE
from benchmarks.report.source import Source

EXPERIMENTS = ("act_quant", "fp6_fp8", "lora_int8")
REFERENCE = {"act_quant": "full", "fp6_fp8": "full", "lora_int8": "recovery"}
"""The policy of the arm each experiment's losses are relative to (as its command prints them)."""
HEADER = ["experiment", "steps", "reference", "static paths", "GNMR (recovery, exceedance)"]
HEADER += ["first+last (recovery)", "ZClip (clipped steps)", "GNMR / low-cost step time"]
HEADER += ["low-cost worse than 1%", "GNMR within 1%", "the paper's claim"]


def row(name: str, r: dict[str, Any]) -> list[str]:
    """One experiment: each arm's held-out loss over the reference's, minus 1, and the targets."""
    by = {a["name"]: a for a in r["results"]}
    ctl = {a["name"]: a.get("controller") or {} for a in r["arms"]}
    first = {p: next(n for n, a in by.items() if a["policy"] == p) for p in ("gnmr", "zclip")}
    ref = next(n for n, a in by.items() if a["policy"] == REFERENCE[name])
    gnmr_low = next(a["low_cost"] for a in r["arms"] if a["name"] == first["gnmr"])
    low = next(
        a["name"] for a in r["arms"] if a["policy"] == "static" and a["low_cost"] == gnmr_low
    )

    def rel(n: str) -> float:
        return by[n]["heldout_loss"] / by[ref]["heldout_loss"] - 1

    def arms(policy: str, extra: str = "") -> str:
        cells = []
        for n, a in by.items():
            if a["policy"] == policy and ("alpha" in ctl[n]) == (extra == "tight"):
                e = f", {100 * a['exceedance_rate']:.2f}%" if policy == "gnmr" else ""
                cells.append(f"{n} {100 * rel(n):+.2f}% ({100 * a['recovery_rate']:.1f}%{e})")
        return "; ".join(cells)

    worse, within = rel(low) > TOLERANCE, abs(rel(first["gnmr"])) <= TOLERANCE
    ratio = by[first["gnmr"]]["step_ms"] / by[low]["step_ms"]
    statics = ", ".join(
        f"{n} {100 * rel(n):+.2f}%" for n, a in by.items() if a["policy"] in ("static", "recovery")
    )
    zclip = f"{100 * rel(first['zclip']):+.2f}% ({by[first['zclip']]['clipped_steps']})"
    claim = "not reproduced" if worse and not within else "reproduced" if worse else "not tested"
    return [
        f"{name} ({r['date']})",
        str(r["setup"]["steps"]),
        ref,
        statics,
        "; ".join(filter(None, (arms("gnmr"), arms("gnmr", "tight")))),
        arms("first_last"),
        zclip,
        f"{ratio:.3f} ({'met' if ratio <= TIME_RATIO else 'missed'})",
        "yes" if worse else "no",
        "met" if within else "missed",
        f"**{claim}**",
    ]


def context(src: Source) -> dict[str, Any]:
    """The paper section's names: its table, the exceedance rates, the plots and the files."""
    runs = {n: src.json(n) for n in EXPERIMENTS}
    rates = [100 * a["exceedance_rate"] for r in runs.values() for a in r["results"]]
    return {
        "paper": {
            "table": markdown_table(HEADER, [row(n, r) for n, r in runs.items()]),
            "exceedance": (min(rates), max(rates)),
            "paper_rate": 100 * PAPER_EXCEEDANCE,
            "time_ratio": TIME_RATIO,
            "plots": [src.image(n, f"{n}.png") for n in EXPERIMENTS],
            "files": src.provenance_table(
                {f"{n}.json": f"`python -m benchmarks.paper.{n}`" for n in EXPERIMENTS}
            ),
        }
    }
