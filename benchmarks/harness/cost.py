"""Cost at matched loss (issue 35): each arm's effective speed-up over BF16 once its loss is paid.

Throughput alone hides the loss a low-precision recipe costs. This module turns a branch sweep's
records (:mod:`benchmarks.harness.branch`, by (arm, seed, point)) into one figure per arm and
hardware: how much faster than BF16 the arm reaches the loss BF16 reaches after the branch's
``horizon`` steps. Per (seed, branch point), with ``h_a(e)`` arm ``a``'s held-out loss ``e``
steps into the branch, ``H`` the horizon (50) and ``E`` the evaluation before it (25)::

    r = (h_BF16(E) - h_BF16(H)) / (H - E)      the trunk's local rate of progress (nats / step)
    g = h_arm(H) - h_BF16(H)                   the arm's held-out gap to BF16
    D = g / r                                  steps it must add to match BF16 (< 0: it is ahead)
    s = flops_recovered                        share of the linear-layer GEMM FLOPs on recovery
    t = (1 - s) / R(low) + s / R(recovery)     one step's time against BF16 on the hardware
    S = H / ((H + D) * t)                      effective speed-up over BF16 at matched loss

``R(format)`` is the hardware's peak dense GEMM throughput of the format relative to BF16
(:data:`THROUGHPUT`). ``S`` is 1 for the BF16 arm by construction and ``R(low)`` for a low-cost
path with no loss gap. A seed's figure is the mean over its branch points; the estimate and its
95% Student-t interval are taken over seeds (the figure is propagated per seed, then the
interval), as every other branch figure (:mod:`benchmarks.harness.branch_stats`).

Undefined cases (``r <= 0`` with a nonzero gap, ``H + D <= 0``, a non-finite loss) are reported,
never divided through; a format the hardware has no GEMMs for is ``n/a``; a path that does not
change GEMM throughput (``act_quant``) or whose format is not in the table is ``not priced``;
``int8`` (the LoRA experiment's frozen base) is priced from :data:`INT8_RATE`.
Records without ``flops_recovered`` fall back to the unit-step share (:func:`flops_share`). The
assumptions are :func:`assumptions`, printed beside the table. No torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.harness.branch_stats import Design, Records
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.stats import interval

__all__ = [
    "FORMAT_CLASS",
    "HARDWARE",
    "INT8_RATE",
    "THROUGHPUT",
    "TORCHAO_GEMMS",
    "BranchCost",
    "Formats",
    "Price",
    "SeedCost",
    "assumptions",
    "branch_cost",
    "cost_table",
    "extra_steps",
    "flops_share",
    "local_rate",
    "price",
    "seed_costs",
    "speedup",
    "step_time",
    "summarize_costs",
]

HARDWARE = ("B200", "GB300", "Hopper")
"""The cost models, in the table's column order (Hopper: H100 / H200)."""

THROUGHPUT: dict[str, dict[str, float]] = {
    "B200": {"FP4": 4.0, "FP6": 2.0, "FP8": 2.0, "BF16": 1.0},
    "GB300": {"FP4": 6.0, "FP6": 2.0, "FP8": 2.0, "BF16": 1.0},
    "Hopper": {"FP8": 2.0, "BF16": 1.0},
}
"""Peak dense GEMM throughput of each format class relative to BF16 (/work/shared/STACK-FACTS.md:
B200 / GB200 NVFP4 : FP8 : BF16 = 4 : 2 : 1, GB300 6 : 2 : 1, Hopper FP8 : BF16 2 : 1 and no FP4
GEMMs). Blackwell runs FP6 at the FP8 rate; every FP4 (NVFP4, MXFP4, per-tensor E2M1) at the FP4
rate. A class missing from a hardware's entry has no GEMMs there."""

FORMAT_CLASS = {
    "e2m1": "FP4",
    "e2m3": "FP6",
    "e3m2": "FP6",
    "e4m3": "FP8",
    "e5m2": "FP8",
    "bf16": "BF16",
    "fp16": "BF16",
}
"""The ``fp8_emulated`` formats (:mod:`gnmr_dist.backends.emulated_options`) by the throughput
class their GEMMs run at (fp16 at the BF16 rate). ``fp32`` is not in the table."""

