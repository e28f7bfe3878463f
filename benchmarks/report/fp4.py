"""RESULTS.md's FP4 section (issue 24): the branch sweeps of :mod:`benchmarks.sweep.fp4`, read
from their reports (``results/sweep_fp4_*.json``) and branch records (``results/fp4/*.jsonl``).
This module writes the section's head and its step-time subsection; :mod:`.fp4_regimes` the
regimes."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.harness.branch_stats import SPIKE
from benchmarks.results_md.fp4_regimes import mxfp4, nvfp4, stress
from benchmarks.results_md.fp4_sweep import CLI, Sweep, label, sweeps
from benchmarks.results_md.source import Source
from benchmarks.results_md.words import (
    bash,
    compared,
    listing,
    numbered,
    ordinal,
    paragraph,
    pct,
    pm,
    resolved,
    span,
)


def render(src: Source) -> list[str]:
    """The FP4 section, one markdown block per item."""
    sw = sweeps(src)
    return [
        "## FP4: what recovering a few units buys back, against NVIDIA's static rule (issue 24)",
        commands(sw),
        in_short(sw),
        instrument(src, sw["nvfp4"]),
        noise(sw["nvfp4"]),
        arms(sw),
        *nvfp4(sw["nvfp4"]),
        *mxfp4(sw["mxfp4"], sw["mxfp4 all"], sw["nvfp4"]),
        *stress(sw["stress"], sw["stress all"], sw["nvfp4"]),
        *step_time(src),
    ]


# ====================================================================== the section's head


def commands(sw: dict[str, Sweep]) -> str:
    lines = [
        f"{s.command()}   # {s.branches()} branches, {s.process_hours():.1f} process-hours"
        for s in sw.values()
    ]
    return bash(*lines, f"{CLI} --step-time --regime nvfp4   # GNMR+e vs NVIDIA's rule, timed")


def in_short(sw: dict[str, Sweep]) -> str:
    nv, st, mx = sw["nvfp4"], sw["stress all"], sw["mxfp4 all"]
    e, last = f"GNMR+e {nv.k}", nv.arm("NVIDIA last")
    amount = {"better": "more than", "worse": "less than"}.get(
        compared(nv.comp(e, last)), "the same as"
    )
    beats = {"better": "beats", "worse": "loses to"}.get(
        compared(st.comp(e, st.arm("NVIDIA last"))), "is level with"
    )
    fewest = min(st.spikes(a) for a in st.fp4_arms()) == st.spikes(e)
    rand = [
        (s, k)
        for s in sw.values()
        for k in s.budgets
        if resolved(s.comp(f"GNMR+e {k}", f"random {k}"))
    ]
    against_random = (
        f"Against random selection at the same budget no difference is resolved with "
        f"{len(nv.seeds)} seeds in any regime."
        if not rand
        else "Against random selection at the same budget: "
        + listing(
            [f"{s.name} k = {k} {compared(s.comp(f'GNMR+e {k}', f'random {k}'))}" for s, k in rand]
        )
        + "."
    )
    return paragraph(
        f"**In short.** At NVIDIA's budget ({nv.k} of {nv.units} units), GNMR+e buys back "
        f"{pct(nv.closed(e))} of NVFP4's cost, {amount} NVIDIA's last-layers rule; in the "
        f"per-tensor E2M1 stress it buys back {pct(st.closed(e))} and {beats} NVIDIA's rule"
        + (", with the fewest loss spikes;" if fewest else ";"),
        _mx_in_short(mx, e),
        against_random,
    )


def _mx_in_short(mx: Sweep, e: str) -> str:
    got = mx.measurable()
    if not got:
        return "in MXFP4 no policy buys back a measurable share."
    if len(got) > 1:
        shares = listing([f"{label(a)} ({pct(mx.closed(a))})" for a in got])
        return f"in MXFP4 {shares} buy back a measurable share."
    (a,) = got
    text = f"in MXFP4 only {label(a)} buys back a measurable share ({pct(mx.closed(a))})"
    if a != e and compared(mx.comp(e, a)) == "worse":
        text += ", and it beats GNMR+e"
    return text + "."


SELECTION_SWEEPS = ("act_quant", "fp6_fp8", "outlier", "delayed")
"""The whole-run selection sweeps whose static-gap intervals measure a whole run's noise."""


