"""The overhead section's data: ``python -m benchmarks.overhead``'s parts (a)-(c), read from
``results/overhead.json``, and its error-term run, ``results/overhead_error.json``, as
``templates/overhead.md.j2`` reads them."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.recipes import ERROR_TARGET
from benchmarks.harness.tables import collectives_table, monitor_table
from benchmarks.report.source import Source


def arm(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The row of ``name`` among a set-up's arms."""
    return next(a for a in rows if a["arm"] == name)


def steps(run: dict[str, Any]) -> int:
    """The interleaved rounds per arm of a step-time run."""
    return next(iter(run["step_time"].values()))[0]["steps"]


def ratios(run: dict[str, Any], name: str) -> list[float]:
    """``name``'s CPU-time ratio in every set-up of a step-time run."""
    return [arm(rows, name)["cpu_ratio"] for rows in run["step_time"].values()]


def error_arms(run: dict[str, Any]) -> tuple[list[str], int]:
    """The error-term run's arms (GNMR, GNMR+e every step, GNMR+e every n-th) and that n."""
    b = run["budget"]
    first = next(iter(run["step_time"].values()))
    sparse = next(a["arm"] for a in first if a["arm"].startswith("gnmr+e/"))
    return [f"gnmr k={b}", f"gnmr+e k={b}", sparse], int(sparse.split("/")[1].split()[0])


def context(src: Source) -> dict[str, Any]:
    """The overhead section's names: both runs, the error term's arms, the FP4 sweeps' spacing."""
    main, error = src.json("overhead"), src.json("overhead_error")
    b = main["budget"]
    ks = [arm(rows, f"gnmr k={b}") for rows in main["step_time"].values()]
    gnmr = [a for rows in main["step_time"].values() for a in rows if a["arm"].startswith("gnmr")]
    small, large = dict.fromkeys(r["grads"] for r in main["monitor_vs_clip"])
    by = {(r["grads"], r["arm"]): r for r in main["monitor_vs_clip"]}
    return {
        "main": main,
        "error": error,
        "error_arms": error_arms(error),
        "ERROR_TARGET": ERROR_TARGET,
        "arm": arm,
        "steps": steps,
        "ratios": ratios,
        "gnmr_rows": gnmr,
        "own_pct": [100 * a["own_fraction"] for a in gnmr],
        "k_rows": ks,
        "iqr": statistics.median((g["cpu_iqr"][1] - g["cpu_iqr"][0]) / 2 for g in ks),
        "fixed_ms": by[(small, "monitor + controller")]["median_ms"]
        - by[(small, "monitor")]["median_ms"],
        "monitor_small_ms": by[(small, "monitor")]["median_ms"],
        "monitor_share": by[(large, "monitor")]["ratio"],
        "fp4_every": next(
            r["arm_spec"]["error_every"]
            for r in src.records("nvfp4").values()
            if r["arm"].startswith("GNMR+e")
        ),
        "monitor_table": monitor_table,
        "collectives_table": collectives_table,
    }