TORCHAO_GEMMS: dict[str, tuple[str, str, str]] = {
    "tensorwise": ("FP8", "FP8", "FP8"),
    "rowwise": ("FP8", "FP8", "FP8"),
    "rowwise_with_gw_hp": ("FP8", "FP8", "BF16"),
    "bf16": ("BF16", "BF16", "BF16"),
}
"""The ``torchao_fp8`` recipes (:mod:`gnmr_dist.backends.torchao_options`) by the throughput
class of their fprop, dgrad and wgrad GEMMs: ``tensorwise`` multiplies e4m3 x and W with e5m2 dy
(both FP8), ``rowwise`` e4m3 throughout, ``rowwise_with_gw_hp`` keeps wgrad in high precision
(BF16 here), ``"bf16"`` runs torchao off. The MX recipes, which the backend refuses, are not
priced."""

_DEFAULT_FORMAT = {"low_cost": "e4m3", "recovery": "bf16"}
"""The ``fp8_emulated`` backend's default ``format`` of each path."""

INT8_RATE: dict[str, float] = {"B200": 2.0, "Hopper": 2.0}
"""Peak dense INT8 GEMM throughput relative to BF16 (NVIDIA's datasheets: H100 SXM 1,979 TOPS
INT8 against 989 TFLOPS BF16; B200 4.5 POPS INT8 against 2.25 PFLOPS BF16). GB300 (Blackwell
Ultra) cut its INT8 rate and the figure is not recorded here: the int8 backend is not priced
there."""

_NOT_GEMM = {
    "act_quant": "act_quant quantizes the saved activations (a memory saving); its GEMMs run in "
    "the model's dtype on both paths, so GEMM throughput does not change",
}
"""Backends whose low-cost path does not change GEMM throughput, and why."""


class _RegimeLike(Protocol):
    backend: str
    low_cost: Mapping[str, Any]
    recovery: Mapping[str, Any]


@dataclass(frozen=True)
class Formats:
    """A regime's backend and its two paths' option blocks (what the cost model prices)."""

    backend: str
    low_cost: Mapping[str, Any]
    recovery: Mapping[str, Any]

    @classmethod
    def of(cls, regime: _RegimeLike) -> Formats:
        """The formats of a :class:`benchmarks.sweep.regimes.Regime` (or anything with its
        ``backend``, ``low_cost`` and ``recovery``)."""
        return cls(regime.backend, dict(regime.low_cost), dict(regime.recovery))


@dataclass(frozen=True)
class Price:
    """One hardware's relative time per linear-layer GEMM FLOP against BF16 of the two paths
    (``1 / R``), or why there is none (``note``: ``n/a (...)`` or ``not priced: ...``)."""

    low: float | None = None
    recovery: float | None = None
    note: str | None = None


@dataclass(frozen=True)
class BranchCost:
    """One (arm, seed, point): the rate, gap, extra steps, step time and speed-up; ``None``
    figures with a ``note`` where the conversion is undefined or the path is not priced."""

    rate: float
    gap: float
    flops_recovered: float
    extra_steps: float | None
    time: float | None
    speedup: float | None
    note: str | None = None


@dataclass(frozen=True)
class SeedCost:
    """One seed of one arm: the means over its branch points (``None`` with a ``note`` when a
    branch's figure is undefined or the formats are not priced)."""

    seed: int
    flops_recovered: float
    extra_steps: float | None
    time: float | None
    speedup: float | None
    note: str | None = None
    fallbacks: int = 0
    """Branches whose FLOP share fell back to the unit-step share (old records)."""


# -- pricing -----------------------------------------------------------------------------------


def _path_time(options: Mapping[str, Any], role: str, hardware: str) -> float | str:
    """A path's time per FLOP against BF16 (``1 / R``), or a note. Its three GEMMs (fprop
    ``x W``, dgrad ``dy W``, wgrad ``x dy``: equal FLOPs) each run at the slower of their two
    operands' rates (``format`` for ``x`` and ``W``, ``grad_format`` for ``dy``); the path's
    time is their mean."""
    fmt = str(options.get("format", _DEFAULT_FORMAT[role]))
    grad = str(options.get("grad_format") or fmt)
    rates = THROUGHPUT[hardware]
    classes = {}
    for name in (fmt, grad):
        if name not in FORMAT_CLASS:
            return f"not priced: {name} GEMMs are not in the cost table"
        if FORMAT_CLASS[name] not in rates:
            return f"n/a (no {FORMAT_CLASS[name]} GEMMs)"
        classes[name] = rates[FORMAT_CLASS[name]]
    fprop = classes[fmt]
    backward = min(classes[fmt], classes[grad])
    return (1 / fprop + 2 / backward) / 3


