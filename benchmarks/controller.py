"""Cost of one controller decision per optimizer step, for several unit counts.

    python -m benchmarks.controller [--units 64 1024 16384] [--steps 2000]

Feeds a realistic trace (log-normal norms with rare spikes and NaNs) through the controller and
prints the median and 90th-percentile wall time of ``GNMRController.step``. For scale it also
prints the time of a 1024x1024 fp32 matmul on the same machine in the same run, the smallest
GEMM of a small model's step: the controller's cost is reported as a fraction of it.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import arg_parser
from gnmr_dist import GNMRConfig, GNMRController


def trace(units: int, steps: int, seed: int = 0) -> torch.Tensor:
    """[steps, units] float64 norms: log-normal noise, 0.1% spikes x20, 0.01% NaN."""
    g = torch.Generator().manual_seed(seed)
    base = torch.exp(torch.randn(units, generator=g, dtype=torch.float64))
    noise = torch.exp(0.2 * torch.randn(steps, units, generator=g, dtype=torch.float64))
    norms = base * noise
    spikes = torch.rand(steps, units, generator=g) < 1e-3
    norms = torch.where(spikes, norms * 20, norms)
    return torch.where(torch.rand(steps, units, generator=g) < 1e-4, float("nan"), norms)


def time_steps(units: int, steps: int) -> list[float]:
    """Per-step wall times (seconds) of the controller on a fresh trace."""
    ctrl = GNMRController(units, GNMRConfig(max_active=max(1, units // 64)))
    norms = trace(units, steps)
    times = []
    for row in norms:
        t0 = time.perf_counter()
        ctrl.step(row)
        times.append(time.perf_counter() - t0)
    return times[steps // 10 :]  # drop warm-up iterations


def matmul_time(reps: int = 20) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return (time.perf_counter() - t0) / reps


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--units", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    gemm = matmul_time()
    print(f"reference: one 1024x1024x1024 fp32 matmul = {gemm * 1e3:.2f} ms")
    print(f"{'units':>8} {'median ms':>10} {'p90 ms':>8} {'/ matmul':>9}")
    for units in args.units:
        times = sorted(time_steps(units, args.steps))
        med, p90 = statistics.median(times), times[int(0.9 * len(times))]
        print(f"{units:>8} {med * 1e3:>10.3f} {p90 * 1e3:>8.3f} {med / gemm:>9.3f}")


if __name__ == "__main__":
    main()
