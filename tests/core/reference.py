"""An independent, deliberately naive reference of docs/algorithm.md.

Plain Python floats and lists, one unit at a time, written from the spec text and sharing no code
with ``gnmr_dist.core``: the vectorised controller must agree with it decision for decision.
With ``gamma`` (section 2.1) each step also takes one error score per unit, and the risk gains
the term ``e / gamma_t`` (+inf for a non-finite ``e``); the errors touch nothing else.

The second policy is here too, as the doc words it: schedules with ``from`` and the ``step``
shape on both clocks (``d_t = 1 - lr_t / max(lr_1..lr_t)``), ``k_t = floor(max_active_t)``, the
walk that takes a unit when ``|A| < k_t`` and ``cost(A) + w(u) <= s_t W`` (compared exactly, as
fractions, ``s_t`` the decimal it prints as), latches, pinned units and the accounting.
"""

from __future__ import annotations

import math
from collections import deque
from fractions import Fraction


def ref_ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    if a == 0 and b == 0:
        return 1.0
    return math.inf


def ref_threshold(spec, t: int, d: float | None = None) -> float:
    if not isinstance(spec, dict):
        return float(spec)
    a, b = float(spec["start"]), float(spec["end"])
    if spec.get("clock", "step") == "step":
        f = min(max(t - spec.get("from", 1), 0) / spec["steps"], 1.0)
    else:
        p, q = spec.get("from", 0), spec.get("to", 1)
        f = min(max(d - p, 0.0) / (q - p), 1.0)
    if spec["schedule"] == "constant":
        return a
    if spec["schedule"] == "linear":
        return a + (b - a) * f
    if spec["schedule"] == "step":
        return a if f < 1 else b
    return b + (a - b) * (1 + math.cos(math.pi * f)) / 2


def ref_holds(cond, t: int, d: float | None) -> bool:
    if cond is None:
        return False
    if "step" in cond:
        return t >= cond["step"]
    return d >= cond["lr_decay"]


class RefController:
    def __init__(
        self,
        num_units,
        max_active,
        lock_steps,
        window,
        alpha,
        beta,
        warmup_steps,
        eligible=None,
        gamma=None,
        max_share=None,
        latch=None,
        pinned=None,
        pinned_mask=None,
        costs=None,
        total_cost=None,
    ):
        self.u = num_units
        self.max_active, self.lock_steps, self.warmup = max_active, lock_steps, warmup_steps
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.max_share, self.latch = max_share, latch
        self.eligible = list(eligible) if eligible is not None else [True] * num_units
        self.pinned_from = None
        if pinned is not None:
            self.pinned_from = pinned.get("from", {"step": 1})
            if pinned_mask is None:
                assert pinned["units"] == "all"
                pinned_mask = [True] * num_units
        self.pinned = list(pinned_mask) if pinned_mask is not None else [False] * num_units
        self.costs, self.total = costs, total_cost
        self.S = [0.0] * num_units
        self.c = [0] * num_units
        self.W = [deque(maxlen=window) for _ in range(num_units)]
        self.lock = [0] * num_units
        self.latched = [0] * num_units
        self.peak = 0.0
        self.plan = []
        self.recovered = [0] * num_units
        self.nonfinite = [0] * num_units
        self.first_nonfinite = None
        self.t = 0

    def step(self, norms, errors=None, lr=None):
        assert (errors is None) == (self.gamma is None)
        self.t += 1
        t = self.t
        decay = None
        if lr is not None:
            self.peak = max(self.peak, float(lr))
            decay = 1.0 - float(lr) / self.peak if self.peak > 0 else 0.0
        alpha, beta = ref_threshold(self.alpha, t, decay), ref_threshold(self.beta, t, decay)
        gamma = None if self.gamma is None else ref_threshold(self.gamma, t, decay)
        k = math.floor(ref_threshold(self.max_active, t, decay))
        share = None if self.max_share is None else ref_threshold(self.max_share, t, decay)
        gnmr, dgnmr, risk, error = [], [], [], []
        for u in range(self.u):
            n = float(norms[u])
            if gamma is not None:
                e = float(errors[u])
                error.append(e if math.isfinite(e) else math.inf)
            if not math.isfinite(n):
                g = d = r = math.inf
            else:
                g = ref_ratio(n, self.S[u] / self.c[u]) if self.c[u] > 0 else 1.0
                d = ref_ratio(g, sum(self.W[u]) / len(self.W[u])) if self.W[u] else 1.0
                if gamma is None:
                    r = max(g / alpha, d / beta)
                else:
                    r = max(g / alpha, d / beta, error[u] / gamma)
            gnmr.append(g)
            dgnmr.append(d)
            risk.append(r)
        exceed = [r > 1 for r in risk]
        for u in range(self.u):
            if not exceed[u]:
                self.lock[u] = max(self.lock[u] - 1, 0)
        pin_now = ref_holds(self.pinned_from, t, decay)
        pinned = [u for u in range(self.u) if pin_now and self.pinned[u] and self.eligible[u]]
        cands = [
            u
            for u in range(self.u)
            if self.eligible[u]
            and u not in pinned
            and (exceed[u] or self.lock[u] > 0 or self.latched[u] > 0)
        ]
        if t <= self.warmup:
            cands = []
        first = sorted(
            (u for u in cands if self.latched[u] > 0), key=lambda u: (self.latched[u], u)
        )
        rest = sorted((u for u in cands if self.latched[u] == 0), key=lambda u: (-risk[u], u))
        chosen, spent = [], 0
        for u in first + rest:
            fits = share is None or spent + self.costs[u] <= Fraction(repr(share)) * self.total
            if len(chosen) < k and fits:
                chosen.append(u)
                spent += self.costs[u] if share is not None else 0
        chosen = sorted(chosen)
        latch_now = ref_holds(self.latch, t, decay)
        for u in range(self.u):
            if u in chosen:
                if exceed[u]:
                    self.lock[u] = self.lock_steps
                    if latch_now and self.latched[u] == 0:
                        self.latched[u] = t
            else:
                self.lock[u] = 0
                self.latched[u] = 0
        for u in self.plan:
            self.recovered[u] += 1
        active = sorted(chosen + pinned)
        self.plan = active
        for u in range(self.u):
            if not math.isfinite(float(norms[u])):
                self.nonfinite[u] += 1
                if self.first_nonfinite is None:
                    self.first_nonfinite = (t, u)
        for u in range(self.u):
            n = float(norms[u])
            if math.isfinite(n):
                self.S[u] += n
                self.c[u] += 1
                if math.isfinite(gnmr[u]):
                    self.W[u].append(gnmr[u])
        return {
            "step": t,
            "active": tuple(active),
            "candidates": tuple(sorted(cands)),
            "gnmr": gnmr,
            "delta_gnmr": dgnmr,
            "risk": risk,
            "error": error if gamma is not None else None,
            "gamma": gamma,
            "lock": list(self.lock),
            "chosen": tuple(chosen),
            "pinned": tuple(pinned),
            "latched": list(self.latched),
            "k": k,
            "recovered": list(self.recovered),
            "nonfinite": list(self.nonfinite),
            "first_nonfinite": self.first_nonfinite,
        }
