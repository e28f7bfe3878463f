"""RESULTS.md's seed-experiment section (issue 8): the three experiments of
:mod:`benchmarks.seed`, read from ``results/act_quant.json``, ``fp6_fp8.json`` and
``lora_int8.json``; their tables and target lines are :mod:`benchmarks.harness.verdicts`'s."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from benchmarks.harness.arms import ArmResult
from benchmarks.harness.verdicts import SEED_EXCEEDANCE, TIME_RATIO, TOLERANCE, table, targets
from benchmarks.results_md.source import Source
from benchmarks.results_md.words import bash, listing, paragraph, span

EXPERIMENTS = ("act_quant", "fp6_fp8", "lora_int8")
REFERENCE = {"act_quant": "full", "fp6_fp8": "full", "lora_int8": "recovery"}
"""The policy of the arm each experiment's losses are relative to (as its command prints them)."""


class Experiment:
    """One experiment's JSON file: its set-up, arms and results."""

    def __init__(self, src: Source, name: str, number: int) -> None:
        self.name, self.number = name, number
        self.r: dict[str, Any] = src.json(name)
        self.setup: dict[str, Any] = self.r["setup"]
        self.arms = {a["name"]: a for a in self.r["arms"]}
        self.results = [ArmResult(**r) for r in self.r["results"]]
        self.by = {r.name: r for r in self.results}

    def first(self, policy: str) -> str:
        """The first arm of ``policy``."""
        return next(r.name for r in self.results if r.policy == policy)

    @cached_property
    def gnmr(self) -> str:
        return self.first("gnmr")

    @cached_property
    def reference(self) -> str:
        return self.first(REFERENCE[self.name])

    @cached_property
    def low(self) -> str:
        """The static arm on GNMR's low-cost path."""
        want = self.arms[self.gnmr]["low_cost"]
        return next(
            r.name
            for r in self.results
            if r.policy == "static" and self.arms[r.name]["low_cost"] == want
        )

    def rel(self, arm: str) -> float:
        """Held-out loss over the reference arm's, minus 1."""
        return self.by[arm].heldout_loss / self.by[self.reference].heldout_loss - 1

    def rel_text(self, arm: str) -> str:
        return f"{100 * self.rel(arm):+.2f}%"

    def ratio(self, arm: str, to: str | None = None) -> float:
        """Median step time over the static low-cost arm's (or ``to``'s)."""
        return self.by[arm].step_ms / self.by[to or self.low].step_ms

    def recovery(self, arm: str) -> str:
        return f"{100 * self.by[arm].recovery_rate:.2f}%"

    @property
    def units(self) -> int:
        return self.by[self.gnmr].units

    @property
    def budget(self) -> int:
        return self.by[self.gnmr].max_active

    def tight(self) -> list[str]:
        """GNMR arms with thresholds of their own (``controller`` overrides alpha)."""
        return [n for n, a in self.arms.items() if "alpha" in (a.get("controller") or {})]

    def policy_text(self) -> str:
        g = self.setup["gnmr"]
        return (
            f"policy alpha {g['alpha']:g}, beta {g['beta']:g}, window {g['window']}, warm-up "
            f"{g['warmup_steps']}, lock {g['lock_steps']}"
        )

    def command(self) -> str:
        return bash(f".venv/bin/python -m benchmarks.seed.{self.name}     # {self.r['date']}")

    def blocks(self, src: Source) -> list[str]:
        """The table (and the target lines where the command prints them) and the plot."""
        text = table(self.results, self.reference, self.low)
        if self.name != "fp6_fp8":
            text += "\n\n" + targets(self.results, self.reference, self.low, self.gnmr)
        return [text, src.image(self.name, f"{self.name}.png")]

    def quality(self) -> tuple[bool, bool]:
        """(the static low-cost arm is worse than the reference by more than the tolerance,
        GNMR is within it)."""
        return self.rel(self.low) > TOLERANCE, abs(self.rel(self.gnmr)) <= TOLERANCE


def render(src: Source) -> list[str]:
    ex = [Experiment(src, name, i) for i, name in enumerate(EXPERIMENTS, 1)]
    return [
        "## Seed experiments, one seed each (issue 8)",
        intro(ex),
        targets_text(ex),
        *act_quant(src, ex[0]),
        *fp6_fp8(src, ex[1]),
        *lora_int8(src, ex[2]),
    ]


