"""A deliberately naive, loop-based brute force of GNMR policy v2 (docs/algorithm.md).

Written from the text of docs/algorithm.md (as committed in d0aad34) alone, without reading the
implementation in ``gnmr_dist/core``: its value as a reference is that it shares no code and no
reading of the code with what it checks. Pure Python floats and lists, one unit at a time, and
the doc's formulas in the doc's order wherever the doc states one:

- ``ratio(a, b)``: ``a / b`` when ``b > 0``, 1 when ``a = b = 0``, ``+inf`` when ``a > 0 = b``;
- ``GNMR = ratio(n, S / c)`` (the mean first), ``dGNMR = ratio(GNMR, mean W)`` with the window
  summed oldest to newest, then divided by its length;
- schedules: ``f = min(max(t - m, 0) / n, 1)`` on the step clock,
  ``f = min(max(d - p, 0) / (q - p), 1)`` on the ``lr_decay`` clock with
  ``d = 1 - lr_t / max(lr_1..lr_t)``; linear ``a + (b - a) f``, cosine
  ``b + (a - b) (1 + cos(pi f)) / 2``, step ``a`` while ``f < 1`` and ``b`` once ``f = 1``;
- the budget walk literally walks the sorted candidate list: a unit is taken when
  ``|A| < k_t`` and (with ``max_share``) ``cost(A) + w(u) <= s_t W``, else skipped.

Configs are the doc's JSON form (the keys of the "Policy" table): ``max_active``,
``max_share``, ``lock_steps``, ``latch``, ``pinned`` (``{"from": condition}``; the units are
the ``pinned`` mask given to :class:`BruteV2`, as the integration resolves ``"units"``),
``window``, ``alpha``, ``beta``, ``warmup_steps``, ``gamma``. A missing key takes the doc's
default.

Points where the doc leaves a choice, and what this reference takes (each is reported when an
implementation disagrees):

- a non-finite norm scores ``+inf`` even when the unit has no finite history yet (``c = 0``);
- ``P_t`` is applied during warm-up too (the doc's warm-up empties ``C`` only);
- a unit in ``P_t`` is outside ``A_t``, so step 4 clears its lock and latch;
- the latch condition and the ``lr_decay`` clock read the same ``d_t``;
- ``W`` defaults to the sum of the costs (every GEMM of every unit recovered, ``g = 3``);
  a different ``total_cost`` can be given;
- the share test "is exact" (d0aad34) but ``s_t`` is a float: :func:`share_fits` reads it as
  the decimal it prints as (``repr``), so ``"max_share": 0.58`` lets 29 of ``W = 50`` in
  (the float product ``0.58 * 50`` is ``28.999999999999996``), as the doc now says (8cedd9a:
  "``s_t`` read as the decimal it prints as"). ``share_reading="float"`` takes the literal
  float product instead; the two differ only on such boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

INF = math.inf

DEFAULTS: dict[str, Any] = {
    "max_active": 4,
    "max_share": None,
    "lock_steps": 8,
    "latch": None,
    "pinned": None,
    "window": 8,
    "alpha": 1.5,
    "beta": 2.0,
    "warmup_steps": 8,
    "gamma": None,
}


def is_finite(x: float) -> bool:
    """True for a finite float (NaN and +-inf are not)."""
    return not (x != x or x == INF or x == -INF)


def ratio(a: float, b: float) -> float:
    """The doc's one division convention, for ``a, b >= 0``."""
    if b > 0:
        return a / b
    if a == 0:
        return 1.0
    return INF


def lr_decay(lr: float, peak: float) -> float:
    """``d_t = 1 - lr_t / max(lr_1..lr_t)``; 0 while every lr so far is 0."""
    if peak == 0:
        return 0.0
    return 1.0 - lr / peak


def uses_lr_clock(config: dict[str, Any]) -> bool:
    """Whether any schedule or condition of ``config`` runs on the learning-rate clock."""
    for key in ("max_active", "max_share", "alpha", "beta", "gamma"):
        value = config.get(key)
        if isinstance(value, dict) and value.get("clock", "step") == "lr_decay":
            return True
    latch = config.get("latch")
    if isinstance(latch, dict) and "lr_decay" in latch:
        return True
    pinned = config.get("pinned")
    if isinstance(pinned, dict):
        cond = pinned.get("from", {"step": 1})
        if "lr_decay" in cond:
            return True
    return False


def progress(spec: dict[str, Any], t: int, d: float) -> float:
    """The schedule's progress ``f`` in [0, 1] at step ``t`` (or at decay ``d``)."""
    if spec.get("clock", "step") == "lr_decay":
        p = float(spec.get("from", 0.0))
        q = float(spec.get("to", 1.0))
        x = d - p
        if x < 0:
            x = 0.0
        f = x / (q - p)
    else:
        m = int(spec.get("from", 1))
        n = int(spec["steps"])
        x = t - m
        if x < 0:
            x = 0
        f = x / n
    if f > 1:
        f = 1.0
    return float(f)