def _whole_runs(src: Source) -> list[dict[str, Any]]:
    return [src.json(f"sweep_{r}") for r in SELECTION_SWEEPS]


def instrument(src: Source, nv: Sweep) -> str:
    whole = _whole_runs(src)
    halves = [w["static_gap"][1] for w in whole]
    steps = [w["setup"]["steps"] for w in whole]
    inst = nv.inst
    return paragraph(
        "**The instrument** (`benchmarks/harness/branch.py`). Whole runs cannot judge a policy at "
        f"this scale: the selection sweeps below, whole runs of {span(steps, 'd')} steps paired by "
        f"seed, put the static gap's 95% interval at +-{min(halves):.3f} to +-{max(halves):.3f}. "
        "The branch estimator trains one BF16 reference run (the trunk, "
        f"{inst['trunk_steps']} steps, warm-up then cosine) per seed and saves weights, AdamW "
        "state, schedule and an observing GNMR controller at steps "
        f"{numbered(inst['points'])}; every arm restarts from every checkpoint and trains "
        f"{inst['horizon']} steps on the batches the trunk would have trained on next; the "
        f"held-out loss ({inst['eval_batches']} batches, fp32 evaluation for every arm) is paired "
        "by branch, averaged over a seed's branch points, and the 95% Student-t interval is taken "
        f"over the {len(nv.seeds)} seeds ({', '.join(map(str, nv.seeds))}): seeds are the "
        "replicates, branch points of one trunk are not. Model: the harness Llama of the sections "
        f"below ({nv.units} projection units), at the learning rate `benchmarks/sweep/regimes.py` "
        "gives the FP4 regimes.",
    )


def noise(nv: Sweep) -> str:
    est, (gap, _) = nv.r["noise"], nv.gap
    bf16, low = est["null BF16 (1e-6) - BF16"], est["null low-cost (1e-6) - low-cost"]
    sr = est.get("low-cost (SR seed 1) - low-cost")
    whole = min(w["static_gap"][1] for w in _whole_runs(nv.src))
    louder = (
        "much louder" if low[1] > 10 * bf16[1] else "louder" if low[1] > bf16[1] else "no louder"
    )
    sr_text = (
        f", and another stochastic-rounding draw {pm(sr)} ({sr[1] / gap:.2f} of the gap). That "
        "second figure is a property of NVFP4, not of the instrument: a run's FP4 rounding noise "
        f"moves its loss by {sr[1] / gap:.2f} of what NVFP4 costs on average, so every "
        "comparison between FP4 arms carries it."
        if sr
        else "."
    )
    return paragraph(
        "**Its noise.** Two null controls per regime: BF16 twice, one copy with the weights moved "
        "by 1e-6 relative at the branch point (a perturbation that changes nothing on average), "
        "and the same for the low-cost path; in NVFP4, a third: the low-cost path with another "
        "draw of its stochastic rounding (`seed` 1), which measures how much FP4's own "
        f"realization moves the result. The BF16 null is the estimator's noise: "
        f"**{pm(bf16, 6)}** in NVFP4, {100 * bf16[1] / gap:.0f}% of the static gap it resolves "
        f"and about 1/{10 ** round(math.log10(whole / bf16[1])):,} of the narrowest whole-run "
        f"interval (+-{whole:.3f}). The FP4 path's own realizations are {louder}: the 1e-6 null "
        f"of the low-cost path {pm(low)} ({low[1] / gap:.2f} of the gap){sr_text}",
    )


