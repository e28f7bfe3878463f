"""Selection policies against controls: budget sweeps over seeds, with intervals (issue 13).

    python -m benchmarks.sweep --regime act_quant [--seeds 1234,7,42] [--budgets 1,3,7,14]
        [--steps N] [--jobs 2] [--arms substring,...] [--fresh]

For one regime (:mod:`benchmarks.regimes`), every arm below trains the harness's Llama (28
projection units) from the same initial weights on the same batches, once per seed:

- ``low-cost`` / ``recovery``: the backend's static paths (every unit, every step);
- ``first+last``: Megatron's static recipe, 14 of 28 units (the first and the last layer);
- at every budget ``k``: ``random k`` (k eligible units re-drawn each step), ``GNMR k`` (the
  seed's controller, DESIGN.md section 2), ``GNMR+e k`` (with section 2.1's error term) and
  ``oracle k`` (the k largest measured gradient gaps of the step itself: the upper bound).

Each (arm, seed) is one job, run in a pool of ``--jobs`` processes (one torch thread each) and
written to ``results/sweep/<regime>/<arm>__<seed>.json`` as soon as it ends, so an interrupted
sweep resumes where it stopped (``--fresh`` starts over). The command then prints, per arm, the
mean held-out loss over seeds with a 95% Student-t interval, the share of the static gap
(``low-cost - recovery``) the arm closes, and, for every budgeted arm, the paired difference to
``random k`` at the same budget (same seed: same weights, batches and order) with its interval;
a verdict per budget says whether a policy beats random-k (and, at k = 14, first+last) by more
than that interval. Selection quality (precision@k of the risk, of each error score and of the
active set against the measured gaps) comes from the probe every ``PROBE_EVERY`` steps on the
``low-cost``, ``GNMR`` and ``GNMR+e`` arms. Everything lands in ``results/sweep_<regime>.json``
and a plot of quality against budget, one curve per policy, in ``results/sweep_<regime>.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, Arm, Batches, Setup, run_arm, summarize_probes
from benchmarks.regimes import REGIMES, Regime

logger = logging.getLogger("benchmarks.sweep")

SEEDS = (1234, 7, 42)
BUDGETS = (1, 3, 7, 14)
PROBE_EVERY = 10
POLICY_PREFIXES = ("random", "GNMR", "GNMR+e", "oracle")

# two-sided 95% Student-t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
        18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def make_arms(regime: Regime, budgets: Sequence[int]) -> list[Arm]:
    """The controls and the budgeted policies of one regime (see the module docstring)."""
    q = regime.backend_args()
    probed = {"probe_every": PROBE_EVERY, "probe_steps": fault_probe_steps(regime)}
    arms = [
        Arm("low-cost", "static", **probed, **q),
        Arm("recovery", "recovery", **q),
        Arm("first+last", "first_last", **q),
    ]
    for k in budgets:
        arms += [
            Arm(f"random {k}", "random", max_active=k, **q),
            Arm(f"GNMR {k}", "gnmr", max_active=k, **probed, **q),
            Arm(
                f"GNMR+e {k}", "gnmr", max_active=k, controller=regime.error_policy(), **probed, **q
            ),
            Arm(f"oracle {k}", "oracle", max_active=k, **q),
        ]
    return arms


def fault_probe_steps(regime: Regime) -> tuple[int, ...]:
    """About 10 probe steps inside every fault window (every step of a short one), so that the
    figures during the faults rest on more than the one or two regular probes they hold."""
    steps: set[int] = set()
    for f in regime.setup.faults:
        steps.update(range(f.start, f.stop, max(1, (f.stop - f.start) // 10)))
    return tuple(sorted(steps))


# ====================================================================== running


def _job_path(regime: str, arm: str, seed: int) -> Path:
    safe = arm.replace(" ", "_").replace("+", "p")
    return RESULTS / "sweep" / regime / f"{safe}__{seed}.json"


def _run_job(payload: tuple[str, dict[str, Any], dict[str, Any], int]) -> str:
    """One (arm, seed) in a worker process; returns the path it wrote."""
    import torch

    torch.set_num_threads(1)
    regime_name, setup_d, arm_d, seed = payload
    setup = _setup_from(setup_d, seed)
    arm = Arm(**arm_d)
    t0 = time.perf_counter()
    result = run_arm(setup, arm, Batches(setup.data, setup), Batches(setup.heldout, setup))
    record = asdict(result)
    record.update(seed=seed, wall_s=time.perf_counter() - t0)
    path = _job_path(regime_name, arm.name, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return str(path)


def _setup_from(setup_d: dict[str, Any], seed: int) -> Setup:
    from benchmarks.harness import Fault

    d = dict(setup_d)
    d["faults"] = tuple(Fault(**f) for f in d.get("faults", ()))
    return replace(Setup(**d), seed=seed)


def run_sweep(
    regime: Regime, seeds: Sequence[int], budgets: Sequence[int], jobs: int, fresh: bool,
    arm_filter: Sequence[str] = (),
) -> dict[tuple[str, int], dict[str, Any]]:  # fmt: skip
    """Run (or resume) every (arm, seed) job; return the records by (arm name, seed)."""
    arms = make_arms(regime, budgets)
    if arm_filter:
        arms = [a for a in arms if any(f in a.name for f in arm_filter)]
    setup_d = asdict(regime.setup)
    todo = []
    for arm in arms:
        for seed in seeds:
            path = _job_path(regime.name, arm.name, seed)
            if fresh and path.exists():
                path.unlink()
            if not path.exists():
                todo.append((regime.name, setup_d, asdict(arm), seed))
    logger.info("%s: %d arms x %d seeds, %d jobs to run", regime.name, len(arms), len(seeds),
                len(todo))  # fmt: skip
    t0 = time.perf_counter()
    if todo:
        # the oracle arms cost ~4 steps per step: start them first so the pool ends together
        todo.sort(key=lambda t: t[2]["policy"] != "oracle")
        with mp.get_context("spawn").Pool(jobs) as pool:
            for i, path in enumerate(pool.imap_unordered(_run_job, todo), 1):
                logger.info("[%d/%d] %s (%.0f s)", i, len(todo), path, time.perf_counter() - t0)
    records = {}
    for arm in arms:
        for seed in seeds:
            records[(arm.name, seed)] = json.loads(
                _job_path(regime.name, arm.name, seed).read_text()
            )
    return records


# ====================================================================== statistics


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95% Student-t interval (NaN for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    df = len(values) - 1
    t = _T95[max(d for d in _T95 if d <= df)]  # a df between entries takes the lower (wider)
    return m, t * statistics.stdev(values) / math.sqrt(len(values))


def summarize(
    records: dict[tuple[str, int], dict[str, Any]],
    seeds: Sequence[int],
    windows: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """Per arm: held-out loss, paired difference to low-cost, share of the static gap closed
    (only where the static gap is resolved), paired difference to random-k, selection figures
    (and the same figures inside each fault window).

    The share closed is ``(mean low-cost - mean arm) / (mean low-cost - mean recovery)``, given
    only when the paired interval of ``low-cost - recovery`` excludes 0: a ratio over a gap that
    changes sign between seeds means nothing (:func:`static_gap` says which case it is).
    """
    names = list(dict.fromkeys(name for name, _ in records))
    loss = {n: [records[(n, s)]["heldout_loss"] for s in seeds] for n in names}
    static = static_gap(records, seeds)
    resolved = static is not None and static[0] - static[1] > 0
    out: dict[str, Any] = {}
    for n in names:
        row: dict[str, Any] = {"loss": interval(loss[n]), "per_seed": loss[n]}
        if static is not None:
            low = statistics.fmean(loss["low-cost"])
            row["vs_low_cost"] = _paired(loss[n], loss["low-cost"])
            row["closed"] = (low - row["loss"][0]) / static[0] if resolved else None
        k = _budget_of(n)
        if k is not None and not n.startswith("random") and f"random {k}" in loss:
            row["vs_random"] = _paired(loss[n], loss[f"random {k}"])
        if k == 14 and "first+last" in loss:
            row["vs_first_last"] = _paired(loss[n], loss["first+last"])
        row["recovery_rate"] = statistics.fmean(records[(n, s)]["recovery_rate"] for s in seeds)
        costs = [r["probe_ms"] / r["step_ms"] for s in seeds if (r := records[(n, s)])["probe_ms"]]
        row["probe_cost"] = statistics.fmean(costs) if costs else None
        row["selection"] = _selection(records, n, seeds)
        row["selection_fault"] = {
            f"{a}-{b - 1}": _selection(records, n, seeds, (a, b)) for a, b in windows
        }
        out[n] = row
    return out


def static_gap(
    records: dict[tuple[str, int], dict[str, Any]], seeds: Sequence[int]
) -> tuple[float, float] | None:
    """Paired ``low-cost - recovery`` held-out loss (mean, 95% half-width); ``None`` without
    both static arms. Resolved when ``mean - half > 0``."""
    if not all(("low-cost", s) in records and ("recovery", s) in records for s in seeds):
        return None
    loss = lambda n: [records[(n, s)]["heldout_loss"] for s in seeds]  # noqa: E731
    return _paired(loss("low-cost"), loss("recovery"))


def _paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% half-width of the per-seed differences ``a - b`` (same seeds, same order)."""
    return interval([x - y for x, y in zip(a, b, strict=True)])


