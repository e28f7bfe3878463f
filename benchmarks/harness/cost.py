"""Cost at matched loss (issues 35 and 44): each arm's effective speed-up over BF16 once its loss
is paid, bounded by the run's schedule.

Throughput alone hides the loss a low-precision recipe costs. This module turns a branch sweep's
records (:mod:`benchmarks.harness.branch`, by (arm, seed, point)) into figures per arm and
hardware: how much faster than BF16 the arm reaches the loss BF16 reaches after the branch's
``horizon`` steps. Per (seed, branch point ``p``), with ``h_a(e)`` arm ``a``'s held-out loss
``e`` steps into the branch, ``H`` the horizon (50), ``E`` the evaluation before it (25) and
``T`` the trunk's schedule (400 steps)::

    r = (h_BF16(E) - h_BF16(H)) / (H - E)      the trunk's local rate of progress (nats / step)
    g = h_arm(H) - h_BF16(H)                   the arm's held-out gap to BF16
    D = g / r                                  steps it must add to match BF16 (< 0: it is ahead)
    L = T - p - H                              steps the schedule leaves after the branch
    s = flops_recovered                        share of the linear-layer GEMM FLOPs on recovery
    c = C / error_every                        the error term's measured cost per step, as a
                                               share of a low-cost step (arms with ``gamma``)
    t = (1 - s) / R(low) + s / R(recovery) + c / R(low)   one step's time against BF16

**Bounded by the schedule**: a branch with ``D > L`` is *not reached* (counted, shown, no
speed-up for its arm); a point that ends the schedule (``L = 0``) is counted apart ("behind at
the schedule's end") and left out for every arm alike. **At the mean**: the speed-up is
``S = H / ((H + mean D) * mean t)`` over seeds (per seed, the means over its points), with a
paired delta-method interval, not the mean of the convex per-branch ratios. **Steps to target**
(:func:`steps_to_target`): the first evaluation at or below ``h_BF16(H)``. The derivation and
its choices: docs/benchmarks.md#cost-at-matched-loss.
``R(format)``: the format's peak dense GEMM rate against BF16 (:data:`THROUGHPUT`; ``int8`` from
:data:`INT8_RATE`). Undefined cases are reported, never divided through; a format without GEMMs
on a hardware is ``n/a``, one outside the table ``not priced``. ``C`` is the caller's
(:class:`ErrorCost`, measured); :func:`assumptions` is printed beside the table. No torch.
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
    "ErrorCost",
    "Formats",
    "Price",
    "SeedCost",
    "assumptions",
    "branch_cost",
    "cell",
    "cost_rows",
    "cost_table",
    "error_every",
    "error_share",
    "extra_steps",
    "flops_share",
    "hardware_groups",
    "local_rate",
    "price",
    "priced_groups",
    "priced_points",
    "seed_costs",
    "speed_cell",
    "speedup",
    "speedup_at_mean",
    "step_time",
    "steps_to_target",
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

AUTOSWITCH_STATISTICS = "not timed (its statistics)"
"""The error-term cell of TE AutoswitchGemm's arms: their per-GEMM statistics (underflow share
and MSE of each quantized input, every step) are not timed in this repository, so not priced."""

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
class ErrorCost:
    """What measuring the error term (``gamma``'s sums) costs: one measuring step's extra time as
    a share of a low-cost step (``share``), and where that figure was measured (``source``)."""

    share: float
    source: str


@dataclass(frozen=True)
class BranchCost:
    """One (arm, seed, point): the rate, gap, extra steps, the steps the schedule leaves
    (``left``, ``None``: unbounded), step time and the branch's own ratio ``H / ((H + D) t)``
    (``speedup``: never averaged into an arm's figure); ``None`` figures with a ``note`` where
    the conversion is undefined, the branch does not reach BF16's loss in the schedule, or the
    path is not priced."""

    rate: float
    gap: float
    flops_recovered: float
    extra_steps: float | None
    time: float | None
    speedup: float | None
    note: str | None = None
    left: int | None = None

    @property
    def reached(self) -> bool | None:
        """Whether the arm matches BF16's loss inside the schedule (``None``: undefined)."""
        if self.extra_steps is None:
            return None
        return self.left is None or self.extra_steps <= self.left


@dataclass(frozen=True)
class SeedCost:
    """One seed of one arm over its branch points with steps left in the schedule: the means of
    the extra steps and the step time (``None`` with a ``note`` when a branch is undefined or
    not reached, or the formats are not priced), the branches not reached, and the FLOP share
    over every branch point."""

    seed: int
    flops_recovered: float
    extra_steps: float | None
    time: float | None
    note: str | None = None
    fallbacks: int = 0
    """Branches whose FLOP share fell back to the unit-step share (old records)."""
    not_reached: int = 0
    """Branches with steps left whose extra steps exceed them."""


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
    # dgrad (dy W) and wgrad (x dy) each pair dy with an operand in fmt, and a GEMM runs at its
    # slower operand's rate
    backward = min(classes[fmt], classes[grad])
    # three GEMMs of equal FLOPs: the path's time per FLOP is the mean of their 1 / R
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
    # the backend's own default of each path, so a regime that names no recipe is priced as it ran
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
    # a saving that is not GEMM throughput is named, not priced at 1 (read as no speed-up)
    if formats.backend in _NOT_GEMM:
        return Price(note=f"not priced: {_NOT_GEMM[formats.backend]}")
    if formats.backend == "int8":
        return _int8_price(formats, hardware)
    if formats.backend == "torchao_fp8":
        low = _torchao_time(formats.low_cost, "low_cost", hardware)
        rec = _torchao_time(formats.recovery, "recovery", hardware)
        # one unpriced path leaves the step's time unknown: no half-priced figure
        for t in (low, rec):
            if isinstance(t, str):
                return Price(note=t)
        return Price(float(low), float(rec))
    if formats.backend != "fp8_emulated":
        # another backend's options mean other things: read with fp8_emulated's keys they would
        # price its defaults
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
    # before the rate test: an arm level with BF16 needs no steps even where BF16 made no progress
    if gap == 0:
        return 0.0
    # 'not >' rather than '<=': a NaN rate is undefined too
    if not rate > 0:
        return None
    return gap / rate


def step_time(share: float, p: Price, error: float = 0.0) -> float:
    """One step's linear-layer GEMM time against BF16 with ``share`` of the FLOPs on the
    recovery path and ``error`` (a share of a low-cost step) spent measuring the error term:
    ``(1 - s) / R(low) + s / R(recovery) + c / R(low)``."""
    if p.low is None or p.recovery is None:
        raise ValueError(f"the paths are not priced: {p.note}")
    # c is a share of a low-cost step, so it is paid at the low-cost rate
    return (1 - share) * p.low + share * p.recovery + error * p.low


def speedup(horizon: int, extra: float, time: float) -> float | None:
    """``horizon / ((horizon + extra) * time)``: the speed-up over BF16 at matched loss; ``None``
    when ``horizon + extra <= 0`` (ahead by more than the horizon's progress: outside the
    linear model)."""
    steps = horizon + extra
    if not steps > 0:
        return None
    return horizon / (steps * time)


def speedup_at_mean(
    horizon: int, extras: Sequence[float], times: Sequence[float]
) -> tuple[float, float] | None:
    """The speed-up at the mean extra steps and mean step time over seeds, and the 95%
    half-width of the delta method over seeds, paired: each seed's ``(D_s, t_s)`` linearized
    together around the means, ``S (1 - (D_s - D) / (H + D) - (t_s - t) / t)``, Student-t over
    the seeds (NaN for one seed). ``None`` where ``H + D <= 0``."""
    # at the means, not the mean of per-seed ratios: S is convex in D, so averaging ratios flattered
    # an arm whose gaps spread (issue 44)
    d, t = statistics.fmean(extras), statistics.fmean(times)
    s = speedup(horizon, d, t)
    if s is None:
        return None
    # each seed's D_s and t_s linearized together: a seed that needs more steps and recovers more
    # (slower steps) is one replicate, and their covariance stays in the interval
    lin = [
        s * (1 - (x - d) / (horizon + d) - (y - t) / t) for x, y in zip(extras, times, strict=True)
    ]
    return s, interval(lin)[1]


def flops_share(record: Mapping[str, Any]) -> tuple[float, bool]:
    """A branch's share of linear-layer GEMM FLOPs on the recovery path, and whether it fell
    back to ``recovered_unit_steps / unit_steps`` (records written before ``flops_recovered``
    existed; exact only when recovery is per unit and every unit has the same FLOPs)."""
    if record.get("flops_recovered") is not None:
        return float(record["flops_recovered"]), False
    return record["recovered_unit_steps"] / record["unit_steps"], True


def error_every(record: Mapping[str, Any]) -> int | None:
    """Every how many steps the arm measures the error term (``gamma`` set in its controller
    block, ``error_every`` of its spec, default 1), or ``None`` where it does not."""
    spec = record.get("arm_spec") or {}
    if not (spec.get("controller") or {}).get("gamma"):
        return None
    # records written before error_every existed measured every step
    return int(spec.get("error_every") or 1)


def error_share(record: Mapping[str, Any], error: ErrorCost | None) -> float | None:
    """The error term's cost per step as a share of a low-cost step, ``C / error_every``: 0 for
    an arm that does not measure it, ``None`` for one that does when no cost is known."""
    every = error_every(record)
    if every is None:
        return 0.0
    # unknown is None, not 0: an arm that measures must not be priced as free
    return None if error is None else error.share / every


def _early(ref: Mapping[str, Any], horizon: int) -> int:
    """The held-out measurement before the horizon (25 of 50) in the reference's record."""
    earlier = [int(k) for k in ref["heldout"] if int(k) < horizon]
    if not earlier:
        raise ValueError(f"the reference branch has no held-out loss before step {horizon}")
    # the last one before H: the rate over the branch's last steps is the local one at the horizon
    return max(earlier)


def steps_to_target(arm: Mapping[str, Any], ref: Mapping[str, Any], horizon: int) -> int | None:
    """The first evaluation step of ``arm``'s branch at which its held-out loss is at or below
    the reference's at ``horizon`` (BF16's final loss); ``None``: not by ``horizon``. The
    resolution is the evaluation spacing."""
    target = float(ref["heldout"][str(horizon)])
    for e in sorted(int(k) for k in arm["heldout"] if int(k) <= horizon):
        if float(arm["heldout"][str(e)]) <= target:
            return e
    return None


def branch_cost(
    arm: Mapping[str, Any],
    ref: Mapping[str, Any],
    horizon: int,
    p: Price,
    left: int | None = None,
    error: float | None = 0.0,
) -> BranchCost:
    """The model on one branch: ``arm``'s record against the reference (BF16) branch ``ref`` of
    the same seed and point; ``left``: the steps the schedule leaves after the branch (``None``:
    unbounded); ``error``: the error term's cost per step (:func:`error_share`)."""
    early = _early(ref, horizon)
    h_ref = float(ref["heldout"][str(horizon)])
    # BF16's rate on the same (seed, point), not the run's mean: progress per step falls along the
    # schedule, and the extra steps are taken from this point on
    rate = local_rate(float(ref["heldout"][str(early)]), h_ref, horizon - early)
    gap = float(arm["heldout"][str(horizon)]) - h_ref
    share, _ = flops_share(arm)
    if not (math.isfinite(rate) and math.isfinite(gap)):
        note = "undefined: a loss is not finite"
        return BranchCost(rate, gap, share, None, None, None, note, left)
    extra = extra_steps(gap, rate)
    if extra is None:
        note = "undefined: no measurable progress (r <= 0)"
        return BranchCost(rate, gap, share, None, None, None, note, left)
    if p.note is not None:
        return BranchCost(rate, gap, share, extra, None, None, p.note, left)
    if error is None:
        note = "not priced: the error term's cost is not known"
        return BranchCost(rate, gap, share, extra, None, None, note, left)
    t = step_time(share, p, error)
    # the time is kept for the table, but a gap the schedule cannot close earns no speed-up (issue
    # 44: 436 extra steps after a 50-step branch had been credited)
    if left is not None and extra > left:
        note = f"not reached: {extra:.0f} extra steps, {left} left in the schedule"
        return BranchCost(rate, gap, share, extra, t, None, note, left)
    s = speedup(horizon, extra, t)
    if s is None:
        note = "undefined: ahead by more than the horizon's progress"
        return BranchCost(rate, gap, share, extra, t, None, note, left)
    return BranchCost(rate, gap, share, extra, t, s, None, left)


# -- per seed, per arm -------------------------------------------------------------------------


def _complete(records: Records, d: Design, arm: str) -> bool:
    return all((arm, s, p) in records for s in d.seeds for p in d.points)


def _arms(records: Records, d: Design, arms: Sequence[str] | None) -> list[str]:
    """The arms asked for (or every arm in the records, in their order) with every branch."""
    names = list(arms) if arms is not None else list(dict.fromkeys(a for a, _, _ in records))
    return [a for a in names if _complete(records, d, a)]


def _left(d: Design, point: int, schedule: int | None) -> int | None:
    return None if schedule is None else schedule - point - d.horizon


def priced_points(d: Design, schedule: int | None) -> tuple[int, ...]:
    """The design's branch points that leave steps in the schedule (all without one)."""
    # L = 0 leaves no step to match in, so any gap there never closes: such points are counted apart
    # and left out for every arm alike
    return tuple(p for p in d.points if schedule is None or schedule - p - d.horizon > 0)


def seed_costs(
    records: Records,
    d: Design,
    formats: Formats,
    hardware: str,
    arms: Sequence[str] | None = None,
    schedule: int | None = None,
    error: ErrorCost | None = None,
) -> dict[str, list[SeedCost]]:
    """Per arm with every branch done (``arms``: those, else every arm in the records), per seed
    of ``d``: over its branch points with steps left in ``schedule`` (the trunk's length;
    ``None``: unbounded), the means of the extra steps to match ``d.high`` (BF16) and of the
    step time on ``hardware`` (the error term's cost ``error`` added where the arm measures
    it), and the branches not reached; the FLOP share over every point. A seed any of whose
    branches is undefined or not reached gets ``None`` figures and the first such note. Nothing
    when the reference arm is incomplete."""
    # every figure pairs an arm's branch with BF16's of the same (seed, point): without all of
    # BF16's nothing is paired
    if not _complete(records, d, d.high):
        return {}
    p = price(formats, hardware)
    priced = priced_points(d, schedule)
    out: dict[str, list[SeedCost]] = {}
    for arm in _arms(records, d, arms):
        rows = []
        for seed in d.seeds:
            recs = {pt: records[(arm, seed, pt)] for pt in d.points}
            costs = [
                branch_cost(
                    recs[pt],
                    records[(d.high, seed, pt)],
                    d.horizon,
                    p,
                    _left(d, pt, schedule),
                    error_share(recs[pt], error),
                )
                # extra steps and time over the points with steps left; the FLOP share (below) over
                # every point, what the arm spent
                for pt in priced
            ]
            missing = [
                f"{c.note} at point {pt}"
                for c, pt in zip(costs, priced, strict=True)
                if c.note is not None and c.note.startswith(("undefined", "not reached"))
            ]
            # one undefined or unreached branch leaves the seed without a mean: averaging the others
            # would drop exactly the branches that cost most
            known = not missing and costs and all(c.extra_steps is not None for c in costs)
            timed = known and all(c.time is not None for c in costs)
            rows.append(
                SeedCost(
                    seed,
                    statistics.fmean(flops_share(r)[0] for r in recs.values()),
                    statistics.fmean(c.extra_steps or 0.0 for c in costs) if known else None,
                    statistics.fmean(c.time or 0.0 for c in costs) if timed else None,
                    missing[0] if missing else next((c.note for c in costs if c.note), None),
                    sum(flops_share(r)[1] for r in recs.values()),
                    sum(c.reached is False for c in costs),
                )
            )
        out[arm] = rows
    return out


def _figure(values: Sequence[float | None]) -> tuple[float, float] | None:
    """Mean and 95% half-width over seeds, ``None`` when any seed's figure is undefined."""
    # one undefined seed undefines the figure: an interval over the rest would be over chosen seeds
    if not values or any(v is None for v in values):
        return None
    return interval([v for v in values if v is not None])


def _reach(records: Records, d: Design, arm: str, schedule: int | None) -> dict[str, Any]:
    """Hardware-independent: steps to BF16's final loss per branch (counts by evaluation step,
    ``None``: not by the horizon) and the branches behind BF16 at points that end the
    schedule."""
    to: dict[int | None, int] = {}
    behind = ends = 0
    for s in d.seeds:
        for pt in d.points:
            a, ref = records[(arm, s, pt)], records[(d.high, s, pt)]
            e = steps_to_target(a, ref, d.horizon)
            to[e] = to.get(e, 0) + 1
            # where the schedule ends only the gap's sign means anything: counted, never priced
            if pt not in priced_points(d, schedule):
                ends += 1
                behind += float(a["heldout"][str(d.horizon)]) > float(
                    ref["heldout"][str(d.horizon)]
                )
    return {"to_target": to, "at_end": (behind, ends) if ends else None}


def summarize_costs(
    records: Records,
    d: Design,
    formats: Formats,
    hardware: Sequence[str] = HARDWARE,
    arms: Sequence[str] | None = None,
    schedule: int | None = None,
    error: ErrorCost | None = None,
) -> dict[str, dict[str, Any]]:
    """Per arm: the mean FLOP share, the branches whose share fell back to unit-steps, the error
    term's cost per step (``None``: not measured by the arm), the branches not reached in
    ``schedule`` (of those with steps left) and behind at its end, the steps to BF16's final
    loss (counts by evaluation step), the extra steps to match BF16 (mean, 95% half-width over
    seeds; ``None`` with a note when a branch is undefined or not reached), and per hardware
    the speed-up at matched loss at the mean extra steps (:func:`speedup_at_mean`) and the
    step time (``None`` with a ``note`` when undefined, not reached or not priced)."""
    out: dict[str, dict[str, Any]] = {}
    n_priced = len(d.seeds) * len(priced_points(d, schedule))
    for hw in hardware:
        for arm, rows in seed_costs(records, d, formats, hw, arms, schedule, error).items():
            row = out.get(arm)
            # the hardware-independent figures once per arm (at its first hardware)
            if row is None:
                n = sum(r.not_reached for r in rows)
                # an arm's spec is the same in every branch: any record tells its error_every
                spec = records[(arm, d.seeds[0], d.points[0])]
                every = error_every(spec)
                notes = [f"seed {r.seed}: {r.note}" for r in rows if r.extra_steps is None]
                row = out[arm] = {
                    "flops_recovered": statistics.fmean(r.flops_recovered for r in rows),
                    "flops_from_unit_steps": sum(r.fallbacks for r in rows),
                    "error": (
                        (error_share(spec, error), every)
                        if every is not None
                        else AUTOSWITCH_STATISTICS
                        if str(spec.get("arm_spec", {}).get("policy", "")).startswith("autoswitch")
                        else None
                    ),
                    "not_reached": (n, n_priced),
                    "extra_steps": _figure([r.extra_steps for r in rows]),
                    "extra_steps_note": (
                        f"not reached on {n} of {n_priced}"
                        if n
                        else (notes[0] if notes else None)
                        if n_priced
                        else "no branch point leaves steps in the schedule"
                    ),
                    "hardware": {},
                } | _reach(records, d, arm, schedule)
            row["hardware"][hw] = _hardware(rows, d.horizon, row, price(formats, hw).note)
    return out


def _hardware(
    rows: Sequence[SeedCost], horizon: int, row: Mapping[str, Any], p_note: str | None
) -> dict[str, Any]:
    """One hardware's cell: the speed-up at the mean (or why there is none) and the step time."""
    times = [r.time for r in rows]
    speed = None
    if row["extra_steps"] is not None and not any(t is None for t in times):
        speed = speedup_at_mean(
            horizon, [r.extra_steps or 0.0 for r in rows], [t or 0.0 for t in times]
        )
    note = None
    if speed is None:
        notes = [f"seed {r.seed}: {r.note}" for r in rows if r.note]
        # the widest reason first: an unpriced format explains every seed's missing figure
        if p_note is not None:
            note = p_note
        elif row["not_reached"][0]:
            note = row["extra_steps_note"]
        else:
            note = notes[0] if notes else "undefined: H + D <= 0 at the mean"
    return {"speedup": speed, "time": _figure(times), "note": note}


# -- the table and its assumptions -------------------------------------------------------------


def cell(pair: Sequence[float] | None, note: str | None, digits: int = 2) -> str:
    """``1.67 +- 0.01`` (``(one seed)`` without a half-width), else the note or ``-``."""
    if pair is None:
        return note or "-"
    m, h = pair
    if math.isnan(h):
        return f"{m:.{digits}f} (one seed)"
    return f"{m:.{digits}f} +- {h:.{digits}f}"


def _error_cell(error: tuple[float | None, int] | str | None) -> str:
    if error is None or isinstance(error, str):
        return error or "-"
    share, every = error
    when = "every step" if every == 1 else f"every {every} steps"
    return "not known" if share is None else f"+{100 * share:.1f}% ({when})"


def _to_target_cell(to: Mapping[int | None, int], horizon: int) -> str:
    parts = [f"by {e}: {n}" for e, n in sorted((e, n) for e, n in to.items() if e is not None)]
    if to.get(None):
        parts.append(f"not by {horizon}: {to[None]}")
    return ", ".join(parts)


def hardware_groups(
    summary: Mapping[str, Mapping[str, Any]], hardware: Sequence[str] = HARDWARE
) -> list[tuple[str, ...]]:
    """The hardware models whose speed-up cells are the same for every arm, grouped (in
    ``hardware``'s order): one column per group, so a column appears only where ratios differ."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for hw in hardware:
        # keyed by the whole column: two models share one only where every arm's cell reads the same
        cells = tuple(speed_cell(r, hw) for r in summary.values())
        groups.setdefault(cells, []).append(hw)
    return [tuple(g) for g in groups.values()]


def priced_groups(summary: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """:func:`hardware_groups` that price at least one arm (a table's speed-up columns)."""
    groups, rows = hardware_groups(summary), summary.values()
    return [g for g in groups if any(r["hardware"][g[0]]["speedup"] for r in rows)]


def speed_cell(r: Mapping[str, Any], hw: str) -> str:
    """An arm's speed-up on ``hw`` (a row of :func:`summarize_costs`) as a cell."""
    c = r["hardware"].get(hw)
    return "-" if c is None else cell(c["speedup"], c["note"])


DETAILS = ("recovered GEMM FLOPs", "error term's cost", "extra steps to match BF16")
DETAILS += ("behind BF16 at the schedule's end",)
DETAILS += ("reaches BF16's final loss (branches, by evaluation step)",)
"""The detail columns of :func:`cost_rows`, in its order, before the speed-ups."""


def cost_rows(
    summary: Mapping[str, Mapping[str, Any]],
    hardware: Sequence[str] = HARDWARE,
    details: bool = True,
    horizon: int = 50,
) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of :func:`cost_table`: one row per arm, its name first."""
    groups = hardware_groups(summary, hardware) if summary else [(hw,) for hw in hardware]
    ends = details and any(r.get("at_end") for r in summary.values())
    header = ["arm"]
    if details:  # "behind" only where a branch ends the trunk's schedule
        header += [h for h in DETAILS if ends or not h.startswith("behind")]
    header += [f"speed-up at matched loss, {', '.join(g)}" for g in groups]
    rows = []
    for arm, r in summary.items():
        cells = [arm]
        if details:
            flops = f"{100 * r['flops_recovered']:.1f}%"
            if r["flops_from_unit_steps"]:
                flops += " (unit-steps)"
            cells += [flops, _error_cell(r["error"])]
            cells.append(cell(r["extra_steps"], r["extra_steps_note"], 1))
            if ends:
                behind, n = r["at_end"] or (0, 0)
                cells.append(f"{behind} of {n}" if n else "-")
            cells.append(_to_target_cell(r["to_target"], horizon))
        cells += [speed_cell(r, g[0]) for g in groups]
        rows.append(cells)
    return header, rows


def cost_table(
    summary: Mapping[str, Mapping[str, Any]],
    hardware: Sequence[str] = HARDWARE,
    details: bool = True,
    horizon: int = 50,
) -> str:
    """One row per arm of :func:`summarize_costs`, one column per group of hardware models whose
    speed-ups at matched loss are the same (:func:`hardware_groups`): ``2.31 +- 0.12``, or the
    note (``not reached on 3 of 40``, ``n/a (no FP4 GEMMs)``, ``not priced: ...``,
    ``undefined ...``). ``details``: also the recovered share of GEMM FLOPs, the error term's
    cost, the extra steps to match BF16, the branches behind BF16 at the schedule's end (where
    the design has such points) and the steps to BF16's final loss (hardware-independent)."""
    return markdown_table(*cost_rows(summary, hardware, details, horizon))


def assumptions(
    formats: Formats | None = None,
    horizon: int = 50,
    early: int = 25,
    schedule: int | None = None,
    error: ErrorCost | None = None,
) -> list[str]:
    """The cost model's assumptions, one line each, to print beside :func:`cost_table` (with
    ``formats``: also which formats were priced and at what rates)."""
    end = "T" if schedule is None else str(schedule)
    lines = [
        f"Speed-up over BF16 at matched loss: S = H / ((H + D) * t), H = {horizon} steps; D = "
        f"g / r, g the arm's held-out gap to BF16 after H steps, r = (h_BF16({early}) - "
        f"h_BF16({horizon})) / {horizon - early} the trunk's local rate of progress on the same "
        "branch; t = (1 - s) / R(low) + s / R(recovery) + c / R(low), s the recovered share of "
        "linear-layer GEMM FLOPs, c the error term's cost per step (below).",
        f"Bounded by the schedule: a branch from point p has L = {end} - p - H steps left in the "
        "trunk's schedule; one that needs D > L extra steps does not reach BF16's loss inside "
        "the run and is counted 'not reached'; an arm with any such branch gets no extra-step "
        "figure and no speed-up. A point that ends the schedule (L = 0) leaves no step to match "
        "in, so there any gap above 0, however small, is never closed (the BF16 null control "
        "itself is behind on about half of such branches): those branches are counted apart "
        "('behind BF16 at the schedule's end') and left out of the extra steps and speed-ups of "
        "every arm alike.",
        "At the mean: per seed the mean D and t over its branch points with steps left; S is "
        "taken at the means over seeds, not as the mean of per-branch ratios (convex in D, which "
        "flattered an arm with a spread of gaps); its 95% interval is the delta method over "
        "seeds, paired (each seed's D and t linearized together, Student-t).",
        f"Reaches BF16's final loss: the first evaluation step ({early}, {horizon}) at which the "
        "arm's held-out loss is at or below the BF16 branch's after H steps, counted over "
        f"branches; the resolution is the {horizon - early} steps between evaluations (a branch "
        f"'by {horizon}' got there somewhere in steps {early + 1} to {horizon}); an arm level "
        "with BF16 is at or below it on about half of the branches by chance (the BF16 null "
        "control's count is that noise floor).",
        "Only the linear layers' GEMMs are priced (fprop, dgrad, wgrad); attention's score and "
        "softmax GEMMs, norms, embeddings, the optimizer, communication and the quantization "
        "kernels are not. By Amdahl's law real end-to-end speed-ups are smaller.",
        "R are peak dense GEMM throughput ratios to BF16, not measured ones: B200 FP4 (NVFP4, "
        "MXFP4, per-tensor E2M1) 4, FP8 and FP6 2, BF16 1; GB300 FP4 6, FP8 and FP6 2, BF16 1; "
        "Hopper (H100 / H200) FP8 2, BF16 1, no FP4 or FP6 GEMMs (such a recipe is n/a there). "
        "Hardware models whose speed-ups are the same for every arm share one column.",
        "A GEMM whose operands differ in format (grad_format) runs at the slower operand's "
        "rate; a path's rate is the mean over its three equal-FLOP GEMMs.",
        "torchao_fp8: tensorwise (e4m3 x and W, e5m2 dy) and rowwise run all three GEMMs at "
        "the FP8 rate, rowwise_with_gw_hp its wgrad at the BF16 rate, the bf16 recovery at 1.",
        "The int8 backend (LoRA's frozen base, W8A8): fprop at the INT8 rate (2 on B200 and "
        "Hopper, from NVIDIA's datasheets; GB300's is not in the table, so not priced there), "
        "dgrad in high precision, no wgrad for a frozen weight: 1 / R(low) = (1 / 2 + 1) / 2.",
        "The local rate of progress is taken as linear over the extra steps (D steps at the "
        "rate measured over the branch's last steps; the cosine schedule slows it, so D is "
        "rather too small than too large); it is undefined where BF16 made no measurable "
        "progress (r <= 0), and so is S where the arm is ahead by more than the horizon's "
        "progress (H + D <= 0).",
        "The recovery path's GEMMs run at their own format's rate, with no cost for switching "
        "paths between units or steps.",
        _error_line(error),
        "GNMR's monitor and controller are not priced beyond the error term's figure (measured "
        "separately: benchmarks/results/overhead_v2.json); neither are TE AutoswitchGemm's "
        "per-GEMM statistics (underflow share and MSE of each quantized input, every step: not "
        "timed in this repository, so its arms' figures leave that cost out) nor the oracles' "
        "extra passes (not deployable).",
        "The reference arm is the regime's recovery path on every unit (named BF16); where that "
        "path is not BF16 the speed-ups are over BF16 throughput at the recovery path's loss.",
        "Records without flops_recovered price the recovered unit-step share instead (marked "
        "'(unit-steps)').",
    ]
    if formats is not None:
        lines.append(f"Priced: {_describe(formats)}.")
    return lines


def _error_line(error: ErrorCost | None) -> str:
    head = (
        "The error term (gamma): an arm that measures it pays c = C / error_every per step (its "
        "records' error_every), C the measured extra time of a measuring step as a share of a "
        "low-cost step"
    )
    if error is None:
        tail = " (each table names its C and where it was measured); an arm whose C is not "
        return head + tail + "known is not priced."
    return head + f": C = {100 * error.share:.1f}% ({error.source})."


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