def arms(sw: dict[str, Sweep]) -> str:
    nv = sw["nvfp4"]
    k, late, last = nv.k, nv.late, nv.arm("NVIDIA last")
    e = f"GNMR+e {k}"
    gammas = listing(
        [str(sw[r].spec(e)["controller"]["gamma"]) for r in ("nvfp4", "mxfp4", "stress")]
    )
    every = ordinal(nv.spec(e)["error_every"])
    return paragraph(
        f"**Arms**, all from the same checkpoints and batches: `low-cost` (FP4 on all {nv.units} "
        f"units), `BF16` (all units), `{last}` (NVIDIA's rule: the last linear layers in BF16, "
        f"here the last {k} of {nv.units} units, {nv.share(last)}% of unit-steps), "
        f"`NVIDIA late-{late}` (NVIDIA's other rule, the report's appendix D: every unit in BF16 "
        f"for the last {late} of {nv.horizon} steps, {nv.share(f'NVIDIA late-{late}')}% of "
        "unit-steps), `first+last` (megatron's `--first-last-layers-bf16`: the first and the last "
        f"layer, {nv.share('first+last')}%), and at k = {k} (NVIDIA's share): `random {k}` "
        f"(re-drawn every step), `GNMR {k}` (the seed's controller), `{e}` "
        "(docs/algorithm.md#damage-term's error "
        f"term measured every {every} step; `gamma` {gammas} in NVFP4, MXFP4 and the stress, "
        "about the median score of the static FP4 path's units) and "
        f"`oracle {k}` (every step, the {k} units with the largest measured gradient gap on that "
        f"step's weights and batch). Loss spikes (a training step more than {SPIKE} above BF16's "
        "on the same batch) and divergences (held-out more than 1.0 above BF16's, or a "
        "non-finite loss) are counted per arm.",
    )


# ====================================================================== step time


def step_time(src: Source) -> list[str]:
    name = "sweep_fp4_step_time_nvfp4"
    head = "### Step time: GNMR+e against NVIDIA's rule at the same budget"
    how = (
        "`python -m benchmarks.sweep.fp4 --step-time --regime nvfp4` trains both arms from one "
        "trunk checkpoint on the same batches, interleaved one step each in turn in one process "
        "on one thread, and a third: GNMR+e's own plan replayed without monitor, controller or "
        "error score (the same weights at the end, checked). GNMR+e against NVIDIA's rule also "
        "holds *which* units run BF16 (on the CPU an emulated FP4 unit costs more than a BF16 "
        "one), so the runtime's own cost is the other ratio, GNMR+e against its plan replayed."
    )
    gpu = (
        "The GPU figure, with TE, is what `benchmarks/gpu/te_check.py` reports; it has not been "
        "run in this project on a Blackwell GPU (none was lent; an H200 has no FP4 GEMMs)."
    )
    if not src.has(f"{name}.json"):
        return [
            head,
            paragraph(
                how,
                f"No run is stored: the command writes `results/{name}.json`, and this section "
                "shows its runs once the file is committed.",
                gpu,
            ),
        ]
    r = src.json(name)
    runs, target = r["runs"], r["target"]
    first = runs[0]
    names = list(first["ms"])
    rows = [
        "| run | date | " + " | ".join(names) + " | GNMR+e / NVIDIA | GNMR+e / replayed |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |",
    ]
    for i, run in enumerate(runs, 1):
        cells = [f"{run['ms'][n]:.1f} ms" for n in names]
        rows.append(
            f"| {i} | {run['date']} | {' | '.join(cells)} | **{run['vs_nvidia']:.3f}** | "
            f"{run['vs_replayed']:.3f} |"
        )
    ratios = [run["vs_nvidia"] for run in runs]
    own = [run["vs_replayed"] for run in runs]
    met = all(x <= target for x in ratios)
    return [
        head,
        paragraph(
            how,
            f"Seed {first['seed']}'s checkpoint at step {first['point']}, {first['steps']} steps "
            f"per arm, medians after {first['warmup']} warm-up steps.",
        ),
        "\n".join(rows),
        paragraph(
            "GNMR+e at NVIDIA's budget against NVIDIA's rule: "
            f"**{listing([f'{x:.3f}' for x in ratios])}, {'within' if met else 'not all within'} "
            f"the {target} target**. Against its own plan replayed: "
            f"**{listing([f'{x:.3f}' for x in own])}**.",
            gpu,
        ),
    ]
