"""RESULTS.md's selection section (issue 13): the whole-run sweeps of
:mod:`benchmarks.sweep.selection`, read from ``results/sweep_<regime>.json``."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.stats import SELECTION_BAR, verdicts
from benchmarks.results_md.source import Source
from benchmarks.results_md.words import bash, listing, paragraph, pm, resolved, resolved_word, span
from benchmarks.sweep.selection_report import compact_selection, table

REGIMES = ("act_quant", "fp6_fp8", "outlier", "delayed")
SIGNALS = (  # the k = 3 scores and sets graded against the update gap: (arm, graded set)
    ("low-cost", "risk_topk"),
    ("low-cost", "error_global_topk"),
    ("low-cost", "error_adam_topk"),
    ("GNMR+e 3", "risk_topk"),
    ("GNMR+e 3", "active"),
)


class Sweep:
    """One regime's sweep report (``results/sweep_<regime>.json``)."""

    def __init__(self, src: Source, regime: str) -> None:
        self.regime = regime
        self.r: dict[str, Any] = src.json(f"sweep_{regime}")
        self.summary: dict[str, dict[str, Any]] = self.r["summary"]
        self.setup: dict[str, Any] = self.r["setup"]
        self.seeds: list[int] = self.r["seeds"]
        self.budgets: list[int] = self.r["budgets"]
        self.gap: list[float] = self.r["static_gap"]
        self.windows = [f"{f['start']}-{f['stop'] - 1}" for f in self.setup.get("faults", [])]

    @property
    def units(self) -> int:
        """Projection units: ``random 1`` runs exactly one of them on the recovery path."""
        return round(1 / self.summary["random 1"]["recovery_rate"])

    def fig(self, arm: str, graded: str, figure: str = "precision_grad", window: str = "") -> float:
        """One selection figure's mean over seeds (every probe step, or inside ``window``)."""
        row = self.summary[arm]
        sel = row["selection_fault"][window] if window else row["selection"]
        return sel[graded][figure][0]

    def half(self, arm: str, graded: str, window: str = "") -> float:
        row = self.summary[arm]
        sel = row["selection_fault"][window] if window else row["selection"]
        return sel[graded]["precision_grad"][1]

    def beats_nothing(self) -> bool:
        """No budgeted policy beats random-k (or first+last at 14) at any budget."""
        return all("beats random-k: none" in v for v in verdicts(self.summary, self.budgets))

    def command(self) -> str:
        return f".venv/bin/python -m benchmarks.sweep.selection --regime {self.regime}"


def render(src: Source) -> list[str]:
    sw = {r: Sweep(src, r) for r in REGIMES}
    return [
        "## Does the controller pick the units that matter? Policies against controls (issue 13)",
        intro(sw),
        *act_quant(src, sw["act_quant"]),
        *fp6_fp8(src, sw["fp6_fp8"]),
        *outlier(src, sw["outlier"]),
        *delayed(src, sw["delayed"]),
        across(sw),
    ]


def intro(sw: dict[str, Sweep]) -> str:
    s = sw["act_quant"]
    costs = [
        row["probe_cost"] for w in sw.values() for row in w.summary.values() if row["probe_cost"]
    ]
    fl = round(s.summary["first+last"]["recovery_rate"] * s.units)
    return paragraph(
        "Each regime (`benchmarks/sweep/regimes.py`) trains the harness's Llama "
        f"({s.setup['layers']} layers x {s.setup['hidden']}, {s.units} projection units) on the "
        f"embedded corpus with {len(s.summary)} arms, each from the same initial weights on the "
        f"same batches, for each of {len(s.seeds)} seeds ({', '.join(map(str, s.seeds))}: the "
        "seed sets the initial weights and the batch order): the static low-cost and static "
        f"recovery paths, Megatron's first+last recipe ({fl} of {s.units} units), and at budgets "
        f"k = {listing([str(k) for k in s.budgets])} units: `random k` (k units re-drawn every "
        "step), `GNMR k` (the seed's controller, docs/algorithm.md), `GNMR+e k` (with section "
        "2.1's error term, `e = B / G`) and `oracle k` (every step, the recovery-gap probe "
        "measures every unit's gradient gap on the step's own weights and batch first, and the k "
        "largest run the recovery path: the upper bound of any selection). Held-out loss: "
        f"{s.setup['eval_batches']} batches of the held-out split. Every comparison is paired by "
        "seed (the same seed gives every arm the same weights and batches), with a 95% Student-t "
        f'interval over the {len(s.seeds)} seeds; a policy "beats" random-k when its paired '
        "interval lies below 0. Selection quality comes from the probe on the low-cost, GNMR and "
        "GNMR+e arms (two extra forward/backward passes: "
        f"{span(costs, '.1f')} median steps each): precision@3 of a score's top-3 against the "
        "top-3 by measured gradient gap and by update gap (the gap after Adam's "
        "`1 / (sqrt(v) + eps)`), and the share of the squared gradient gap a set covers; the row "
        "of 3 random units is chance.",
    )


