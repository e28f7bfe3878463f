"""Cost of one controller decision per optimizer step, for several unit counts.

    python -m benchmarks.overhead.controller [--units 28 1024 4096 16384] [--steps 2000]

``GNMRController.step`` on a realistic norm trace, timed side by side with :class:`NumpyTwin`
(the policy of docs/algorithm.md in 25 lines of numpy; every decision of the two must be
identical) and next to a 1024x1024 fp32 matmul: docs/benchmarks.md#overhead-controller.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import torch

from benchmarks.harness.common import arg_parser, start_cli
from gnmr_dist import GNMRConfig, GNMRController

logger = logging.getLogger(__name__)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.where(b > 0, a / np.where(b > 0, b, 1.0), np.inf)
    return np.where((a == 0) & (b == 0), 1.0, out)


class NumpyTwin:
    """docs/algorithm.md (no error term), as plainly as numpy says it: the yardstick."""

    def __init__(self, units: int, cfg: GNMRConfig) -> None:
        self.cfg, self.t = cfg, 0
        self.s, self.c = np.zeros(units), np.zeros(units, np.int64)
        self.w, self.wl = np.zeros((units, cfg.window)), np.zeros(units, np.int64)
        self.lock, self.elig = np.zeros(units, np.int64), np.ones(units, bool)

    def step(self, n: np.ndarray) -> tuple[int, ...]:
        cfg, t = self.cfg, self.t + 1
        a, b = cfg.thresholds_at(t)
        fin = np.isfinite(n)
        have = self.c > 0
        g = np.where(have, _ratio(np.where(fin, n, 0.0), self.s / np.where(have, self.c, 1)), 1.0)
        wm = np.cumsum(self.w, 1)[:, -1] / np.maximum(self.wl, 1)
        d = np.where(self.wl > 0, _ratio(g, wm), 1.0)
        g, d = np.where(fin, g, np.inf), np.where(fin, d, np.inf)
        risk = np.maximum(g / a, d / b)
        ex = risk > 1
        lock = np.where(ex, self.lock, np.maximum(self.lock - 1, 0))
        cand = self.elig & (ex | (lock > 0)) & (t > cfg.warmup_steps)
        ids = np.flatnonzero(cand)
        act = ids[np.argsort(-risk[ids], kind="stable")[: cfg.max_active]]
        held = np.zeros_like(cand)
        held[act] = True
        self.lock = np.where(held, np.where(ex, cfg.lock_steps, lock), 0)
        self.s += np.where(fin, n, 0.0)
        self.c += fin
        push = np.isfinite(g)
        self.w = np.where(push[:, None], np.concatenate([self.w[:, 1:], g[:, None]], 1), self.w)
        self.wl = np.where(push, np.minimum(self.wl + 1, cfg.window), self.wl)
        self.t = t
        return tuple(np.sort(act).tolist())


def trace(units: int, steps: int, seed: int = 0) -> torch.Tensor:
    """[steps, units] float64 norms: log-normal noise, 0.1% spikes x20, 0.01% NaN."""
    g = torch.Generator().manual_seed(seed)
    base = torch.exp(torch.randn(units, generator=g, dtype=torch.float64))
    noise = torch.exp(0.2 * torch.randn(steps, units, generator=g, dtype=torch.float64))
    norms = base * noise
    spikes = torch.rand(steps, units, generator=g) < 1e-3
    norms = torch.where(spikes, norms * 20, norms)
    return torch.where(torch.rand(steps, units, generator=g) < 1e-4, float("nan"), norms)


def time_steps(units: int, steps: int) -> tuple[list[float], list[float]]:
    """Per-step wall times (seconds) of the controller and of the numpy twin on one fresh trace,
    alternating which goes first; raises if a decision differs."""
    cfg = GNMRConfig(max_active=max(1, units // 64))
    ctrl, twin = GNMRController(units, cfg), NumpyTwin(units, cfg)
    norms = trace(units, steps)
    ours, theirs = [], []
    for i, row in enumerate(norms):
        runs = [(ctrl.step, row, ours), (twin.step, row.numpy(), theirs)]
        got = []
        for step, x, times in runs if i % 2 else runs[::-1]:
            t0 = time.perf_counter()
            out = step(x)
            times.append(time.perf_counter() - t0)
            got.append(out if isinstance(out, tuple) else out.active)
        if got[0] != got[1]:
            raise RuntimeError(f"step {i + 1}: controller and twin decide {got}")
    return ours[steps // 10 :], theirs[steps // 10 :]  # drop warm-up iterations


def matmul_time(reps: int = 20) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return (time.perf_counter() - t0) / reps


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--units", type=int, nargs="+", default=[28, 1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    start_cli()
    logger.info(
        f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} threads"
    )
    gemm = matmul_time()
    logger.info(f"reference: one 1024x1024x1024 fp32 matmul = {gemm * 1e3:.2f} ms")
    logger.info(
        f"{'units':>8} {'median ms':>10} {'p90 ms':>8} {'/ matmul':>9} {'twin ms':>8} "
        f"{'/ twin':>7}  decisions"
    )
    for units in args.units:
        ours, theirs = time_steps(units, args.steps)
        med, p90 = statistics.median(ours), sorted(ours)[int(0.9 * len(ours))]
        twin = statistics.median(theirs)
        logger.info(
            f"{units:>8} {med * 1e3:>10.3f} {p90 * 1e3:>8.3f} {med / gemm:>9.3f} "
            f"{twin * 1e3:>8.3f} {med / twin:>7.2f}  identical"
        )


if __name__ == "__main__":
    main()
