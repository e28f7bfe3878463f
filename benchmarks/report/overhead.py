"""RESULTS.md's overhead section: ``python -m benchmarks.overhead``'s parts (a)-(c), read from
``results/overhead.json``, and its error-term run, ``results/overhead_error.json``."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.recipes import ERROR_TARGET
from benchmarks.overhead.tables import collectives_table, monitor_table
from benchmarks.results_md.source import Source
from benchmarks.results_md.words import bash, listing, ordinal, paragraph, span

CLI = ".venv/bin/python -m benchmarks.overhead"


def render(src: Source) -> list[str]:
    main, error = src.json("overhead"), src.json("overhead_error")
    return [
        "## Overhead: GNMR vs the same low-cost path without it",
        commands(main, error),
        *error_term(src, error),
        *step_time(main),
        *monitor(main),
        *collectives(main),
    ]


def _steps(run: dict[str, Any]) -> int:
    return next(iter(run["step_time"].values()))[0]["steps"]


def commands(main: dict[str, Any], error: dict[str, Any]) -> str:
    return bash(
        f"{CLI}          # {main['date']}",
        f"{CLI} --parts a --local-only --steps {_steps(error)} \\",
        f"    --out benchmarks/results/overhead_error.json  # {error['date']}: the error term",
    )


def _arm(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(a for a in rows if a["arm"] == name)


def _ratio(a: dict[str, Any]) -> str:
    lo, hi = a["cpu_iqr"]
    return f"{a['cpu_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"


def _met(x: float, target: float) -> str:
    return "met" if x <= target else "missed"


def error_term(src: Source, run: dict[str, Any]) -> list[str]:
    """The error term's cost (issue 13): GNMR, GNMR+e every step and every n-th step."""
    b = run["budget"]
    rows = run["step_time"]
    arms = [f"gnmr k={b}", f"gnmr+e k={b}"]
    sparse = next(a["arm"] for a in next(iter(rows.values())) if a["arm"].startswith("gnmr+e/"))
    every = int(sparse.split("/")[1].split()[0])
    arms.append(sparse)
    head = [f"`{arms[0]}`", f"`{arms[1]}` (`error_every` 1)", f"`{sparse}` (`error_every` {every})"]
    lines = ["| backend | " + " | ".join(head) + " |", "| --- | --- | --- | --- |"]
    for where, arm_rows in rows.items():
        backend = where.split(" / ")[0]
        lines.append(f"| {backend} | " + " | ".join(_ratio(_arm(arm_rows, a)) for a in arms) + " |")
    backends = [w.split(" / ")[0] for w in rows]
    dense = [_arm(r, arms[1])["cpu_ratio"] for r in rows.values()]
    thin = [_arm(r, sparse)["cpu_ratio"] for r in rows.values()]
    plain = [_arm(r, arms[0])["cpu_ratio"] for r in rows.values()]
    fp4_every = next(
        r["arm_spec"]["error_every"]
        for r in src.records("nvfp4").values()
        if r["arm"].startswith("GNMR+e")
    )
    return [
        paragraph(
            f"The error term (issue 13's target: GNMR with it <= {ERROR_TARGET} of the low-cost "
            f"path without GNMR), {_steps(run)} interleaved rounds per arm, one process, median of "
            "the per-round CPU-time ratios [IQR], on a quiet machine "
            "(`results/overhead_error.json`):",
        ),
        "\n".join(lines),
        paragraph(
            "Measuring the error sums every step costs "
            + listing([f"{100 * (x - 1):.1f}% ({n})" for x, n in zip(dense, backends, strict=True)])
            + " of a step of this small model, where the bandwidth-bound norms weigh most against "
            "tiny GEMMs: the target is "
            + ("met." if all(x <= ERROR_TARGET for x in dense) else "missed.")
            + f" With `error_every: {every}` it is "
            + listing([f"{x:.3f} ({_met(x, ERROR_TARGET)})" for x in thin])
            + " (the same run put GNMR without the term at "
            + listing([f"{x:.3f}" for x in plain])
            + f"). The FP4 sweeps above measure the term every {ordinal(fp4_every)} step.",
        ),
    ]