def regime_blocks(src: Source, s: Sweep, title: str, head: Sequence[str]) -> list[str]:
    """Heading, command, the regime's opening paragraphs, the arms' table, the verdict lines and
    the plot."""
    lines = [f"- {v}" for v in verdicts(s.summary, s.budgets)]
    same = [
        f"`GNMR {a}` and `GNMR {b}` end at the same held-out loss on every seed: at issue 8's "
        f"calibrated thresholds the seed's GNMR never holds more than {a} units at once."
        for a, b in zip(s.budgets, s.budgets[1:], strict=False)
        if s.summary[f"GNMR {a}"]["per_seed"] == s.summary[f"GNMR {b}"]["per_seed"]
    ]
    return [
        f"### {s.regime}: {title}, {s.setup['steps']} steps",
        bash(s.command()),
        *head,
        table(s.summary),
        paragraph(*same),
        "\n".join(lines),
        src.image(f"{s.regime} sweep", f"sweep_{s.regime}.png"),
    ]


def _gap_text(s: Sweep) -> str:
    return f"**{pm(s.gap, 3)}**: {resolved_word(s.gap)}"


def _quality(s: Sweep) -> str:
    return "not measurable here" if not resolved(s.gap) else "measurable here"


def _update_signals(s: Sweep, window: str = "") -> list[float]:
    return [s.fig(a, g, "precision_update", window) for a, g in SIGNALS]


def _loss_verdict(s: Sweep) -> str:
    if not s.beats_nothing():
        return "Some policy beats random-k (the lines above)."
    why = ", because the static gap itself is within seed noise" if not resolved(s.gap) else ""
    return f"No policy beats random-k at any budget, the oracle included{why}."


