"""The shadow route's section: ``python -m benchmarks.overhead.shadow``'s step times, read from
``results/overhead_shadow.json``, and ``python -m benchmarks.sweep.shadow_replay``'s selection
agreement, ``results/shadow_replay.json``, as ``templates/shadow.md.j2`` reads them."""

from __future__ import annotations

from typing import Any

from benchmarks.report.source import Source


def interval(name: str) -> int | None:
    """The ``error_every`` of an arm called ``gnmr+e/N k=...`` (``None`` for the others)."""
    return int(name.split("/")[1].split()[0]) if "+e/" in name else None


def amortized(arms: list[dict[str, Any]], name: str) -> float | None:
    """``1 + (r_1 - 1) / N`` of arm ``name`` (``None`` for an arm without an interval)."""
    n = interval(name)
    if n is None:
        return None
    every = next(a["cpu_ratio"] for a in arms if interval(a["arm"]) == 1)
    return 1 + (every - 1) / n


def replay_rows(replay: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(run name, row) of every replayed run: the demo when recorded, then the fault regime."""
    runs = [("demo", replay["demo"])] if "demo" in replay else []
    runs.append((replay["fault"]["regime"], replay["fault"]))
    return [(name, row) for name, run in runs for row in run["rows"]]


def context(src: Source) -> dict[str, Any]:
    """The section's names: both runs (``None`` when a file is absent) and the helpers."""
    shadow = src.json("overhead_shadow") if src.has("overhead_shadow.json") else None
    replay = src.json("shadow_replay") if src.has("shadow_replay.json") else None
    files = [n for n in ("overhead_shadow.json", "shadow_replay.json") if src.has(n)]
    return {
        "shadow": shadow,
        "shadow_replay": replay,
        "shadow_files": files,
        "amortized": amortized,
        "replay_rows": replay_rows,
    }
