"""The step-time sections (docs/benchmarks.md#overhead): the CPU-time ratios of GNMR's arms and of
the shadow route, and the error term's cost ``C`` (:mod:`benchmarks.harness.overhead_figures`)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import cost, overhead_figures
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.overhead_figures import amortized, interval
from benchmarks.harness.recipes import ERROR_TARGET
from benchmarks.report.source import Source

FILE = "overhead_error"
CLI = "python -m benchmarks.overhead"
REPLAY = "`python -m benchmarks.sweep.shadow_replay --demo-trace runs/demo_e/trace.jsonl`"
Run = dict[str, Any]


def error_cost(src: Source, backend: str) -> cost.ErrorCost | None:
    """``C`` for ``backend`` and where it was measured (``None`` without :data:`FILE`)."""
    run = src.json(FILE) if src.has(f"{FILE}.json") else None
    return overhead_figures.error_cost(run, backend, f"{FILE}.json")


def ratio(a: Run | None) -> str:
    """An arm's median CPU-time ratio to the low-cost path [interquartile range]."""
    return "-" if a is None else "{:.3f} [{:.3f}, {:.3f}]".format(a["cpu_ratio"], *a["cpu_iqr"])


def ratios(run: Run, name: str, target: float, timed: str, arms: list[str]) -> list[list[str]]:
    """A row per set-up: each arm's ratio, GNMR's own work, whether ``timed`` met ``target``."""
    rows = []
    for where, times in run["step_time"].items():
        by = {a["arm"]: a for a in times}
        g = by[f"gnmr k={run['budget']}"]
        own = f"{g['monitor_ms']:.2f} + {g['controller_ms']:.2f} ms ({g['own_fraction']:.2%})"
        met = f"{timed} <= {target}: " + ("met" if by[timed]["cpu_ratio"] <= target else "missed")
        rows.append([f"`{name}`, {where}", *(ratio(by.get(a)) for a in arms), own, met])
    return rows


def shadow_table(shadow: Run, replay: Run) -> str:
    """A row per recipe and per replayed run, a column per interval ``N`` (the template's words)."""
    every, rows = sorted({*shadow["intervals"], *replay["intervals"]}), []
    for recipe, arms in shadow["step_time"].items():
        by = {interval(a["arm"]): a for a in arms if a["arm"] != "low-cost"}
        cells = {n: f"{ratio(by[n])} -> {amortized(by[1]['cpu_ratio'], n):.4f}" for n in by if n}
        rows.append([recipe, f"{by[None]['cpu_ratio']:.3f}", *(cells.get(n, "-") for n in every)])
    for name, run in (("demo", replay["demo"]), (replay["fault"]["regime"], replay["fault"])):
        cells = {r["error_every"]: agreement(r) for r in run["rows"]}
        rows.append([name, "-", *(cells.get(n, "-") for n in every)])
    return markdown_table(["run", "GNMR without e", *(f"N = {n}" for n in every)], rows)


def agreement(r: Run) -> str:
    """A replay at one ``N``: its shares of identical active sets / of recovered unit-steps kept."""
    kept = r["recovered_unit_steps_kept"]
    return f"{r['identical_active_sets']:.3f} / " + ("-" if kept is None else f"{kept:.3f}")


def context(src: Source) -> dict[str, Any]:
    """The overhead and shadow sections' names: the runs, the tables, the figures and files."""
    main, error = src.json("overhead"), src.json(FILE)
    timed = (a["arm"] for r in (main, error) for t in r["step_time"].values() for a in t)
    arms = [a for a in dict.fromkeys(timed) if a != "low-cost"]
    rows = ratios(main, "overhead.json", main["target"], f"gnmr k={main['budget']}", arms)
    rows += ratios(error, f"{FILE}.json", ERROR_TARGET, f"gnmr+e k={error['budget']}", arms)
    head = ["run, set-up", *arms, "GNMR's own work (monitor + controller)", "target"]
    steps = [next(iter(r["step_time"].values()))[0]["steps"] for r in (main, error)]
    err = f"`{CLI} --parts a --local-only --steps {steps[1]} --out benchmarks/results/{FILE}.json`"
    gnmr_e = next(r for r in src.records("nvfp4").values() if r["arm"].startswith("GNMR+e"))
    shadow, replay = src.json("overhead_shadow"), src.json("shadow_replay")
    shadow_files = {"overhead_shadow.json": f"`{CLI}.shadow`", "shadow_replay.json": REPLAY}
    return {
        "overhead": {
            "main": main,
            "error": error,
            "table": markdown_table(head, rows),
            "steps": steps,
            "every": next(n for n in map(interval, arms) if n),  # the arm gnmr+e/N's N
            "ranks": len({r["rank"] for r in main["collectives"]["rows"]}),
            "monitors": [r for r in main["monitor_vs_clip"] if r["arm"] != "clip_grad_norm_"],
            "fp4_every": gnmr_e["arm_spec"]["error_every"],
            "files": src.provenance_table({"overhead.json": f"`{CLI}`", f"{FILE}.json": err}),
        },
        "shadow": shadow,
        "shadow_table": shadow_table(shadow, replay),
        "shadow_files": src.provenance_table(shadow_files),
    }