def act_quant(src: Source, s: Sweep) -> list[str]:
    seed = src.json("act_quant")
    loss = {r["name"]: r["heldout_loss"] for r in seed["results"]}
    low, high = loss["static 2-bit"], loss["static 8-bit"]
    halves = [row["vs_low_cost"][1] for n, row in s.summary.items() if n != "low-cost"]
    head = paragraph(
        f"The static gap, low-cost minus recovery held-out loss paired by seed, is {_gap_text(s)}.",
        (
            f"At {s.setup['steps']} steps any change of path moves the held-out loss by about "
            f"+-{statistics.median(halves):.2f} (the median half-width against low-cost below), "
            "more than 2-bit saved activations cost; no policy can be told apart from another, "
            "the oracle included."
            if not resolved(s.gap)
            else ""
        ),
        f"Issue 8's single-seed {seed['setup']['steps']}-step gap (below: static 2-bit {low:.3f} "
        f"against static 8-bit {high:.3f}, {low - high:.3f}) is "
        f"{'within' if low - high < s.gap[1] else 'outside'} that spread too.",
    )
    e, g = "GNMR+e 3", "GNMR 3"
    rand = s.fig("low-cost", "random")
    seed_risk = s.fig("low-cost", "risk_topk")
    adam, err = (
        s.fig("low-cost", x, "precision_update") for x in ("error_adam_topk", "error_global_topk")
    )
    update = _update_signals(s)
    verdict = paragraph(
        f"Verdict: **selection: {_yes(s.fig(e, 'risk_topk'))}; training quality: {_quality(s)}.** "
        f"The error term sees the damage: its top-3 finds the top-3 units by measured gradient gap "
        f"{100 * s.fig(e, 'risk_topk'):.0f}% of the time (the acceptance bar is {SELECTION_BAR}), "
        f"and GNMR+e's recovery set covers {100 * s.fig(e, 'active', 'share_grad'):.0f}% of the "
        f"squared gap with 3 units of {s.units}; the seed's GNMR ranks them "
        f"{'at chance' if seed_risk <= rand + s.half('low-cost', 'random') else 'above chance'} "
        f"({seed_risk:.2f}, its set: {s.fig(g, 'active', 'share_grad'):.2f} of the gap). Against "
        "the update gap, what moves the weights, every signal is "
        f"{'weak' if max(update) < SELECTION_BAR else 'mixed'} ({span(update)}; Adam's "
        "per-element scaling reorders the units: the oracle by gradient gap has precision "
        f"{s.fig('low-cost', 'oracle_grad', 'precision_update'):.2f} there), and scaling `B` by "
        f"Adam's second moment {'raises' if adam > err else 'leaves'} it "
        f"{'to' if adam > err else 'at'} {adam:.2f} at the cost of the gradient-gap precision "
        f"({s.fig('low-cost', 'error_adam_topk'):.2f}).",
        _loss_verdict(s),
    )
    return [
        *regime_blocks(src, s, "2-bit / 8-bit saved activations", [head]),
        "What the policies select, against the measured gap (mean +- 95% interval over the "
        f"{len(s.seeds)} seeds, of each seed's mean over its probe steps):",
        compact_selection(s.summary),
        verdict,
    ]


def _yes(x: float) -> str:
    return "yes" if x >= SELECTION_BAR else "no"


def _bar(x: float) -> str:
    """Where a precision stands against the bar, at the two decimals the document prints."""
    shown, bar = round(x, 2), round(SELECTION_BAR, 2)
    return "at the bar" if shown == bar else "above the bar" if shown > bar else "below the bar"


def fp6_fp8(src: Source, s: Sweep) -> list[str]:
    low, rec = s.summary["low-cost"]["per_seed"], s.summary["recovery"]["per_seed"]
    diffs = [a - b for a, b in zip(low, rec, strict=True)]
    most, least = (
        max(range(len(diffs)), key=diffs.__getitem__),
        min(range(len(diffs)), key=diffs.__getitem__),
    )
    opposite = f", seed {s.seeds[least]} the opposite" if diffs[least] < 0 else ""
    head = paragraph(
        f"The static gap is {_gap_text(s)}. Per seed, low-cost minus recovery is "
        f"{listing([f'{d:+.3f}' for d in diffs])}: seed {s.seeds[most]} shows issue 8's large "
        f"FP6 penalty{opposite}.",
    )
    e = "GNMR+e 3"
    risk = s.fig(e, "risk_topk")
    update = {g: s.fig("low-cost", g, "precision_update") for _, g in SIGNALS[:3]}
    update["GNMR+e risk"] = s.fig(e, "risk_topk", "precision_update")
    best = max(update, key=update.__getitem__) == "error_adam_topk"
    o_update = s.fig("low-cost", "oracle_grad", "precision_update")
    verdict = paragraph(
        f"Verdict: **selection: {_yes(risk)} ({risk:.2f} against {SELECTION_BAR}); training "
        f"quality: {_quality(s)}.** The error score's top-3 finds "
        f"{100 * s.fig('low-cost', 'error_global_topk'):.0f}% of the top-3 gradient gaps, and "
        f"GNMR+e's risk {100 * risk:.0f}%, where the seed's GNMR scores "
        f"{s.fig('low-cost', 'risk_topk'):.2f}. GNMR+e's recovery set covers "
        f"{100 * s.fig(e, 'active', 'share_grad'):.0f}% of the squared gap with 3 units. The "
        f"update gap is {'almost unrelated' if o_update < 0.3 else 'only partly related'} to the "
        f"gradient gap here: the oracle by gradient gap has precision {o_update:.2f} against it. "
        f"The Adam-scaled `B` is {'again the' if best else 'not the'} best update-gap signal, at "
        f"{update['error_adam_topk']:.2f}"
        + (", and again weak." if update["error_adam_topk"] < SELECTION_BAR else "."),
        _loss_verdict(s),
    )
    return [
        *regime_blocks(src, s, "per-tensor FP6 / block-scaled FP8", [head]),
        compact_selection(s.summary),
        verdict,
    ]