def _int8_price(formats: Formats, hardware: str) -> Price:
    """The ``int8`` backend (frozen base weights, W8A8): its low-cost path runs fprop as an INT8
    GEMM and dgrad in high precision on the dequantized weight; a frozen weight has no wgrad.
    Two equal-FLOP GEMMs per base product, so ``1 / R(low) = (1 / R(INT8) + 1) / 2``; recovery
    runs both in BF16."""
    dtype = str(formats.recovery.get("dtype", "bf16"))
    if dtype != "bf16":
        return Price(note=f"not priced: int8's {dtype} recovery GEMMs are not in the cost table")
    if hardware not in INT8_RATE:
        return Price(note=f"not priced: {hardware}'s INT8 rate is not in the cost table")
    return Price((1 / INT8_RATE[hardware] + 1) / 2, 1.0)


def _torchao_time(options: Mapping[str, Any], role: str, hardware: str) -> float | str:
    """A ``torchao_fp8`` path's time per FLOP against BF16: the mean of its three equal-FLOP
    GEMMs' ``1 / R`` (:data:`TORCHAO_GEMMS`), or a note."""
    recipe = str(options.get("recipe", "tensorwise" if role == "low_cost" else "bf16"))
    if recipe not in TORCHAO_GEMMS:
        return f"not priced: torchao's {recipe} GEMMs are not in the cost table"
    rates = THROUGHPUT[hardware]
    missing = [c for c in TORCHAO_GEMMS[recipe] if c not in rates]
    if missing:
        return f"n/a (no {missing[0]} GEMMs)"
    return sum(1 / rates[c] for c in TORCHAO_GEMMS[recipe]) / 3


def price(formats: Formats, hardware: str) -> Price:
    """The two paths' time per linear-layer GEMM FLOP against BF16 on ``hardware`` (one of
    :data:`HARDWARE`), or the note saying why they are not priced."""
    if hardware not in THROUGHPUT:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(THROUGHPUT)}")
    if formats.backend in _NOT_GEMM:
        return Price(note=f"not priced: {_NOT_GEMM[formats.backend]}")
    if formats.backend == "int8":
        return _int8_price(formats, hardware)
    if formats.backend == "torchao_fp8":
        low = _torchao_time(formats.low_cost, "low_cost", hardware)
        rec = _torchao_time(formats.recovery, "recovery", hardware)
        for t in (low, rec):
            if isinstance(t, str):
                return Price(note=t)
        return Price(float(low), float(rec))
    if formats.backend != "fp8_emulated":
        note = f"not priced: the {formats.backend} backend's formats are not in the cost table"
        return Price(note=note)
    low = _path_time(formats.low_cost, "low_cost", hardware)
    if isinstance(low, str):
        return Price(note=low)
    rec = _path_time(formats.recovery, "recovery", hardware)
    if isinstance(rec, str):
        return Price(note=rec)
    return Price(low, rec)


# -- the model, one branch ---------------------------------------------------------------------


def local_rate(early_loss: float, final_loss: float, steps: int) -> float:
    """The trunk's local rate of progress (nats per step) between two held-out measurements
    ``steps`` apart (positive while the loss falls)."""
    return (early_loss - final_loss) / steps


def extra_steps(gap: float, rate: float) -> float | None:
    """Steps an arm ``gap`` nats behind must add to match the reference at ``rate`` nats per
    step (negative when it is ahead); ``None`` where it is undefined: a nonzero gap and no
    measurable progress (``rate <= 0``). No gap needs no steps whatever the rate."""
    if gap == 0:
        return 0.0
    if not rate > 0:
        return None
    return gap / rate


def step_time(share: float, p: Price) -> float:
    """One step's linear-layer GEMM time against BF16 with ``share`` of the FLOPs on the
    recovery path: ``(1 - s) / R(low) + s / R(recovery)``."""
    if p.low is None or p.recovery is None:
        raise ValueError(f"the paths are not priced: {p.note}")
    return (1 - share) * p.low + share * p.recovery


