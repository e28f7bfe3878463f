"""The CLI tests' trace: a real controller, spikes at steps 21 and 41, a NaN norm at step 31."""

from __future__ import annotations

import torch

from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.telemetry import TraceHeader, TraceWriter

ELIGIBLE = [True, True, True, True, True, False]
CFG = GNMRConfig(max_active=2, lock_steps=3, window=4, warmup_steps=5)


def record_trace(path, units, steps=60, loss=True, meta=None):
    """Write the trace to ``path``; return the config and the controller's decisions."""
    ctrl = GNMRController(6, CFG, eligible=ELIGIBLE)
    g = torch.Generator().manual_seed(1)
    decisions = []
    with TraceWriter(path, TraceHeader(tuple(units), tuple(ELIGIBLE), CFG, meta or {})) as w:
        for t in range(steps):
            norms = torch.rand(6, generator=g, dtype=torch.float64) + 1
            if t in (20, 40):
                norms[t % 5] *= 10
            if t == 30:
                norms[2] = float("nan")
            d = ctrl.step(norms)
            decisions.append(d)
            w.write(norms, d, {"loss": 1.0 / (t + 1)} if loss else {})
    return CFG, decisions