def _fault(s: Sweep, i: int = 0) -> dict[str, Any]:
    return s.setup["faults"][i]


def outlier(src: Source, s: Sweep) -> list[str]:
    f = _fault(s)
    (w,) = s.windows
    head = paragraph(
        "Block-scaled FP6 on the low-cost path, block FP8 on the recovery path; input channel "
        f"{f['channel']} of `{f['module']}` is multiplied by {f['scale']:g} for steps {w}, so the "
        "rest of each token row of that input rounds to FP6's few levels near 0 in that one "
        f"projection. The static gap is {_gap_text(s)}.",
    )
    e, g = "GNMR+e 3", "GNMR 3"
    risk = s.fig(e, "risk_topk", window=w)
    seed_update = s.fig("low-cost", "risk_topk", "precision_update", w)
    err_update = [s.fig("low-cost", "error_global_topk", "precision_update", x) for x in ("", w)]
    flips = seed_update > max(err_update)
    verdict = paragraph(
        f"Verdict: **selection during the fault: {_yes(risk)} ({risk:.2f} against "
        f"{SELECTION_BAR}); training quality: {_quality(s)}.** Inside the window GNMR+e's risk "
        f"finds {100 * risk:.0f}% of the top-3 units by measured gradient gap and its recovery set "
        f"{100 * s.fig(e, 'active', window=w):.0f}%, covering "
        f"{100 * s.fig(e, 'active', 'share_grad', w):.0f}% of the squared gap with 3 of {s.units} "
        f"units; the seed's GNMR finds {100 * s.fig('low-cost', 'risk_topk', window=w):.0f}% (its "
        f"recovery set: {100 * s.fig(g, 'active', 'share_grad', w):.0f}% of the gap). Against the "
        f"update gap the order {'flips' if flips else 'holds'}: the seed's risk scores "
        f"{seed_update:.2f} there and the error score {span(err_update)}. Block scaling contains "
        "the outlier to its own groups, so the held-out cost of the fault (and so of the whole "
        "static gap) stays inside seed noise"
        + (", and no policy beats random-k at any budget." if s.beats_nothing() else "."),
    )
    return [
        *regime_blocks(
            src, s, "one outlier input channel in one projection, block FP6 / FP8", [head]
        ),
        "Over every probe step of each seed:",
        compact_selection(s.summary),
        f"On the probe steps inside the fault window (steps {w}):",
        compact_selection(s.summary, w),
        verdict,
    ]