def speedup(horizon: int, extra: float, time: float) -> float | None:
    """``horizon / ((horizon + extra) * time)``: the speed-up over BF16 at matched loss; ``None``
    when ``horizon + extra <= 0`` (ahead by more than the horizon's progress: outside the
    linear model)."""
    steps = horizon + extra
    if not steps > 0:
        return None
    return horizon / (steps * time)


def flops_share(record: Mapping[str, Any]) -> tuple[float, bool]:
    """A branch's share of linear-layer GEMM FLOPs on the recovery path, and whether it fell
    back to ``recovered_unit_steps / unit_steps`` (records written before ``flops_recovered``
    existed; exact only when recovery is per unit and every unit has the same FLOPs)."""
    if record.get("flops_recovered") is not None:
        return float(record["flops_recovered"]), False
    return record["recovered_unit_steps"] / record["unit_steps"], True


def _early(ref: Mapping[str, Any], horizon: int) -> int:
    """The held-out measurement before the horizon (25 of 50) in the reference's record."""
    earlier = [int(k) for k in ref["heldout"] if int(k) < horizon]
    if not earlier:
        raise ValueError(f"the reference branch has no held-out loss before step {horizon}")
    return max(earlier)


def branch_cost(
    arm: Mapping[str, Any], ref: Mapping[str, Any], horizon: int, p: Price
) -> BranchCost:
    """The model on one branch: ``arm``'s record against the reference (BF16) branch ``ref`` of
    the same seed and point."""
    early = _early(ref, horizon)
    h_ref = float(ref["heldout"][str(horizon)])
    rate = local_rate(float(ref["heldout"][str(early)]), h_ref, horizon - early)
    gap = float(arm["heldout"][str(horizon)]) - h_ref
    share, _ = flops_share(arm)
    if not (math.isfinite(rate) and math.isfinite(gap)):
        return BranchCost(rate, gap, share, None, None, None, "undefined: a loss is not finite")
    extra = extra_steps(gap, rate)
    if extra is None:
        note = "undefined: no measurable progress (r <= 0)"
        return BranchCost(rate, gap, share, None, None, None, note)
    if p.note is not None:
        return BranchCost(rate, gap, share, extra, None, None, p.note)
    t = step_time(share, p)
    s = speedup(horizon, extra, t)
    if s is None:
        note = "undefined: ahead by more than the horizon's progress"
        return BranchCost(rate, gap, share, extra, t, None, note)
    return BranchCost(rate, gap, share, extra, t, s)


# -- per seed, per arm -------------------------------------------------------------------------


def _complete(records: Records, d: Design, arm: str) -> bool:
    return all((arm, s, p) in records for s in d.seeds for p in d.points)


def _arms(records: Records, d: Design, arms: Sequence[str] | None) -> list[str]:
    """The arms asked for (or every arm in the records, in their order) with every branch."""
    names = list(arms) if arms is not None else list(dict.fromkeys(a for a, _, _ in records))
    return [a for a in names if _complete(records, d, a)]


def _mean(values: Sequence[float | None]) -> float | None:
    if any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


def seed_costs(
    records: Records,
    d: Design,
    formats: Formats,
    hardware: str,
    arms: Sequence[str] | None = None,
) -> dict[str, list[SeedCost]]:
    """Per arm with every branch done (``arms``: those, else every arm in the records), per seed
    of ``d``: the means over the seed's branch points of the FLOP share, the extra steps to
    match ``d.high`` (BF16), the step time and the speed-up on ``hardware``. A seed any of whose
    branches is undefined gets ``None`` figures and the first such branch's note. Nothing when
    the reference arm is incomplete."""
    if not _complete(records, d, d.high):
        return {}
    p = price(formats, hardware)
    out: dict[str, list[SeedCost]] = {}
    for arm in _arms(records, d, arms):
        rows = []
        for seed in d.seeds:
            costs = [
                branch_cost(records[(arm, seed, pt)], records[(d.high, seed, pt)], d.horizon, p)
                for pt in d.points
            ]
            fallbacks = sum(flops_share(records[(arm, seed, pt)])[1] for pt in d.points)
            undefined = [
                f"{c.note} at point {pt}"
                for c, pt in zip(costs, d.points, strict=True)
                if c.note is not None and c.note.startswith("undefined")
            ]
            note = undefined[0] if undefined else p.note
            rows.append(
                SeedCost(
                    seed,
                    statistics.fmean(c.flops_recovered for c in costs),
                    _mean([c.extra_steps for c in costs]),
                    _mean([c.time for c in costs]),
                    _mean([c.speedup for c in costs]),
                    note,
                    fallbacks,
                )
            )
        out[arm] = rows
    return out