def schedule_value(spec: Any, t: int, d: float) -> float:
    """A number (constant) or a schedule dict evaluated at step ``t`` / decay ``d``."""
    if not isinstance(spec, dict):
        return float(spec)
    a = float(spec["start"])
    b = float(spec["end"])
    kind = spec["schedule"]
    if kind == "constant":
        return a
    f = progress(spec, t, d)
    if kind == "linear":
        return a + (b - a) * f
    if kind == "cosine":
        return b + (a - b) * (1 + math.cos(math.pi * f)) / 2
    if kind == "step":
        if f < 1:
            return a
        return b
    raise ValueError(f"unknown schedule {kind!r}")


def condition_holds(cond: dict[str, Any] | None, t: int, d: float) -> bool:
    """``{"step": m}``: ``t >= m``; ``{"lr_decay": p}``: ``d_t >= p``; ``None``: never."""
    if cond is None:
        return False
    if "step" in cond:
        return t >= int(cond["step"])
    return d >= float(cond["lr_decay"])


def budget_k(spec: Any, t: int, d: float) -> int:
    """``k_t``: the integer ``max_active``, or ``floor`` of its schedule."""
    if isinstance(spec, dict):
        return math.floor(schedule_value(spec, t, d))
    return int(spec)


def share_fits(cost: int, share: float, total: int, reading: str = "decimal") -> bool:
    """``cost <= s W`` for integers ``cost``, ``W``: ``s`` as its decimal, or the float product."""
    if reading == "float":
        return cost <= share * total
    return Fraction(cost) <= Fraction(repr(float(share))) * total


@dataclass
class BruteDecision:
    """Everything the brute force decided and scored at one step."""

    step: int
    gnmr: list[float]
    delta_gnmr: list[float]
    risk: list[float]
    exceed: list[bool]
    error_exceed: list[bool]
    error: list[float] | None
    alpha: float
    beta: float
    gamma: float | None
    k: int
    share: float | None
    decay: float
    candidates: list[int]
    order: list[int]
    chosen: list[int]
    pinned: list[int]
    active: list[int]
    lock: list[int]
    latched: list[int]
    num_nonfinite: int

    @property
    def num_exceed(self) -> int:
        return sum(1 for x in self.exceed if x)