def delayed(src: Source, s: Sweep) -> list[str]:
    spikes = [
        f"steps {w} in `{f['module'].removeprefix('model.')}`"
        for w, f in zip(s.windows, s.setup["faults"], strict=True)
    ]
    f = _fault(s)
    head = paragraph(
        "Per-tensor FP8 e4m3 with TE's delayed scaling on the low-cost path (the scale comes from "
        "the max of the recent steps' amaxes), bf16 on the recovery path. Two activation spikes "
        f"rise x{f['growth']:g} per step for {f['stop'] - f['start']} steps "
        f"({listing(spikes)}): the history lags a rising spike at every step, so the spiking "
        "input saturates at e4m3's max in one projection. The static gap is "
        f"{_gap_text(s)}.",
    )
    e = "GNMR+e 3"
    overall = s.fig(e, "risk_topk")
    inside = [s.fig(e, "risk_topk", window=w) for w in s.windows]
    halves = [s.half(e, "risk_topk", w) for w in s.windows]
    bars = listing([f"{x:.2f} {_bar(x)}" for x in inside])
    verdict = paragraph(
        f"Verdict: **selection: {_yes(overall)}, overall ({overall:.2f}); inside the "
        f"{len(inside)} spikes {bars} (intervals {listing([f'+-{h:.2f}' for h in halves])} over "
        f"{len(s.seeds)} seeds)"
        + f"; training quality: {_quality(s)}.** The error score alone finds "
        + listing([f"{s.fig('low-cost', 'error_global_topk', window=w):.2f}" for w in s.windows])
        + " of the top-3 gaps inside the two spikes on the static low-cost arm; the seed's risk "
        "alone "
        + listing([f"{s.fig('low-cost', 'risk_topk', window=w):.2f}" for w in s.windows])
        + " there ("
        + listing(
            [f"{s.fig('low-cost', 'risk_topk', 'precision_update', w):.2f}" for w in s.windows]
        )
        + " against the update gap, where Adam's scaling of the bound reaches "
        + listing(
            [
                f"{s.fig('low-cost', 'error_adam_topk', 'precision_update', w):.2f}"
                for w in s.windows
            ]
        )
        + ").",
        "No policy beats random-k at any budget." if s.beats_nothing() else "",
    )
    graded = paragraph(
        "How a recovered unit is graded here: its gap is what the low-cost path would do to it "
        "*at this step*, and a unit coming back from recovery starts with a reset amax history "
        "(docs/backends.md#delayed-scaling), so the probe quantizes it with a stand-in empty "
        "history (its own amax), "
        "which is also what its shadow error score measures. (The first run of this sweep "
        "quantized recovered units with their frozen pre-recovery history, a path that never "
        "runs again; the training runs are bit-for-bit the same: the probe changes nothing in "
        "them.) So a set that is on recovery tends to score low against the gap: recovery "
        "already reset its scale.",
    )
    ordinal = ("first", "second")
    windows = []
    for i, w in enumerate(s.windows):
        windows += [
            f"On the probe steps inside the {ordinal[i]} spike (steps {w}):",
            compact_selection(s.summary, w),
        ]
    return [
        *regime_blocks(src, s, "TE-style delayed scaling with rising activation spikes", [head]),
        "Over every probe step of each seed:",
        compact_selection(s.summary),
        *windows,
        graded,
        verdict,
    ]


def across(sw: dict[str, Sweep]) -> str:
    all_ = list(sw.values())
    gaps = [f"{s.gap[0]:+.3f}" for s in all_]
    none = not any(resolved(s.gap) for s in all_)
    risk = " / ".join(f"{s.fig('GNMR+e 3', 'risk_topk'):.2f}" for s in all_)
    seed = " / ".join(f"{s.fig('low-cost', 'risk_topk'):.2f}" for s in all_)
    out, dl = sw["outlier"], sw["delayed"]
    fault = f"{out.fig('GNMR+e 3', 'risk_topk', window=out.windows[0]):.2f}"
    spikes = " / ".join(f"{dl.fig('GNMR+e 3', 'risk_topk', window=w):.2f}" for w in dl.windows)
    update = [x for s in all_ for x in _update_signals(s)]
    steps = [s.setup["steps"] for s in all_]
    return paragraph(
        f"**Across the {len(all_)} regimes**: at this scale ({span(steps, 'd')} steps, "
        f"{len(all_[0].seeds)} seeds) the held-out loss cannot tell any two precision policies "
        f"apart, not even the static paths (static gaps {', '.join(gaps)}, "
        f"{'none resolved' if none else 'some resolved'})"
        + (
            ", so no budgeted policy beats random-k or first+last by more than the interval "
            "anywhere."
            if all(s.beats_nothing() for s in all_)
            else "."
        ),
        f"What can be measured is selection: GNMR+e's risk finds {risk} of the top-3 units by "
        f"measured gradient gap ({', '.join(sw)}), {fault} inside the outlier fault and {spikes} "
        f"inside the two delayed-scaling spikes, where the seed's GNMR finds {seed}. Against the "
        f"update gap every signal is {'weak' if max(update) < SELECTION_BAR else 'mixed'} "
        f"({span(update)}).",
    )
