"""Part (b) of :mod:`benchmarks.overhead`: the monitor against plain gradient clipping.

On the same gradients, interleaved CPU-time medians of ``clip_grad_norm_`` (reads every
gradient, then scales it), ``GradNormMonitor.compute`` (reads every gradient once; per-unit and
global norms) and monitor + one controller decision, on the harness Llama's real gradients and
on a larger Llama-shaped stack (``benchmarks/overhead/monitor.py``). The ratio of each median to
``clip_grad_norm_``'s says what the monitor costs next to the clipping every run already does.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import hf_loss, interleaved_times
from benchmarks.harness.model import Batches, build_model


def part_b(setup: Setup, repeats: int) -> list[dict[str, Any]]:
    """One row per (gradients, arm): the median CPU ms and its ratio to ``clip_grad_norm_``."""
    from benchmarks.overhead.monitor import build as stack

    small = build_model(setup)
    hf_loss(small, Batches(setup.data, setup)(0)).backward()
    models = {"harness Llama, real grads": small, "Llama-shaped stack 4 x 1024": stack(4, 1024)}
    rows = []
    for label, model in models.items():
        rows += _monitor_vs_clip(label, model, repeats)
    return rows


def _monitor_vs_clip(label: str, model: nn.Module, repeats: int) -> list[dict[str, Any]]:
    """The three arms on ``model``'s gradients (left in place: ``max_norm`` never clips)."""
    from gnmr_dist.core import GNMRConfig, GNMRController
    from gnmr_dist.distributed import GradNormMonitor, UnitRegistry

    params = [p for p in model.parameters() if p.grad is not None]
    registry = UnitRegistry.from_model(model)
    monitor = GradNormMonitor(registry)
    ctrl = GNMRController(registry.num_units, GNMRConfig(max_active=2))
    arms: dict[str, Callable[[], object]] = {
        "clip_grad_norm_": lambda: nn.utils.clip_grad_norm_(params, max_norm=1e9),
        "monitor": monitor.compute,
        "monitor + controller": lambda: ctrl.step(monitor.compute().norms),
    }
    times = interleaved_times(arms, repeats)
    base = statistics.median(times["clip_grad_norm_"])
    grads = f"{label} ({sum(p.numel() for p in params) / 1e6:.1f}M, {registry.num_units} units)"
    return [
        {
            "grads": grads,
            "arm": name,
            "median_ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(ts) / base,
        }
        for name, ts in times.items()
    ]