def step_time(run: dict[str, Any]) -> list[str]:
    """Part (a): step time against the low-cost path, and GNMR's own work inside the step."""
    b, units = run["budget"], run["collectives"]["units_registry"]
    lines = [
        "| backend / runtime | arm | CPU / low-cost [IQR] | monitor ms | controller ms | "
        "(mon + ctl) / low-cost |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    gnmr = [a for rows in run["step_time"].values() for a in rows if a["arm"].startswith("gnmr")]
    for where, rows in run["step_time"].items():
        for a in rows:
            own = (
                f"{a['monitor_ms']:.2f} | {a['controller_ms']:.2f} | {100 * a['own_fraction']:.2f}%"
                if a["arm"].startswith("gnmr")
                else "- | - | -"
            )
            lines.append(f"| {where} | {a['arm']} | {_ratio(a)} | {own} |")
    target = run["target"]
    verdicts = []
    for where, rows in run["step_time"].items():
        g = _arm(rows, f"gnmr k={b}")
        lo, hi = g["cpu_iqr"]
        own = g["own_fraction"]
        verdicts.append(
            f"- {where}: gnmr k={b} / low-cost = {g['cpu_ratio']:.3f} [IQR {lo:.3f}, {hi:.3f}] -> "
            f"{_met(g['cpu_ratio'], target)} (target <= {target}); GNMR's own work alone: 1 + "
            f"{own:.4f} -> {_met(1 + own, target)}"
        )
    ks = [_arm(rows, f"gnmr k={b}") for rows in run["step_time"].values()]
    all_met = all(g["cpu_ratio"] <= target for g in ks)
    iqr = statistics.median((g["cpu_iqr"][1] - g["cpu_iqr"][0]) / 2 for g in ks)
    return [
        paragraph(
            f"(a) Step time over {_steps(run)} interleaved rounds per arm ({run['threads']} "
            f"thread, the harness Llama, budget {b} of {units} units): the low-cost path alone, "
            "GNMR with `max_active=0` (monitor + controller only), GNMR with "
            f"{b} units, and {b} units fixed on the recovery path without GNMR (the recovery "
            "path's own cost), in one process (`GNMRRuntime`) and under DeepSpeed ZeRO-1 "
            "(`gnmr_dist.deepspeed.initialize` vs plain `deepspeed.initialize`). Ratios are of CPU "
            "time (the machine was shared; wall-clock ratios are in `results/overhead.json` beside "
            "them); monitor and controller are also timed inside the step.",
        ),
        "\n".join(lines),
        "\n".join(verdicts),
        paragraph(
            f"The median ratios {'meet' if all_met else 'do not all meet'} the <= {target} target "
            f"in all {len(ks)} set-ups, but the interquartile ranges (about +-{100 * iqr:.0f}% on "
            "this shared machine) are wider than the effect; the tighter figure is GNMR's own work "
            f"timed inside the step: monitor {span([a['monitor_ms'] for a in gnmr])} ms and "
            f"controller {span([a['controller_ms'] for a in gnmr])} ms per step, "
            f"{span([100 * a['own_fraction'] for a in gnmr], '.1f', '%')} of these (small, "
            "CPU-bound) steps. The controller is fixed Python work that does not grow with the "
            "model; on a GPU step of hundreds of milliseconds it is a smaller fraction still.",
        ),
    ]


def monitor(run: dict[str, Any]) -> list[str]:
    """Part (b): the monitor against ``clip_grad_norm_`` on the same gradients."""
    rows = run["monitor_vs_clip"]
    by = {(r["grads"], r["arm"]): r for r in rows}
    small, large = dict.fromkeys(r["grads"] for r in rows)
    fixed = by[(small, "monitor + controller")]["median_ms"] - by[(small, "monitor")]["median_ms"]
    share = by[(large, "monitor")]["ratio"]
    return [
        "(b) The monitor against `torch.nn.utils.clip_grad_norm_` on the same gradients:",
        monitor_table(rows),
        paragraph(
            "The monitor only reads the gradients (one fused `_foreach_norm` per dtype group, one "
            f"`index_add_`); clipping also scales them, so the monitor costs {share:.2f} of it on "
            f"the larger stack; on the tiny model the controller's fixed ~{fixed:.1f} ms "
            + (
                "dominates." if fixed > by[(small, "monitor")]["median_ms"] else "is about as much."
            ),
        ),
    ]


def collectives(run: dict[str, Any]) -> list[str]:
    """Part (c): the collectives of a step with GNMR on and off."""
    res = run["collectives"]
    world = len({r["rank"] for r in res["rows"]})
    return [
        paragraph(
            f"(c) Collectives per step, {world} processes over gloo, DeepSpeed ZeRO-"
            f"{res['spec']['stage']}, GNMR on vs off, counted by a wrapper around every "
            "`torch.distributed` collective and, independently, by the torch profiler's gloo "
            "events:",
        ),
        collectives_table(res)
        + f"\nextra = exactly one all_reduce of 8(U+1) = {res['expected_extra_bytes']} bytes on "
        f"every rank and step: {'yes' if res['ok'] else 'NO'}",
    ]