def _figure(values: Sequence[float | None]) -> tuple[float, float] | None:
    """Mean and 95% half-width over seeds, ``None`` when any seed's figure is undefined."""
    if not values or any(v is None for v in values):
        return None
    return interval([v for v in values if v is not None])


def summarize_costs(
    records: Records,
    d: Design,
    formats: Formats,
    hardware: Sequence[str] = HARDWARE,
    arms: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per arm: the mean FLOP share, the extra steps to match BF16 (mean, 95% half-width over
    seeds), the branches whose share fell back to unit-steps, and per hardware the speed-up at
    matched loss and the step time (mean, 95% half-width over seeds; ``None`` with a ``note``
    when undefined or not priced) and the per-seed speed-ups."""
    out: dict[str, dict[str, Any]] = {}
    for hw in hardware:
        for arm, rows in seed_costs(records, d, formats, hw, arms).items():
            undefined = [f"seed {r.seed}: {r.note}" for r in rows if r.extra_steps is None]
            row = out.setdefault(
                arm,
                {
                    "flops_recovered": statistics.fmean(r.flops_recovered for r in rows),
                    "flops_from_unit_steps": sum(r.fallbacks for r in rows),
                    "extra_steps": _figure([r.extra_steps for r in rows]),
                    "extra_steps_note": undefined[0] if undefined else None,
                    "hardware": {},
                },
            )
            speed = _figure([r.speedup for r in rows])
            notes = [f"seed {r.seed}: {r.note}" for r in rows if r.speedup is None and r.note]
            p_note = price(formats, hw).note
            row["hardware"][hw] = {
                "speedup": speed,
                "time": _figure([r.time for r in rows]),
                "per_seed": [r.speedup for r in rows],
                "note": None if speed is not None else (p_note or (notes[0] if notes else None)),
            }
    return out


# -- the table and its assumptions -------------------------------------------------------------


def _cell(pair: tuple[float, float] | None, note: str | None, digits: int = 2) -> str:
    if pair is None:
        return note or "-"
    m, h = pair
    if math.isnan(h):
        return f"{m:.{digits}f} (one seed)"
    return f"{m:.{digits}f} +- {h:.{digits}f}"


def cost_table(
    summary: Mapping[str, Mapping[str, Any]],
    hardware: Sequence[str] = HARDWARE,
    details: bool = True,
) -> str:
    """One row per arm of :func:`summarize_costs`, one column per hardware: the speed-up over
    BF16 at matched loss (``2.31 +- 0.12``, or the note: ``n/a (no FP4 GEMMs)``, ``not priced:
    ...``, ``undefined ...``). ``details``: also the recovered share of GEMM FLOPs and the extra
    steps to match BF16 (hardware-independent)."""
    header = ["arm"]
    if details:
        header += ["recovered GEMM FLOPs", "extra steps to match BF16"]
    header += [f"speed-up at matched loss, {hw}" for hw in hardware]
    rows = []
    for arm, r in summary.items():
        cells = [arm]
        if details:
            flops = f"{100 * r['flops_recovered']:.1f}%"
            if r["flops_from_unit_steps"]:
                flops += " (unit-steps)"
            cells += [flops, _cell(r["extra_steps"], r["extra_steps_note"], 1)]
        for hw in hardware:
            c = r["hardware"].get(hw)
            cells.append("-" if c is None else _cell(c["speedup"], c["note"]))
        rows.append(cells)
    return markdown_table(header, rows)


def assumptions(formats: Formats | None = None, horizon: int = 50, early: int = 25) -> list[str]:
    """The cost model's assumptions, one line each, to print beside :func:`cost_table` (with
    ``formats``: also which formats were priced and at what rates)."""
    lines = [
        f"Speed-up over BF16 at matched loss: S = H / ((H + D) * t), H = {horizon} steps; D = "
        f"g / r, g the arm's held-out gap to BF16 after H steps, r = (h_BF16({early}) - "
        f"h_BF16({horizon})) / {horizon - early} the trunk's local rate of progress on the same "
        "branch; t = (1 - s) / R(low) + s / R(recovery), s the recovered share of linear-layer "
        "GEMM FLOPs. Per branch, mean over a seed's branch points, 95% Student-t interval over "
        "seeds.",
        "Only the linear layers' GEMMs are priced (fprop, dgrad, wgrad); attention's score and "
        "softmax GEMMs, norms, embeddings, the optimizer, communication and the quantization "
        "kernels are not. By Amdahl's law real end-to-end speed-ups are smaller.",
        "R are peak dense GEMM throughput ratios to BF16, not measured ones: B200 FP4 (NVFP4, "
        "MXFP4, per-tensor E2M1) 4, FP8 and FP6 2, BF16 1; GB300 FP4 6, FP8 and FP6 2, BF16 1; "
        "Hopper (H100 / H200) FP8 2, BF16 1, no FP4 or FP6 GEMMs (such a recipe is n/a there).",
        "A GEMM whose operands differ in format (grad_format) runs at the slower operand's "
        "rate; a path's rate is the mean over its three equal-FLOP GEMMs.",
        "torchao_fp8: tensorwise (e4m3 x and W, e5m2 dy) and rowwise run all three GEMMs at "
        "the FP8 rate, rowwise_with_gw_hp its wgrad at the BF16 rate, the bf16 recovery at 1.",
        "The int8 backend (LoRA's frozen base, W8A8): fprop at the INT8 rate (2 on B200 and "
        "Hopper, from NVIDIA's datasheets; GB300's is not in the table, so not priced there), "
        "dgrad in high precision, no wgrad for a frozen weight: 1 / R(low) = (1 / 2 + 1) / 2.",
        "The local rate of progress is taken as linear over the extra steps (D steps at the "
        "rate measured over the branch's last steps); it is undefined where BF16 made no "
        "measurable progress (r <= 0), and so is S where the arm is ahead by more than the "
        "horizon's progress (H + D <= 0).",
        "The recovery path's GEMMs run at their own format's rate, with no cost for switching "
        "paths between units or steps.",
        "GNMR's own overhead (monitor, controller, error score) is not priced: it is measured "
        "separately (benchmarks/results/overhead_v2.json).",
        "The reference arm is the regime's recovery path on every unit (named BF16); where that "
        "path is not BF16 the speed-ups are over BF16 throughput at the recovery path's loss.",
        "Records without flops_recovered price the recovered unit-step share instead (marked "
        "'(unit-steps)').",
    ]
    if formats is not None:
        lines.append(f"Priced: {_describe(formats)}.")
    return lines


def _describe(formats: Formats) -> str:
    """``low-cost e2m1 (FP4), recovery bf16 (BF16), backend fp8_emulated``."""
    if formats.backend == "int8":
        return "low-cost int8 W8A8 (INT8 fprop), recovery BF16, backend int8"
    if formats.backend == "torchao_fp8":
        low = formats.low_cost.get("recipe", "tensorwise")
        rec = formats.recovery.get("recipe", "bf16")
        classes = {
            r: "/".join(TORCHAO_GEMMS.get(str(r), ("not in the table",))) for r in (low, rec)
        }
        return (
            f"low-cost torchao {low} (fprop/dgrad/wgrad {classes[low]}), recovery {rec} "
            f"({classes[rec]}), backend torchao_fp8"
        )
    if formats.backend != "fp8_emulated":
        return f"backend {formats.backend} ({price(formats, HARDWARE[0]).note})"
    parts = []
    for role, options in (("low-cost", formats.low_cost), ("recovery", formats.recovery)):
        key = "low_cost" if role == "low-cost" else "recovery"
        fmt = str(options.get("format", _DEFAULT_FORMAT[key]))
        grad = options.get("grad_format")
        text = f"{role} {fmt} ({FORMAT_CLASS.get(fmt, 'not in the table')})"
        if grad and grad != fmt:
            text += f" with {grad} gradients ({FORMAT_CLASS.get(str(grad), 'not in the table')})"
        parts.append(text)
    return ", ".join(parts) + f", backend {formats.backend}"