def intro(ex: list[Experiment]) -> str:
    first = ex[0]
    dates = listing(sorted({e.r["date"] for e in ex}))
    interleaved = all(e.r["interleaved"] for e in ex)
    z = first.arms[first.first("zclip")]["z_thresh"]
    return paragraph(
        f"Measured on {dates} on this project's CPU machine. Each experiment command trains every "
        "arm in one process from the same initial weights on the same batches in the same order"
        + (
            ", interleaving the arms step by step so that step-time ratios share the machine's "
            "load;"
            if interleaved
            else ";"
        ),
        "it prints the table and the target lines below (verbatim) and writes "
        "`benchmarks/results/<name>.json` (every arm's per-step losses, evaluations, per-unit "
        "exceedance and recovery counts) and `<name>.png` (training and held-out loss curves). "
        "Arms: full precision (FP32 here), the backend's recovery path everywhere (static "
        "high-precision), its low-cost path everywhere (static low-cost), GNMR with a budget of "
        f"{first.budget} of the {first.units} units, Megatron's static recipe (first and last "
        "transformer layers on the recovery path) and a ZClip-style global gradient-norm spike "
        "guard on the low-cost path (an EMA of the global norm's mean and variance; a norm more "
        f"than {z:g} standard deviations above the mean is clipped to that bound). Exceedance: the "
        "share of eligible unit-steps after warm-up whose risk `max(GNMR / alpha, dGNMR / beta)` "
        "is above 1, measured with the same thresholds in every arm (only GNMR arms act on it). "
        "Recovery: the share of eligible unit-steps whose forward ran the recovery path, read "
        "from the backend's report.",
    )


def targets_text(ex: list[Experiment]) -> str:
    fast = all(e.ratio(e.gnmr) <= TIME_RATIO for e in ex)
    worse = [e for e in ex if e.quality()[0]]
    missed = [str(e.number) for e in worse if not e.quality()[1]]
    met = [str(e.number) for e in worse if e.quality()[1]]
    trivial = [str(e.number) for e in ex if not e.quality()[0]]
    parts = []
    if missed:
        parts.append(
            f"is missed in the experiments where the low-cost arm is worse ({listing(missed)})"
        )
    if met:
        parts.append(f"is met in {listing(met)}")
    if trivial:
        parts.append(
            f"holds only trivially in {listing(trivial)} (nothing is worse there)"
            if all(e.quality()[1] for e in ex if str(e.number) in trivial)
            else f"cannot be judged in {listing(trivial)} (nothing is worse there)"
        )
    low_use = all(e.by[e.gnmr].recovery_rate < e.budget / e.units / 2 for e in ex)
    tight = {n for e in ex for n in e.tight()}
    rates = [100 * r.exceedance_rate for e in ex for r in e.results if r.name not in tight]
    tight_rates = listing(
        [f"{100 * e.by[n].exceedance_rate:.1f}% for the `{n}` arm" for e in ex for n in e.tight()]
    )
    return paragraph(
        f"Targets (issue 8), plainly: the step-time target (GNMR / low-cost <= {TIME_RATIO}) is "
        f'{"met everywhere" if fast else "not met everywhere"}; "GNMR within '
        f"{100 * TOLERANCE:.0f}% of the high-precision arm while the static low-cost arm is "
        f"worse\" {' and '.join(parts)}; GNMR's recovery rate is "
        f"{'far below' if low_use else 'not far below'} its budget at thresholds that keep "
        f"healthy exceedances near the seed's {100 * SEED_EXCEEDANCE:.1f}%; exceedance rates of "
        f"{span(rates, '.2f', '%')} are reported next to the seed's < "
        f"{100 * SEED_EXCEEDANCE:.1f}%"
        + (f" ({tight_rates}, at its own lower thresholds)." if tight_rates else "."),
        "These are small models trained for a few hundred steps; the seed's results are on "
        "LLaMA-2, whose GPU-scale configs are in `configs/`.",
    )


def _llama(e: Experiment) -> str:
    s = e.setup
    return f"{s['layers']} layers x {s['hidden']} ({e.units} projection units)"


