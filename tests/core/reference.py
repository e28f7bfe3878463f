"""An independent, deliberately naive reference of docs/algorithm.md.

Plain Python floats and lists, one unit at a time, written from the spec text and sharing no code
with ``gnmr_dist.core``: the vectorised controller must agree with it decision for decision.
With ``gamma`` (section 2.1) each step also takes one error score per unit, and the risk gains
the term ``e / gamma_t`` (+inf for a non-finite ``e``); the errors touch nothing else.
"""

from __future__ import annotations

import math
from collections import deque


def ref_ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    if a == 0 and b == 0:
        return 1.0
    return math.inf


def ref_threshold(spec, t: int) -> float:
    if not isinstance(spec, dict):
        return float(spec)
    a, b, n = spec["start"], spec["end"], spec["steps"]
    f = min((t - 1) / n, 1.0)
    if spec["schedule"] == "constant":
        return a
    if spec["schedule"] == "linear":
        return a + (b - a) * f
    return b + (a - b) * (1 + math.cos(math.pi * f)) / 2


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
    ):
        self.u = num_units
        self.max_active, self.lock_steps, self.warmup = max_active, lock_steps, warmup_steps
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.eligible = list(eligible) if eligible is not None else [True] * num_units
        self.S = [0.0] * num_units
        self.c = [0] * num_units
        self.W = [deque(maxlen=window) for _ in range(num_units)]
        self.lock = [0] * num_units
        self.t = 0

    def step(self, norms, errors=None):
        assert (errors is None) == (self.gamma is None)
        self.t += 1
        t = self.t
        alpha, beta = ref_threshold(self.alpha, t), ref_threshold(self.beta, t)
        gamma = None if self.gamma is None else ref_threshold(self.gamma, t)
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
        cands = [u for u in range(self.u) if self.eligible[u] and (exceed[u] or self.lock[u] > 0)]
        if t <= self.warmup:
            cands = []
        ranked = sorted(cands, key=lambda u: (-risk[u], u))
        active = sorted(ranked[: self.max_active])
        for u in range(self.u):
            if u in active:
                if exceed[u]:
                    self.lock[u] = self.lock_steps
            else:
                self.lock[u] = 0
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
        }
