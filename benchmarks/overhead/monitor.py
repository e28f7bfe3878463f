"""Cost of the per-unit monitor against plain gradient clipping, on the same gradients.

    python -m benchmarks.overhead.monitor [--layers 8] [--hidden 1024] [--repeats 30]

``clip_grad_norm_``, ``get_total_norm`` and ``GradNormMonitor.compute()`` on the gradients of a
Llama-shaped stack of projections, interleaved: docs/benchmarks.md#overhead-monitor.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.harness.common import arg_parser, interleaved_times, start_cli
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