def act_quant(src: Source, e: Experiment) -> list[str]:
    s, g = e.setup, e.arms[e.gnmr]
    tight = e.tight()
    fp32 = e.by[e.reference]
    lowered = ""
    if tight:
        c = e.arms[tight[0]]["controller"]
        same = c["alpha"] == c.get("beta")
        lowered = (
            f"The arm `{tight[0]}` lowers "
            + (f"both thresholds to {c['alpha']:g}" if same else "its thresholds")
            + " so that the budget is spent."
        )
    head = paragraph(
        f"A Llama of {_llama(e)} pretrained from scratch for {s['steps']} steps of {s['batch']} x "
        f"{s['seq_len']} byte tokens on the embedded corpus; held-out loss on "
        f"{s['eval_batches']} batches of the held-out split. Every projection saves its input for "
        f"backward at {g['low_cost']['bits']} bits (the stress knob `--bits`; one (min, scale) "
        f"pair per {g['low_cost']['group_size']} values, `--group-size`) on the low-cost path and "
        f"{g['recovery']['bits']} bits on the recovery path. GNMR budget {e.budget} of {e.units} "
        f"units; {e.policy_text()}, calibrated so that an FP32 run crosses the thresholds rarely "
        f"(this run's FP32 arm: {100 * fp32.exceedance_rate:.3f}% of unit-steps).",
        lowered,
    )
    statics = [r.name for r in e.results if r.policy in ("static", "recovery")]
    hurt = [n for n in statics if e.rel(n) > TOLERANCE]
    zclip = e.first("zclip")
    fl = e.first("first_last")
    z_same = f"{e.by[zclip].heldout_loss:.4f}" == f"{e.by[e.low].heldout_loss:.4f}"
    kept = [e.by[n].recovery_rate for n in (*tight, fl)]
    low_worse, within = e.quality()
    tail = (
        f"the ZClip-style guard ({e.by[zclip].clipped_steps} clipped steps, in the JSON) ends "
        + (f"where {e.low} does." if z_same else f"at {e.rel_text(zclip)}.")
    )
    discussion = paragraph(
        f"Low-bit saved activations {'measurably hurt' if hurt else 'do not measurably hurt'} at "
        "this scale ("
        + ", ".join(f"{n} {e.rel_text(n)}" for n in statics)
        + f" held-out loss over {e.reference}). GNMR "
        + ("closes" if within else "does not close")
        + " the gap: at the calibrated thresholds it "
        f"{'acts rarely' if e.by[e.gnmr].recovery_rate < 0.05 else 'acts'} (recovery "
        f"{e.recovery(e.gnmr)} of unit-steps, exceedance {100 * e.by[e.gnmr].exceedance_rate:.3f}% "
        f"against the seed's < {100 * SEED_EXCEEDANCE:.1f}%) and ends at {e.rel_text(e.gnmr)};"
        + "".join(
            f" with thresholds low enough to spend the whole budget (recovery {e.recovery(n)}) it "
            f"ends at {e.rel_text(n)};"
            for n in tight
        )
        + f" Megatron's first-and-last-layers recipe ({100 * e.by[fl].recovery_rate:.0f}% of "
        f"unit-steps at {g['recovery']['bits']} bits) ends at {e.rel_text(fl)}, and {tail}",
        f"Keeping any {span([100 * x for x in kept], '.0f', '%')} of the units at "
        f"{g['recovery']['bits']} bits buys little because the quantization error is spread evenly "
        "over every projection and every step (it only enters the weight gradients), not "
        "concentrated in a few units for a few steps, which is the situation GNMR is built for; "
        'the seed\'s "GNMR reaches 8-bit/BF16 perplexity" is '
        + ("not reproduced" if low_worse and not within else "not tested")
        + " at this scale.",
        f"The step-time target (GNMR / {e.low} <= {TIME_RATIO}) is "
        f"{'met' if e.ratio(e.gnmr) <= TIME_RATIO else 'missed'}: {e.ratio(e.gnmr):.3f}.",
    )
    return [
        "### 1. Activation-quantization stress (docs/algorithm.md#activation-quantization-stress)",
        e.command(),
        head,
        *e.blocks(src),
        discussion,
    ]