@dataclass
class BruteV2:
    """The whole controller of docs/algorithm.md, one unit at a time."""

    num_units: int
    config: dict[str, Any] = field(default_factory=dict)
    eligible: list[bool] | None = None
    costs: list[int] | None = None
    pinned: list[bool] | None = None
    total_cost: int | None = None
    share_reading: str = "decimal"

    def __post_init__(self) -> None:
        cfg = dict(DEFAULTS)
        for key, value in self.config.items():
            if key not in DEFAULTS:
                raise ValueError(f"unknown key {key!r}")
            cfg[key] = value
        self.cfg = cfg
        u = self.num_units
        self.elig = [True] * u if self.eligible is None else [bool(x) for x in self.eligible]
        if self.pinned is not None:
            self.pin = [bool(x) for x in self.pinned]
        else:  # no mask: "units": "all" needs none, anything else pins nothing here
            pinned_cfg = cfg["pinned"]
            every = isinstance(pinned_cfg, dict) and pinned_cfg.get("units") == "all"
            self.pin = [every] * u
        if cfg["max_share"] is not None:
            if self.costs is None:
                raise ValueError("max_share needs costs")
            self.w = [int(x) for x in self.costs]
            self.W = sum(self.w) if self.total_cost is None else int(self.total_cost)
        else:
            self.w = [int(x) for x in self.costs] if self.costs is not None else [1] * u
            self.W = sum(self.w) if self.total_cost is None else int(self.total_cost)
        self.t = 0
        self.S = [0.0] * u
        self.c = [0] * u
        self.Wn: list[list[float]] = [[] for _ in range(u)]
        self.lock = [0] * u
        self.latched = [0] * u
        self.lr_peak = 0.0
        self.recovered = [0] * u
        self.nonfinite = [0] * u
        self.first_nonfinite = (0, -1)
        self.plan: list[int] = []

    # -- scores ------------------------------------------------------------------------------

    def scores(self, u: int, n: float) -> tuple[float, float]:
        """``(GNMR_t(u), dGNMR_t(u))`` from the history before this step."""
        if not is_finite(n):
            return INF, INF
        if self.c[u] == 0:
            g = 1.0
        else:
            mean = self.S[u] / self.c[u]
            g = ratio(n, mean)
        window = self.Wn[u]
        if len(window) == 0:
            dg = 1.0
        else:
            total = 0.0
            for value in window:  # oldest to newest
                total += value
            dg = ratio(g, total / len(window))
        return g, dg

    # -- one decision ------------------------------------------------------------------------

    def step(
        self,
        norms: list[float],
        errors: list[float] | None = None,
        lr: float | None = None,
    ) -> BruteDecision:
        cfg = self.cfg
        U = self.num_units
        assert len(norms) == U
        self.t += 1
        t = self.t
        if lr is not None:
            if lr > self.lr_peak:
                self.lr_peak = float(lr)
            d = lr_decay(float(lr), self.lr_peak)
        else:
            assert not uses_lr_clock(cfg), "a schedule on the lr_decay clock needs lr"
            d = 0.0

        alpha = schedule_value(cfg["alpha"], t, d)
        beta = schedule_value(cfg["beta"], t, d)
        gamma = None if cfg["gamma"] is None else schedule_value(cfg["gamma"], t, d)
        if gamma is not None:
            assert errors is not None and len(errors) == U
        k = budget_k(cfg["max_active"], t, d)
        share = None if cfg["max_share"] is None else schedule_value(cfg["max_share"], t, d)

        gnmr: list[float] = []
        dgnmr: list[float] = []
        risk: list[float] = []
        exceed: list[bool] = []
        error_exceed: list[bool] = []
        error: list[float] | None = None if gamma is None else []
        for u in range(U):
            n = float(norms[u])
            g, dg = self.scores(u, n)
            r = max(g / alpha, dg / beta)
            ee = False
            if gamma is not None:
                e = float(errors[u])  # type: ignore[index]
                if not is_finite(e):
                    e = INF  # a non-finite e_t(u) scores +inf
                error.append(e)  # type: ignore[union-attr]
                er = e / gamma
                ee = er > 1
                r = max(r, er)
            gnmr.append(g)
            dgnmr.append(dg)
            risk.append(r)
            exceed.append(r > 1)
            error_exceed.append(ee)

        # 1. Locks count down.
        for u in range(U):
            if not exceed[u]:
                self.lock[u] = max(self.lock[u] - 1, 0)

        # Pinned units P_t.
        pinned_cfg = cfg["pinned"]
        pinned_now: list[int] = []
        if pinned_cfg is not None:
            cond = pinned_cfg.get("from", {"step": 1})
            if condition_holds(cond, t, d):
                pinned_now = [u for u in range(U) if self.pin[u] and self.elig[u]]

        # 2. Candidates.
        candidates: list[int] = []
        if t > int(cfg["warmup_steps"]):
            for u in range(U):
                if not self.elig[u] or u in pinned_now:
                    continue
                if exceed[u] or self.lock[u] > 0 or self.latched[u] > 0:
                    candidates.append(u)

        # 3. Budget: latched first (latch step, id), then risk descending, id ascending.
        latched_part = [u for u in candidates if self.latched[u] > 0]
        other_part = [u for u in candidates if self.latched[u] == 0]
        latched_part = bubble_sort(latched_part, lambda u: (self.latched[u], u))
        other_part = bubble_sort(other_part, lambda u: (-risk[u], u))
        order = latched_part + other_part
        chosen: list[int] = []
        cost = 0
        for u in order:
            if len(chosen) >= k:
                continue
            if share is not None and not share_fits(
                cost + self.w[u], share, self.W, self.share_reading
            ):
                continue  # skipped: a cheaper unit further down may fit
            chosen.append(u)
            cost += self.w[u]

        # 4. Locks (and latches) are set.
        latch_now = condition_holds(cfg["latch"], t, d)
        for u in range(U):
            if u in chosen:
                if exceed[u]:
                    self.lock[u] = int(cfg["lock_steps"])
                    if latch_now and self.latched[u] == 0:
                        self.latched[u] = t
            else:
                self.lock[u] = 0
                self.latched[u] = 0

        active = sorted(set(chosen) | set(pinned_now))

        # Accounting: R_{t-1} ran during step t.
        for u in self.plan:
            self.recovered[u] += 1
        num_nonfinite = 0
        for u in range(U):
            if not is_finite(float(norms[u])):
                self.nonfinite[u] += 1
                num_nonfinite += 1
                if self.first_nonfinite == (0, -1):
                    self.first_nonfinite = (t, u)

        # History update.
        window = int(cfg["window"])
        for u in range(U):
            n = float(norms[u])
            if is_finite(n):
                self.S[u] += n
                self.c[u] += 1
            if is_finite(gnmr[u]):
                self.Wn[u].append(gnmr[u])
                while len(self.Wn[u]) > window:
                    self.Wn[u].pop(0)

        self.plan = active
        return BruteDecision(
            step=t,
            gnmr=gnmr,
            delta_gnmr=dgnmr,
            risk=risk,
            exceed=exceed,
            error_exceed=error_exceed,
            error=error,
            alpha=alpha,
            beta=beta,
            gamma=gamma,
            k=k,
            share=share,
            decay=d,
            candidates=sorted(candidates),
            order=order,
            chosen=sorted(chosen),
            pinned=pinned_now,
            active=active,
            lock=list(self.lock),
            latched=list(self.latched),
            num_nonfinite=num_nonfinite,
        )


def bubble_sort(items: list[int], key: Any) -> list[int]:
    """A plain bubble sort by ``key`` (no reliance on ``sorted``'s stability)."""
    out = list(items)
    for i in range(len(out)):
        for j in range(len(out) - 1 - i):
            if key(out[j + 1]) < key(out[j]):
                out[j], out[j + 1] = out[j + 1], out[j]
    return out
