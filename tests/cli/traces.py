"""The CLI tests' trace: a real controller, spikes at steps 21 and 41, a NaN norm at step 31."""

from __future__ import annotations

from dataclasses import replace

import torch

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.telemetry import TraceHeader, TraceWriter

ELIGIBLE = [True, True, True, True, True, False]
CFG = GNMRConfig(max_active=2, lock_steps=3, window=4, warmup_steps=5)


GAMMA_CFG = replace(CFG, gamma=0.5)
"""CFG with docs/algorithm.md#damage-term's error term."""


def errors_at(t: int, g: torch.Generator) -> torch.Tensor:
    """Error scores of step ``t``: small, unit 3 damaged on steps 10-24, unit 1 +inf at 35."""
    e = torch.rand(6, generator=g, dtype=torch.float64) * 0.2
    if 10 <= t < 25:
        e[3] = 2.0
    if t == 35:
        e[1] = float("inf")
    return e


def record_trace(path, units, steps=60, loss=True, meta=None, cfg=CFG):
    """Write the trace to ``path``; return the config and the controller's decisions.

    With ``cfg.gamma`` set the controller also scores :func:`errors_at`.
    """
    ctrl = GNMRController(6, cfg, eligible=ELIGIBLE)
    g = torch.Generator().manual_seed(1)
    ge = torch.Generator().manual_seed(2)
    decisions = []
    with TraceWriter(path, TraceHeader(tuple(units), tuple(ELIGIBLE), cfg, meta or {})) as w:
        for t in range(steps):
            norms = torch.rand(6, generator=g, dtype=torch.float64) + 1
            if t in (20, 40):
                norms[t % 5] *= 10
            if t == 30:
                norms[2] = float("nan")
            errors = errors_at(t, ge) if cfg.gamma is not None else None
            d = ctrl.step(norms, errors=errors)
            decisions.append(d)
            w.write(norms, d, {"loss": 1.0 / (t + 1)} if loss else {})
    return cfg, decisions
