"""The overhead section's data: ``python -m benchmarks.overhead``'s parts (a)-(c)
(``results/overhead.json``) and its error-term run (``results/overhead_error.json``) as one table
of the step-time ratios with their interquartile ranges, a row per set-up, and the figures of the
monitor against clipping and of the collectives (docs/benchmarks.md#overhead)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.recipes import ERROR_TARGET
from benchmarks.report.error_cost import FILE
from benchmarks.report.shadow import interval
from benchmarks.report.source import Source

CLI = "python -m benchmarks.overhead"


def _ratio(a: dict[str, Any] | None) -> str:
    return "-" if a is None else "{:.3f} [{:.3f}, {:.3f}]".format(a["cpu_ratio"], *a["cpu_iqr"])


def arms(*runs: dict[str, Any]) -> list[str]:
    """The arms the runs timed against the low-cost path, in the order they name them."""
    every = (a["arm"] for r in runs for timed in r["step_time"].values() for a in timed)
    return [a for a in dict.fromkeys(every) if a != "low-cost"]


def rows(
    run: dict[str, Any], name: str, target: float, timed: str, columns: list[str]
) -> list[list[str]]:
    """A row per set-up of a run: each arm's CPU-time ratio [IQR], GNMR's own work (its arm at the
    run's ``budget``), the target met by ``timed``."""
    out = []
    for where, arms in run["step_time"].items():
        by = {a["arm"]: a for a in arms}
        g = by.get(f"gnmr k={run['budget']}", {})
        own = (
            f"{g['monitor_ms']:.2f} + {g['controller_ms']:.2f} ms ({100 * g['own_fraction']:.2f}%)"
        )
        met = "met" if by[timed]["cpu_ratio"] <= target else "missed"
        cells = [f"`{name}`, {where}", *(_ratio(by.get(a)) for a in columns)]
        out.append([*cells, own if "own_fraction" in g else "-", f"{timed} <= {target}: {met}"])
    return out


def context(src: Source) -> dict[str, Any]:
    """The overhead section's names: the ratios table, the monitor's and collectives' figures."""
    main, error = src.json("overhead"), src.json("overhead_error")
    columns = arms(main, error)
    fixed = next(a for a in columns if a.endswith("fixed on recovery"))
    every = next(a for a in columns if "+e/" in a).split(" k=")[0]
    header = ["run, set-up", *columns, "GNMR's own work (monitor + controller)", "target"]
    table = rows(main, "overhead.json", main["target"], f"gnmr k={main['budget']}", columns)
    timed = f"gnmr+e k={error['budget']}"
    table += rows(error, "overhead_error.json", ERROR_TARGET, timed, columns)
    clip = {(r["grads"], r["arm"]): r for r in main["monitor_vs_clip"]}
    col = main["collectives"]
    steps = [next(iter(r["step_time"].values()))[0]["steps"] for r in (main, error)]
    err = f"`{CLI} --parts a --local-only --steps {steps[1]} --out benchmarks/results/{FILE}.json`"
    return {
        "overhead": {
            "table": markdown_table(header, table),
            "steps": steps,
            "fixed": fixed,
            "every": (every, interval(every)),
            "dates": [main["date"], error["date"]],
            "clip": [
                (g, a, r["median_ms"], r["ratio"])
                for (g, a), r in clip.items()
                if a != "clip_grad_norm_"
            ],
            "ranks": len({r["rank"] for r in col["rows"]}),
            "col": col,
            "fp4_every": next(
                r["arm_spec"]["error_every"]
                for r in src.records("nvfp4").values()
                if r["arm"].startswith("GNMR+e")
            ),
            "files": src.provenance_table(
                {"overhead.json": f"`{CLI}`", "overhead_error.json": err}
            ),
        }
    }
