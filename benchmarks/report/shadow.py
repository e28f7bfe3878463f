"""The shadow route's section: ``python -m benchmarks.overhead.shadow``'s step times
(``results/overhead_shadow.json``) and ``python -m benchmarks.sweep.shadow_replay``'s selection
agreement (``results/shadow_replay.json``) as one table, ``templates/shadow.md.j2`` around it."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.report.source import Source


def interval(name: str) -> int | None:
    """The ``error_every`` of an arm called ``gnmr+e/N k=...`` (``None`` for the others)."""
    return int(name.split("/")[1].split()[0]) if "+e/" in name else None


def table(shadow: dict[str, Any], replay: dict[str, Any] | None) -> str:
    """Per recipe: GNMR's CPU-time ratio without ``e``, and per interval ``N`` the ratio [IQR]
    and the every-step arm's extra cost amortized, ``1 + (r_1 - 1) / N``; per replayed run: per
    ``N`` the share of identical active sets / of recovered unit-steps kept."""
    runs = [(n, replay[k]) for k, n in (("demo", "demo"), ("fault", None)) if k in (replay or {})]
    runs = [(n or run["regime"], {r["error_every"]: r for r in run["rows"]}) for n, run in runs]
    timed = {interval(a["arm"]) for arms in shadow["step_time"].values() for a in arms}
    every = sorted(({*timed} | {n for _, by in runs for n in by}) - {None})
    rows = []
    for recipe, arms in shadow["step_time"].items():
        by = {interval(a["arm"]): a for a in arms if a["arm"] != "low-cost"}
        r1 = by[1]["cpu_ratio"]
        cells = [recipe, "CPU / low-cost [IQR] -> amortized", f"{by[None]['cpu_ratio']:.3f}"]
        for n in every:
            a = by.get(n)
            iqr = "[{:.3f}, {:.3f}]".format(*a["cpu_iqr"]) if a else ""
            cells.append(f"{a['cpu_ratio']:.3f} {iqr} -> {1 + (r1 - 1) / n:.4f}" if a else "-")
        rows.append(cells)
    for name, by_n in runs:
        cells = [name, "identical active sets / recovered unit-steps kept", "-"]
        for n in every:
            r = by_n.get(n)
            kept = r and r["recovered_unit_steps_kept"]
            kept = "-" if kept is None else f"{kept:.3f}"
            cells.append("-" if r is None else f"{r['identical_active_sets']:.3f} / {kept}")
        rows.append(cells)
    return markdown_table(["run", "figure", "GNMR without e", *(f"N = {n}" for n in every)], rows)


def context(src: Source) -> dict[str, Any]:
    """The section's names (``shadow`` ``None`` when its file is absent)."""
    shadow = src.json("overhead_shadow") if src.has("overhead_shadow.json") else None
    replay = src.json("shadow_replay") if src.has("shadow_replay.json") else None
    commands = {
        "overhead_shadow.json": "`python -m benchmarks.overhead.shadow`",
        "shadow_replay.json": "`python -m benchmarks.sweep.shadow_replay --demo-trace "
        "runs/demo_e/trace.jsonl`",
    }
    return {
        "shadow": shadow,
        "shadow_table": table(shadow, replay) if shadow else "",
        "shadow_files": src.provenance_table({n: c for n, c in commands.items() if src.has(n)}),
    }