def fp6_fp8(src: Source, e: Experiment) -> list[str]:
    g = e.arms[e.gnmr]
    rec, low = g["recovery"], g["low_cost"]
    head = paragraph(
        f"The same Llama, {e.setup['steps']} steps, with the `fp8_emulated` backend: all three "
        "GEMMs of every projection (forward, dgrad, wgrad) take inputs rounded to the format, "
        f"accumulated in fp32. Recovery path: FP8 {rec['format']} with DeepSeek-V3's block scales "
        f"(1 x {rec['block']} activations and gradients, {rec['block']} x {rec['block']} weights). "
        "The plain FP6 recipe (e2m3 for x and W, e3m2 for gradients, the same block scales; "
        "`--stress none`) trained like FP8 in probes, so the default stress knob `--stress "
        f"tensor` puts one scale per {low['granularity']} and {low['grad_format']} on the "
        f"gradients too on the low-cost path. GNMR budget {e.budget} of {e.units} units; "
        f"{e.policy_text()}.",
    )
    fixed8 = e.first("recovery")
    fl, zclip = e.first("first_last"), e.first("zclip")
    share = (e.rel(e.low) - e.rel(e.gnmr)) / e.rel(e.low)
    fl_better = e.rel(fl) < e.rel(e.gnmr)
    z = e.by[zclip]
    z_text = (
        f"The ZClip-style guard never fired (0 clipped steps in the JSON), so it equals {e.low}."
        if z.clipped_steps == 0
        else f"The ZClip-style guard clipped {z.clipped_steps} steps and ends at "
        f"{e.rel_text(zclip)}."
    )
    discussion = paragraph(
        f"Per-tensor-scaled FP6 is {'clearly worse' if e.quality()[0] else 'not worse'} "
        f"({100 * e.rel(e.low):+.1f}% held-out loss over FP32, FP8 {100 * e.rel(fixed8):+.1f}%), "
        f"and GNMR with a {e.budget}-unit budget recovers {100 * share:.0f}% of that gap "
        f"({100 * e.rel(e.gnmr):+.1f}%) while running {100 * e.by[e.gnmr].recovery_rate:.1f}% of "
        f"unit-steps in FP8. Megatron's static recipe, first and last layers in FP8, does "
        f"{'much better' if fl_better else 'no better'} here ({100 * e.rel(fl):+.1f}%), at "
        f"{100 * e.by[fl].recovery_rate:.0f}% of unit-steps on the recovery path"
        + (
            ": the damage of a uniformly coarse format is spread over every unit and every step, "
            f"not local and transient, so a {e.budget}-unit budget cannot remove it."
            if fl_better
            else "."
        ),
        f'The target "GNMR within {100 * TOLERANCE:.0f}% of the high-precision arm" is '
        f"{'met' if e.quality()[1] else 'missed'}.",
        z_text,
        f"Step times: the emulation is about {1 / e.ratio(e.reference):.1f}x slower than FP32 on a "
        f"CPU and FP6 costs what FP8 costs ({fixed8} / {e.low}: {e.ratio(fixed8):.3f}), so these "
        "ratios say nothing about FP6/FP8 hardware throughput; GNMR over "
        f"{e.low} is {e.ratio(e.gnmr):.3f}.",
    )
    return [
        "### 2. DeepSeek-style dynamic precision, FP6 -> FP8 "
        "(docs/algorithm.md#dynamic-fp6-to-fp8-pretraining)",
        e.command(),
        head,
        *e.blocks(src),
        discussion,
    ]


def lora_int8(src: Source, e: Experiment) -> list[str]:
    s, g = e.setup, e.arms[e.gnmr]
    domain = s["data"].rpartition(":")[2]
    base = s["init_from"].removeprefix("benchmarks/")
    head = paragraph(
        f"Experiment 1's FP32 model (`{base}`; the command pretrains it when missing) fine-tuned "
        f"with peft LoRA (rank {s['lora_rank']} on all projections, base frozen) for {s['steps']} "
        f"steps on one domain the pretraining never read (`{domain}/`, checked by the command). "
        "The int8 backend runs the frozen base GEMMs in W8A8; stress knob `--granularity "
        f"{g['low_cost']['weight_granularity']}` (one int8 scale per weight matrix and per "
        "activation tensor, the coarsest the backend has). GNMR budget "
        f"{e.budget} of {e.units} units.",
    )
    losses = [r.heldout_loss for r in e.results]
    spread = 100 * (max(losses) / min(losses) - 1)
    low_worse, _ = e.quality()
    bf16 = e.reference
    faster = e.ratio(bf16) < 1
    discussion = paragraph(
        f"Every arm fine-tunes on the new domain and all {len(losses)} end within {spread:.1f}% of "
        "each other"
        + (
            ": per-tensor int8 rounding of a small model without outlier features costs nothing "
            "measurable, so there is nothing for GNMR to recover (it recovered "
            f"{e.recovery(e.gnmr)} of unit-steps), and the seed's result (GNMR reaches BF16 "
            "quality where INT8 does not) is neither confirmed nor refuted here."
            if not low_worse
            else "."
        ),
        "The seed's INT8 stress comes from LLaMA-2's activation outliers. On this CPU the BF16 "
        f"path is {'faster' if faster else 'slower'} than the int8 one (no int8 tensor cores), so "
        "the step-time column is not a GPU forecast.",
    )
    return [
        "### 3. LoRA fine-tuning stress, INT8 vs GNMR INT8/BF16 "
        "(docs/algorithm.md#lora-fine-tuning-with-int8)",
        e.command(),
        head,
        *e.blocks(src),
        discussion,
    ]