def _budget_of(name: str) -> int | None:
    head, _, tail = name.rpartition(" ")
    return int(tail) if head in POLICY_PREFIXES and tail.isdigit() else None


def _selection(
    records: dict[tuple[str, int], dict[str, Any]],
    name: str,
    seeds: Sequence[int],
    window: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Per graded set: seed means (interval over seeds) of precision and share vs both gaps,
    over every probe step or over those in ``window`` (``start <= step < stop``)."""
    per_seed: dict[str, dict[str, list[float]]] = {}
    for s in seeds:
        record = records[(name, s)]
        summary = record.get("probe_summary") or {}
        if window is not None:
            inside = [p for p in record["probes"] if window[0] <= p["step"] < window[1]]
            summary = summarize_probes(inside)
        for set_name, figs in summary.items():
            for key, value in figs.items():
                if not math.isnan(value):
                    per_seed.setdefault(set_name, {}).setdefault(key, []).append(value)
    return {sn: {k: interval(v) for k, v in figs.items()} for sn, figs in per_seed.items()}


def verdicts(summary: dict[str, Any], budgets: Sequence[int]) -> list[str]:
    """Per budget: which policies beat random-k (and first+last at 14) by more than the interval."""
    lines = []
    for k in budgets:
        wins, ties = [], []
        for policy in ("GNMR", "GNMR+e", "oracle"):
            row = summary.get(f"{policy} {k}")
            if row is None:
                continue
            if "vs_random" not in row:
                continue
            m, h = row["vs_random"]
            (wins if m + h < 0 else ties).append(f"{policy} {m:+.4f} +- {h:.4f}")
        text = f"k={k}: beats random-k: {', '.join(wins) or 'none'}"
        text += f"; not better than random-k: {', '.join(ties) or 'none'}"
        if k == 14:
            fl = [f"{p} {summary[f'{p} 14']['vs_first_last'][0]:+.4f} +- "
                  f"{summary[f'{p} 14']['vs_first_last'][1]:.4f}"
                  for p in ("GNMR", "GNMR+e", "oracle", "random")
                  if f"{p} 14" in summary and "vs_first_last" in summary[f"{p} 14"]]  # fmt: skip
            text += f"; vs first+last: {', '.join(fl)}"
        lines.append(text)
    return lines


# ====================================================================== output


def _pm(pair: Sequence[float] | None, digits: int = 4) -> str:
    return "-" if pair is None else f"{pair[0]:+.{digits}f} +- {pair[1]:.{digits}f}"


def table(summary: dict[str, Any]) -> str:
    rows = ["| arm | held-out loss (95% CI) | vs low-cost (paired) | share of static gap closed "
            "| vs random-k (paired) | recovery |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, row in summary.items():
        m, h = row["loss"]
        closed = row.get("closed")
        shut = "n/a" if closed is None else f"{closed:+.2f}"
        cells = [f"{m:.4f} +- {h:.4f}", _pm(row.get("vs_low_cost")), shut,
                 _pm(row.get("vs_random")), f"{100 * row['recovery_rate']:.1f}%"]  # fmt: skip
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


SELECTION_SETS = (
    "risk_topk", "error_bound_topk", "error_global_topk", "error_relative_topk", "error_adam_topk",
    "active", "decided", "random", "first_last", "oracle_grad", "oracle_update",
)  # fmt: skip
FIGURES = ("precision_grad", "precision_update", "share_grad", "share_update")


def selection_table(summary: dict[str, Any], arms: Sequence[str], window: str = "") -> str:
    """Selection figures of ``arms`` over every probe step, or inside the fault ``window``."""
    rows = ["| arm | set | precision vs grad gap | vs update gap | share of grad gap^2 | "
            "share of update gap^2 |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for arm in arms:
        row = summary.get(arm, {})
        sel = row.get("selection_fault", {}).get(window, {}) if window else row.get("selection", {})
        for set_name in SELECTION_SETS:
            f = sel.get(set_name)
            if not f:
                continue
            cells = [f"{f[k][0]:.2f} +- {f[k][1]:.2f}" if k in f else "-" for k in FIGURES]
            rows.append(f"| {arm} | {set_name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


COMPACT_ROWS = (
    ("seed GNMR's risk, top-3 (static low-cost arm)", "low-cost", "risk_topk"),
    ("error score e = B / G, top-3 (static low-cost arm)", "low-cost", "error_global_topk"),
    ("B scaled as Adam scales it, top-3 (static low-cost arm)", "low-cost", "error_adam_topk"),
    ("3 random units (static low-cost arm)", "low-cost", "random"),
    ("GNMR 3: the set that ran recovery", "GNMR 3", "active"),
    ("GNMR+e 3: its risk, top-3", "GNMR+e 3", "risk_topk"),
    ("GNMR+e 3: the set that ran recovery", "GNMR+e 3", "active"),
    ("oracle by gradient gap, top-3", "low-cost", "oracle_grad"),
    ("oracle by update gap, top-3", "low-cost", "oracle_update"),
)


def compact_selection(summary: dict[str, Any], window: str = "") -> str:
    """The README's selection table: the k = 3 signals and sets against both measured gaps."""
    rows = ["| signal or set | precision@3 vs gradient gap | vs update gap | share of the "
            "gradient gap^2 it covers |", "| --- | --- | --- | --- |"]  # fmt: skip
    for label, arm, set_name in COMPACT_ROWS:
        row = summary.get(arm, {})
        sel = row.get("selection_fault", {}).get(window, {}) if window else row.get("selection", {})
        f = sel.get(set_name)
        if not f:
            continue
        cells = [_pm(f.get(k), 2) for k in ("precision_grad", "precision_update", "share_grad")]
        rows.append(f"| {label} | " + " | ".join(c.lstrip("+") for c in cells) + " |")
    return "\n".join(rows)


def plot(regime: str, summary: dict[str, Any], budgets: Sequence[int], path: Path) -> None:
    """Quality against budget, one curve per policy: held-out loss minus the static low-cost
    arm's, paired by seed (mean and 95% interval of the per-seed differences: the spread
    between seeds' trajectories is left out, as the verdicts leave it out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def point(name: str) -> tuple[float, float]:
        m, h = summary[name]["vs_low_cost"]
        return m, 0.0 if math.isnan(h) else h

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for offset, (policy, marker) in enumerate(zip(POLICY_PREFIXES, "osD^", strict=True)):
        ks = [k for k in budgets if f"{policy} {k}" in summary]
        if not ks or "vs_low_cost" not in summary[f"{policy} {ks[0]}"]:
            continue
        pts = [point(f"{policy} {k}") for k in ks]
        xs = [k * 1.04 ** (offset - 1.5) for k in ks]  # side by side, not on top of each other
        ax.errorbar(xs, [m for m, _ in pts], yerr=[h for _, h in pts], marker=marker,
                    capsize=3, label=policy)  # fmt: skip
    ax.axhline(0.0, ls="--", color="gray", label="static low-cost")
    if "vs_low_cost" in summary.get("recovery", {}):
        m, h = point("recovery")
        ax.axhspan(m - h, m + h, color="gray", alpha=0.15)
        ax.axhline(m, ls=":", color="gray", label="static recovery (band: 95% CI)")
    if "vs_low_cost" in summary.get("first+last", {}):
        m, h = point("first+last")
        ax.errorbar([14], [m], yerr=[h], marker="*", ms=12, color="k", ls="none", capsize=3,
                    label="first+last (14)")  # fmt: skip
    ax.set(title=f"{regime}: held-out loss vs recovery budget, paired by seed",
           xlabel="units on the recovery path (of 28)",
           ylabel="held-out loss - static low-cost")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(budgets), [str(k) for k in budgets])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regime", choices=sorted(REGIMES), required=True)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--steps", type=int, default=None, help="override the regime's steps")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument("--arms", default="", help="only arms whose name contains one of these")
    p.add_argument("--fresh", action="store_true", help="discard finished jobs and start over")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    regime = REGIMES[a.regime]
    if a.steps is not None:
        regime = regime.with_steps(a.steps)
    seeds = [int(s) for s in a.seeds.split(",")]
    budgets = [int(k) for k in a.budgets.split(",")]
    t0 = time.perf_counter()
    records = run_sweep(regime, seeds, budgets, a.jobs, a.fresh,
                        [x.strip() for x in a.arms.split(",") if x.strip()])  # fmt: skip
    windows = [(f.start, f.stop) for f in regime.setup.faults]
    summary = summarize(records, seeds, windows)
    static = static_gap(records, seeds)
    name = f"sweep_{regime.name}"
    out = {"regime": regime.name, "description": regime.description, "setup": asdict(regime.setup),
           "seeds": seeds, "budgets": budgets, "static_gap": static,
           "summary": _jsonable(summary), "verdicts": verdicts(summary, budgets),
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(regime.name, summary, budgets, RESULTS / f"{name}.png")
    print(f"{regime.name}: {regime.description}; seeds {seeds}; {regime.setup.steps} steps")
    if static is not None:
        resolved = static[0] - static[1] > 0
        print(
            f"static gap (low-cost - recovery, paired): {_pm(static)} -> "
            f"{'resolved' if resolved else 'NOT resolved: no policy can be told apart'}"
        )
    print(table(summary))
    print()
    print("\n".join(f"- {v}" for v in out["verdicts"]))
    print()
    probed = ["low-cost"] + [n for n in summary if n.startswith(("GNMR", "oracle"))]
    print(selection_table(summary, probed))
    print("\n" + compact_selection(summary))
    for a, b in windows:
        print(
            f"\ninside the fault window, steps {a}-{b - 1}:\n"
            + compact_selection(summary, f"{a}-{b - 1}")
        )
    costs = [row["probe_cost"] for n, row in summary.items() if n in probed and row["probe_cost"]]
    if costs:
        print(
            f"\none probe (two extra forward/backward passes) costs {min(costs):.2f}-"
            f"{max(costs):.2f} median steps of its arm"
        )
    for a, b in windows:
        print(f"\nthe same on the probe steps inside the fault window, steps {a}-{b - 1}:")
        print(selection_table(summary, probed, f"{a}-{b - 1}"))


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


if __name__ == "__main__":
    main()
