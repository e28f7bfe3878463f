"""Cost of the per-unit monitor against plain gradient clipping, on the same gradients.

    python -m benchmarks.overhead.monitor [--layers 8] [--hidden 1024] [--repeats 30]

``clip_grad_norm_``, ``get_total_norm`` and ``GradNormMonitor.compute()`` on the gradients of a
Llama-shaped stack of projections, interleaved: docs/benchmarks.md#overhead-monitor. Part (b) of
:mod:`benchmarks.overhead` (:func:`part_b`) times ``clip_grad_norm_``, the monitor and monitor +
one controller decision in CPU time, on the harness Llama's real gradients and on this stack.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import arg_parser, hf_loss, interleaved_times, start_cli
from benchmarks.harness.model import Batches, build_model
from gnmr_dist.distributed import GradNormMonitor, UnitRegistry

logger = logging.getLogger(__name__)


class Layer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        ffn = hidden * 8 // 3
        self.norm = nn.LayerNorm(hidden)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(hidden, hidden, bias=False))
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)


def build(layers: int, hidden: int) -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(4096, hidden)
    model.layers = nn.ModuleList(Layer(hidden) for _ in range(layers))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def part_b(setup: Setup, repeats: int) -> list[dict[str, Any]]:
    """One row per (gradients, arm): the median CPU ms and its ratio to ``clip_grad_norm_``."""
    small = build_model(setup)
    hf_loss(small, Batches(setup.data, setup)(0)).backward()
    models = {"harness Llama, real grads": small, "Llama-shaped stack 4 x 1024": build(4, 1024)}
    rows = []
    for label, model in models.items():
        rows += _monitor_vs_clip(label, model, repeats)
    return rows


def _monitor_vs_clip(label: str, model: nn.Module, repeats: int) -> list[dict[str, Any]]:
    """The three arms on ``model``'s gradients (left in place: ``max_norm`` never clips)."""
    from gnmr_dist.core import GNMRConfig, GNMRController

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


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    start_cli()
    model = build(args.layers, args.hidden)
    params = list(model.parameters())
    monitor = GradNormMonitor(UnitRegistry.from_model(model))
    n = sum(p.numel() for p in params)
    logger.info(
        f"{n / 1e6:.1f}M parameters, {monitor.registry.num_units} units, "
        f"{torch.get_num_threads()} threads"
    )
    arms: dict[str, Callable[[], object]] = {
        "clip_grad_norm_": lambda: nn.utils.clip_grad_norm_(params, max_norm=1e9),
        "get_total_norm": lambda: nn.utils.get_total_norm([p.grad for p in params]),
        "monitor": monitor.compute,
    }
    times = interleaved_times(arms, args.repeats, clock=time.perf_counter)
    base = statistics.median(times["clip_grad_norm_"])
    logger.info(f"{'arm':>16} {'median ms':>10} {'/ clip':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        logger.info(f"{name:>16} {med * 1e3:>10.2f} {med / base:>7.3f}")
    check = monitor.compute().global_norm / float(nn.utils.get_total_norm([p.grad for p in params]))
    logger.info(f"monitor global norm / torch total norm = {check:.9f}")


if __name__ == "__main__":
    main()
