"""RESULTS.md's FP4 regimes, one subsection each: NVFP4, MXFP4 and the per-tensor E2M1 stress
(the tables, the comparisons and the verdicts computed from them)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence

from benchmarks.harness.branch_stats import SPIKE, per_seed, table
from benchmarks.harness.stats import t95
from benchmarks.results_md.fp4_sweep import NULLS, Sweep, label, unit_words
from benchmarks.results_md.words import (
    compared,
    holds_zero,
    item,
    listing,
    numbered,
    paragraph,
    pct,
    pm,
    relation,
    resolved,
    resolved_word,
    span,
)


def regime_head(s: Sweep, title: str, intro: str, gap_note: str) -> list[str]:
    """Heading, the design, the static gap and the nulls, the table, the comparisons, the units
    each policy recovered most and the plot."""
    gap = s.gap
    after = s.gap_after()
    grows = ""
    if after is not None:
        e, pair = after
        grows = f"; after {e} steps {pm(pair)}"
        if not gap_note:
            grows += " (it accrues along the branch)" if pair[0] < gap[0] else " (it does not grow)"
    nulls = [
        f"{word} {pm(s.r['noise'][key])} ({holds_zero(s.r['noise'][key])}; "
        f"{s.r['noise'][key][1] / gap[0]:.2f} of the gap)"
        for key, word in NULLS.items()
        if key in s.r["noise"]
    ]
    no_sr = "low-cost (SR seed 1) - low-cost" not in s.r["noise"] and s.regime != "mxfp4"
    lines = [
        item(
            f"static gap (low-cost - BF16): **{pm(gap)}, {resolved_word(gap)}**"
            + (f" ({gap_note})" if gap_note else "")
            + grows
            + "."
        ),
        item(
            "nulls: "
            + ", ".join(nulls)
            + "."
            + (" No stochastic rounding here, so no SR null." if no_sr else "")
        ),
    ]
    comps = [f"- {n}: {pm(p)} -> {compared(p)}" for n, p in s.r["comparisons"].items()]
    picks = [
        f"- {a} recovered most: " + ", ".join(f"{u} {100 * x:.0f}%" for u, x in got)
        for a, got in s.r["picks"].items()
        if got
    ]
    return [
        f"### {title}",
        paragraph(intro),
        "\n".join(lines),
        table(s.summary),
        "\n".join(comps + picks),
        s.src.image(s.regime, f"{s.name}.png"),
    ]


def design_text(s: Sweep, nv: Sweep, why: str = "to fit the CPU time") -> str:
    text = f"{len(s.seeds)} seeds x {len(s.points)} branch points"
    if s.points != s.inst["points"]:
        text += f" ({numbered(s.points)})"
    text += f", {s.horizon} steps each"
    if len(s.budgets) > 1:
        text += f", at budgets {numbered(s.budgets)}"
    if s.points != nv.points:
        text += f": {len(s.points)} of NVFP4's {len(nv.points)} branch points, {why}"
    return text


def against(
    s: Sweep, a: str, others: Sequence[str], digits: int = 4, notes: dict[str, str] | None = None
) -> str:
    """``It is not resolved against X (...) or Y (...)``, one clause per verdict."""
    notes = notes or {}
    groups: dict[str, list[str]] = {}
    for b in others:
        pair = s.comp(a, b)
        groups.setdefault(compared(pair), []).append(
            f"{label(b)} ({pm(pair, digits)}{notes.get(b, '')})"
        )
    words = {"not resolved": "not resolved against", "better": "better than", "worse": "worse than"}
    parts = [
        f"{words[v]} {listing(items, 'or' if v == 'not resolved' else 'and')}"
        for v, items in groups.items()
    ]
    return f"It is {'; it is '.join(parts)}."


def nvfp4(nv: Sweep) -> list[str]:
    intro = (
        "1x16 activation and gradient blocks, 16x16 weight tiles, E4M3 block scales under an fp32 "
        "tensor scale, stochastic rounding of gradients, the 16x16 random Hadamard transform on "
        f"the wgrad inputs (`fp8_emulated`, `{_options(nv)}`). {design_text(nv, nv)} "
        f"(`results/{nv.name}.json`, records in `results/fp4/{nv.regime}.jsonl`)."
    )
    return [
        *regime_head(
            nv, "nvfp4: NVIDIA's NVFP4 recipe on every projection, recovery BF16", intro, ""
        ),
        nvfp4_verdict(nv),
    ]


def _options(s: Sweep) -> str:
    return json.dumps(s.spec("low-cost")["low_cost"])


def nvfp4_verdict(nv: Sweep) -> str:
    k, gap = nv.k, nv.gap[0]
    e, last, late, oracle = (
        f"GNMR+e {k}",
        nv.arm("NVIDIA last"),
        nv.arm("NVIDIA late"),
        f"oracle {k}",
    )
    vs_low = nv.summary[e]["vs_low_cost"]
    c_last = nv.comp(e, last)
    word = relation(c_last, "no different from")
    narrow = ""
    if not resolved(c_last):
        others = [p[1] for n, p in nv.r["comparisons"].items() if n != f"{e} - {last}"]
        bound = abs(c_last[0]) + c_last[1]
        narrow = (
            f", an interval {statistics.median(others) / c_last[1]:.1f}x narrower than the "
            f"median of the other comparisons', so any difference is smaller than {bound:.4f} "
            f"nats, {bound / gap:.2f} of the gap"
        )
    gnmr = f"GNMR {k}"
    oracle_text = f"The oracle by gradient gap closes only {pct(nv.closed(oracle))}" + (
        ": the units whose gradient FP4 moves most are not the ones whose recovery buys the most "
        f"loss over {nv.horizon} steps."
        if nv.closed(oracle)[0] < nv.closed(e)[0]
        else "."
    )
    troubles = sum(nv.spikes(a) + nv.summary[a]["diverged"] for a in nv.summary)
    calm = (
        f"No arm spiked or diverged: NVFP4 at this scale costs {gap:.3f} nats, not stability."
        if not troubles
        else f"Loss spikes and divergences, all arms: {troubles}."
    )
    return paragraph(
        f"**Verdict, NVFP4 at NVIDIA's budget ({k} of {nv.units} units, "
        f"~{100 * k / nv.units:.0f}% of unit-steps).** GNMR+e recovers **{pct(nv.closed(e))}** of "
        f"what NVFP4 costs, {resolved_word(vs_low)} against the static FP4 path ({pm(vs_low)}), "
        f"and is **{word} NVIDIA's last-layers rule**: {pm(c_last)}{narrow}. Both ends of the "
        f"network together (`first+last`, {nv.share('first+last')}% of unit-steps) close "
        f"{pct(nv.closed('first+last'))}; these records predate the per-unit recovery counts, so "
        "which units each policy held is named for MXFP4 below, not here.",
        against(nv, e, [f"random {k}", late, oracle]),
        f"The seed's GNMR spends {nv.share(gnmr)}% of unit-steps (the spike rule rarely fires in "
        "a healthy run) and closes "
        + ("nothing measurable" if not resolved(nv.closed(gnmr)) else "a measurable share")
        + f" ({pm(nv.closed(gnmr), 2)}).",
        oracle_text,
        calm,
        _seeds_needed(nv, e, f"random {k}"),
    )


def _seeds_needed(s: Sweep, a: str, b: str) -> str:
    """How many seeds would resolve ``a - b`` if its mean and per-seed spread held."""
    if resolved(s.comp(a, b)):
        return ""
    diffs = per_seed(s.records, s.design, a, b)
    m, sd = abs(statistics.fmean(diffs)), statistics.stdev(diffs)
    n = next((n for n in range(2, 1000) if t95(n - 1) * sd / math.sqrt(n) < m), None)
    if n is None:
        return ""
    half = t95(n - 1) * sd / math.sqrt(n)
    return (
        f"Resolving {a} against {b} at this noise takes about {n} seeds if the mean difference "
        f"holds (per-seed sd {sd:.4f}: {t95(n - 1):.2f} x {sd:.5f} / sqrt({n}) = {half:.5f} < "
        f"{m:.5f})."
    )


def mxfp4(mx: Sweep, mx_all: Sweep, nv: Sweep) -> list[str]:
    ratio = mx.gap[0] / nv.gap[0]
    intro = (
        "1x32 blocks with power-of-two (E8M0) scales, round to nearest, no transform: the plain "
        f"FP4 of the OCP MX specification. {design_text(mx, nv)} (`results/{mx.name}.json`; these "
        "records also carry per-unit recovery counts, so the report names the units each policy "
        "recovered)."
    )
    note = f"{ratio:.1f} times NVFP4's" + (
        f": NVIDIA's recipe divides the cost of FP4 by {ratio:.1f} here" if ratio > 1 else ""
    )
    return [
        *regime_head(mx, "mxfp4: OCP MXFP4 on every projection, recovery BF16", intro, note),
        all_points(mx_all, mx),
        mxfp4_verdict(mx),
    ]


def _null_text(s: Sweep) -> str:
    est, gap = s.r["noise"], s.gap[0]
    low = est["null low-cost (1e-6) - low-cost"]
    return (
        f"static gap {pm(s.gap)}, BF16 null {pm(est['null BF16 (1e-6) - BF16'])}, low-cost null "
        f"{pm(low)} ({low[1] / gap:.2f} of the gap)"
    )


def all_points(s: Sweep, two: Sweep) -> str:
    """The MXFP4 design at every branch point, against the two-point one."""
    k = s.k
    e = f"GNMR+e {k}"
    closes = listing(
        [
            f"{name} {pct(s.closed(arm))}"
            for name, arm in (
                (f"{e} closes", e),
                (f"NVIDIA's last-{k}", s.arm("NVIDIA last")),
                ("the late switch", s.arm("NVIDIA late")),
                (f"random-{k}", f"random {k}"),
                ("the oracle", f"oracle {k}"),
            )
        ]
    )
    comps = {
        b: s.comp(e, b)
        for b in (s.arm("NVIDIA late"), s.arm("NVIDIA last"), f"random {k}", f"oracle {k}")
    }
    sure = [
        f"against {label(b)}: **{pm(p)}, {compared(p)}**" for b, p in comps.items() if resolved(p)
    ]
    unsure = [f"{label(b)} {pm(p)}" for b, p in comps.items() if not resolved(p)]
    clauses = "; ".join(sure)
    if unsure:
        clauses += ("; against " if sure else "against ") + listing(unsure) + ", not resolved"
    top_e, top_o = (sorted(u for u, _ in s.picks(a, 4)) for a in (e, f"oracle {k}"))
    units = (
        f"GNMR+e and the oracle again recover {unit_words([u for u, _ in s.picks(e, 4)])}."
        if top_e == top_o and top_e
        else ""
    )
    return paragraph(
        f"**With all {len(s.points)} branch points** ({len(s.seeds) * len(s.points)} branches per "
        f"arm, the NVFP4 design; `{s.command().removeprefix('.venv/bin/')}`, "
        f"`results/{s.name}.json` and `.png`): {_null_text(s)}. {closes}; GNMR+e {clauses}.",
        units,
        _measurable_change(s, two),
    )


def _measurable_change(s: Sweep, two: Sweep) -> str:
    many, few = set(s.measurable()), set(two.measurable())
    if many == few:
        return f"The {len(two.points)}-point verdict below holds with {len(s.points)} points."
    text = f"The {len(two.points)}-point verdict below holds, except that"
    if many - few:
        gained = sorted(many - few)
        names = listing([label(a) for a in gained])
        text += f" with {len(s.points)} points the share of {names} is resolved"
        if len(many) == 1:
            text += f": it is the one policy that buys back part of {s.regime.upper()}'s cost"
    if few - many:
        text += (
            (" and" if many - few else "")
            + " the share of "
            + listing([label(a) for a in sorted(few - many)])
        )
        text += f" is not resolved with {len(s.points)} points"
    return text + "."


def mxfp4_verdict(mx: Sweep) -> str:
    k = mx.k
    e, oracle, gnmr = f"GNMR+e {k}", f"oracle {k}", f"GNMR {k}"
    got = mx.measurable()
    head = (
        "no policy buys back a measurable share"
        if not got
        else f"{listing([label(a) for a in got])} buys back a measurable share"
    )
    closes = f"GNMR+e closes {pct(mx.closed(e))} of the gap, " + listing(
        [
            f"{name} {pct(mx.closed(arm))}"
            for name, arm in (
                (f"random-{k}", f"random {k}"),
                ("NVIDIA's last-layers rule", mx.arm("NVIDIA last")),
                ("the gradient-gap oracle", oracle),
            )
        ]
    )
    sure = [(n, p) for n, p in mx.r["comparisons"].items() if resolved(p)]
    said = []
    for name, pair in sure:
        a, b = name.split(" - ")
        if compared(pair) == "worse":
            said.append(f"**{label(b)} is better** ({name}: {pm(pair)})")
        else:
            said.append(f"**{a} is better than {label(b)}** ({pm(pair)})")
    if not sure:
        resolved_text = "no comparison is resolved"
    elif len(sure) == 1 and sure[0][0].startswith(f"{e} -"):
        resolved_text = f"the only resolved comparison is against GNMR+e: {said[0]}"
    else:
        resolved_text = "the resolved comparisons: " + listing(said)
    top = {a: mx.picks(a, 4) for a in (e, oracle)}
    same = sorted(u for u, _ in top[e]) == sorted(u for u, _ in top[oracle])
    held = span([100 * sum(x for _, x in t) for t in top.values()], ".0f", "%")
    units = (
        f"GNMR+e and the oracle recovered the same units ({unit_words([u for u, _ in top[e]])}, "
        f"{held} of their unit-steps), so GNMR+e finds where FP4 moves the gradient most, as "
        "issue 13 measured"
        if same
        else "GNMR+e and the oracle recovered different units"
    )
    if not resolved(mx.closed(e)):
        units += (
            f", and in MXFP4 recovering those units buys back no loss that "
            f"{len(mx.seeds) * len(mx.points)} branches can see"
        )
    kinds = list(dict.fromkeys(u.partition(".")[2] for u, _ in mx.picks(gnmr)))
    troubles = sum(mx.spikes(a) + mx.summary[a]["diverged"] for a in mx.summary)
    return paragraph(
        f"**Verdict, MXFP4 at NVIDIA's budget: {head}.** {closes}; {resolved_text}.",
        units + ".",
        f"The seed's GNMR spends its {mx.share(gnmr)}% of unit-steps on {listing(kinds)} "
        "projections.",
        "No spikes, no divergence."
        if not troubles
        else f"Loss spikes and divergences: {troubles}.",
    )


def stress(st: Sweep, st_all: Sweep, nv: Sweep) -> list[str]:
    ratio = st.gap[0] / nv.gap[0]
    intro = (
        "What the static low-cost path looks like when it clearly fails at this scale: E2M1 values "
        "with one fp32 scale per tensor for x, W and dy (no blocks, no stochastic rounding, no "
        f"transform). {design_text(st, nv)} (the static gap is {ratio:.0f} times NVFP4's, so "
        f"fewer branches resolve it; `results/{st.name}.json`)."
    )
    title = "fp4_tensor: the stress, E2M1 with one scale per tensor on every projection"
    return [
        *regime_head(st, title, intro, ""),
        stress_verdict(st, st_all),
        stress_all_points(st_all),
        against_budget(st),
    ]


def _pm3(pair: Sequence[float]) -> str:
    return pm(pair, 3)


def stress_verdict(st: Sweep, st_all: Sweep) -> str:
    k = st.k
    e, gnmr, last, late, oracle, rand = (
        f"GNMR+e {k}",
        f"GNMR {k}",
        st.arm("NVIDIA last"),
        st.arm("NVIDIA late"),
        f"oracle {k}",
        f"random {k}",
    )
    agree = all(
        compared(p) == compared(st_all.r["comparisons"][n])
        for n, p in st.r["comparisons"].items()
        if n in st_all.r["comparisons"]
    )
    c_last = st.comp(e, last)
    fp4 = st.fp4_arms(k)
    calmest = min(st.spikes(a) for a in fp4) == st.spikes(e)
    spread = st.summary[e]["vs_bf16"][1]
    tightest = min(st.summary[a]["vs_bf16"][1] for a in fp4) == spread
    steps = len(st.seeds) * len(st.points) * st.horizon
    others = [
        ("all-FP4", "low-cost"),
        ("NVIDIA's rule", last),
        ("the late switch", late),
        (f"random-{k}", rand),
        ("the oracle", oracle),
    ]
    spikes = listing([f"{st.spikes(a)} for {n}" for n, a in others])
    stability = (
        f"Where GNMR+e stands out is stability: {st.spikes(e)} loss spikes (a step more than "
        f"{SPIKE} above BF16's on the same batch) over its {steps} steps, against {spikes}"
        if calmest
        else f"Loss spikes (a step more than {SPIKE} above BF16's on the same batch) over "
        f"{steps} steps: GNMR+e {st.spikes(e)}, against {spikes}"
    )
    if tightest:
        stability += (
            f"; and the smallest spread across seeds of any FP4 arm at this budget (+-{spread:.3f})"
        )
    c_gnmr = st.comp(gnmr, rand)
    fl = st.summary["first+last"]["vs_low_cost"]
    return paragraph(
        f"**Verdict, the stress at NVIDIA's budget ({k} of {st.units} units), {len(st.points)} "
        f"branch points** (the {len(st_all.points)}-point verdicts below "
        f"{'agree' if agree else 'differ in places'}). GNMR+e recovers **{pct(st.closed(e))}** of "
        f"the static gap ({_pm3(st.summary[e]['vs_low_cost'])} against all-FP4) and is "
        f"**{relation(c_last, 'no different from')} NVIDIA's last-layers rule** ({_pm3(c_last)}), "
        f"which recovers {pct(st.closed(last))}"
        + (": here the damage is not in the last layers." if compared(c_last) == "better" else "."),
        against(
            st,
            e,
            [rand, late, oracle],
            3,
            {late: f", which recovers {pct(st.closed(late))} with the same share of unit-steps"},
        ),
        stability + ".",
        f"The seed's GNMR ({st.share(gnmr)}% of unit-steps) is "
        f"**{relation(c_gnmr, 'no different from')} random-{k}** ({_pm3(c_gnmr)})"
        + (
            ": its spike rule reacts after the damage and its budget goes mostly unspent."
            if compared(c_gnmr) == "worse"
            else "."
        ),
        f"Megatron's first+last (the first and the last layer in BF16, {st.share('first+last')}% "
        f"of unit-steps) is {'no better than' if not resolved(fl) else relation(fl)} all-FP4 "
        f"({_pm3(fl)}){_early(st)}.",
        "No branch diverged." if not any(st.summary[a]["diverged"] for a in st.summary) else "",
    )


def _early(st: Sweep) -> str:
    """How first+last did against all-FP4 at the first branch point, seed by seed."""
    p = st.points[0]
    diffs = [
        st.records[("first+last", s, p)]["heldout"][str(st.horizon)]
        - st.records[("low-cost", s, p)]["heldout"][str(st.horizon)]
        for s in st.seeds
    ]
    lost = [d for d in diffs if d > 0]
    if len(lost) * 2 < len(diffs):
        return ""
    return (
        f" and worse early: at branch point {p} it lost to all-FP4 in {len(lost)} of "
        f"{len(diffs)} seeds, by up to {max(lost):.2f}"
    )


def stress_all_points(s: Sweep) -> str:
    k = s.k
    e, rand, oracle = f"GNMR+e {k}", f"random {k}", f"oracle {k}"
    last, late = s.arm("NVIDIA last"), s.arm("NVIDIA late")
    words = {"better": "better than", "worse": "worse than", "not resolved": "level with"}
    groups: dict[str, list[str]] = {}
    for name, b in (
        (f"NVIDIA's last-{k}", last),
        ("the late switch", late),
        (f"random-{k}", rand),
        ("the oracle", oracle),
    ):
        p = s.comp(e, b)
        share = "" if b == oracle else f"; it closes {pct(s.closed(b))}"
        groups.setdefault(words[compared(p)], []).append(f"{name} ({_pm3(p)}{share})")
    versus = ", ".join(f"{w} {listing(items)}" for w, items in groups.items())
    steps = len(s.seeds) * len(s.points) * s.horizon
    c_gnmr = s.comp(f"GNMR {k}", rand)
    others = (("all-FP4", "low-cost"), ("NVIDIA's rule", last), ("the late switch", late))
    spikes = listing([f"{s.spikes(a)} for {n}" for n, a in (*others, (f"random-{k}", rand))])
    return paragraph(
        f"**At budget {k} with all {len(s.points)} branch points** "
        f"({len(s.seeds) * len(s.points)} branches per arm, the NVFP4 design; "
        f"`{s.command().removeprefix('.venv/bin/')}`, `results/{s.name}.json` and `.png`): "
        f"{_null_text(s)}. {e} closes **{pct(s.closed(e))}**, {versus}, with {s.spikes(e)} loss "
        f"spikes over {steps:,} steps against {spikes}.",
        f"The seed's GNMR is {relation(c_gnmr, 'level with')} random-{k} ({_pm3(c_gnmr)}).",
    )


def against_budget(s: Sweep) -> str:
    ks = s.budgets
    lowest = all(
        s.summary[f"GNMR+e {k}"]["vs_bf16"][0]
        == min(s.summary[f"{p} {k}"]["vs_bf16"][0] for p in ("random", "GNMR", "GNMR+e", "oracle"))
        for k in ks
    )
    closing = listing(
        [
            f"{pct(s.closed(f'GNMR+e {k}'))} at k = {k} ({s.share(f'GNMR+e {k}')}% of unit-steps)"
            for k in ks
        ]
    )
    spikes = listing([str(s.spikes(f"GNMR+e {k}")) for k in ks])
    means = {
        p: listing([f"{100 * s.closed(f'{p} {k}')[0]:.0f}%" for k in ks])
        for p in ("random", "oracle")
    }
    vs_random = [s.comp(f"GNMR+e {k}", f"random {k}") for k in ks]
    verdicts = {compared(p) for p in vs_random}
    paired = ", ".join(_pm3(p) for p in vs_random)
    if verdicts == {"not resolved"}:
        random_text = f"it is not resolved at any k ({paired})"
    else:
        random_text = "it is " + listing(
            [f"{compared(p)} at k = {k} ({_pm3(p)})" for k, p in zip(ks, vs_random, strict=True)]
        )
    seed = {compared(s.comp(f"GNMR {k}", f"random {k}")) for k in ks}
    seed_text = (
        f"the seed's GNMR is {seed.pop()} than random at every k"
        if len(seed) == 1 and seed <= {"better", "worse"}
        else "the seed's GNMR is "
        + listing([f"{compared(s.comp(f'GNMR {k}', f'random {k}'))} at k = {k}" for k in ks])
    )
    return paragraph(
        f"**Against budget** (the plot): GNMR+e is {'the' if lowest else 'not the'} lowest curve "
        f"at every budget, closing {closing}, with {spikes} loss spikes; random-k closes "
        f"{means['random']}, the oracle {means['oracle']}. Paired against random-k at the same "
        f"budget {random_text}; {seed_text}. NVIDIA's rules are compared at their own budget only "
        f"(k = {s.k}).",
    )
