"""Cost of one controller decision per optimizer step, for several unit counts.

    python -m benchmarks.overhead.controller [--units 28 1024 4096 16384] [--steps 2000]
        [--out benchmarks/results/overhead_v2_controller.json]

``GNMRController.step`` on a realistic norm trace, timed side by side with :class:`NumpyTwin`
(the policy of docs/algorithm.md in 25 lines of numpy; every decision of the two must be
identical) and with the controller under the second policy's features (:func:`v2_setup`: a
``max_active`` schedule on the lr_decay clock, ``max_share`` with random integer costs,
``latch`` and ``pinned``; every decision checked against the budgets), next to a 1024x1024 fp32
matmul: docs/benchmarks.md#overhead-controller.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness.common import RESULTS, arg_parser, start_cli
from benchmarks.harness.provenance import record
from gnmr_dist import GNMRConfig, GNMRController
from gnmr_dist.core import Decision

logger = logging.getLogger(__name__)

ARMS = ("twin", "off", "v2")
"""The timed deciders: the numpy twin, the controller without and with the second policy."""


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


def budget_of(units: int) -> int:
    """``k``: one unit in 64 (at least 1), the plain arms' ``max_active``."""
    return max(1, units // 64)


def lr_trace(steps: int, peak: float = 1e-3) -> np.ndarray:
    """[steps] learning rates: linear warm-up over 5% of the steps, cosine decay to 10%."""
    t = np.arange(1, steps + 1, dtype=np.float64)
    warm = max(1, steps // 20)
    f = np.clip((t - warm) / max(1, steps - warm), 0.0, 1.0)
    return np.where(t < warm, peak * t / warm, peak * (0.1 + 0.45 * (1 + np.cos(np.pi * f))))


def v2_setup(units: int, steps: int, seed: int = 0) -> tuple[GNMRConfig, dict[str, Any]]:
    """The second policy at ``units``, and the controller's keyword arguments.

    ``max_active`` grows from ``k`` to ``2k`` as the learning rate decays (lr_decay clock);
    ``max_share`` is ``k / (2U)`` of ``W = 3 sum w`` with ``w`` random integers in [1, 1000]
    (fprop-only costs), so the cap holds about 1.5 times ``k`` average units and binds when the
    risky units are costly; ``latch`` from half decay; ``pinned``: the last ``U // 32`` units
    (at least 1) from a quarter of the steps.
    """
    k = budget_of(units)
    rng = np.random.default_rng(seed)
    costs = rng.integers(1, 1001, size=units)
    pinned = np.zeros(units, dtype=bool)
    pinned[units - max(1, units // 32) :] = True
    cfg = GNMRConfig.from_dict(
        {
            "max_active": {"schedule": "linear", "start": k, "end": 2 * k, "clock": "lr_decay"},
            "max_share": float(f"{k / (2 * units):.6g}"),
            "latch": {"lr_decay": 0.5},
            "pinned": {"units": {"last_layers": 1}, "from": {"step": max(1, steps // 4)}},
        }
    )
    kwargs = {"costs": costs, "total_cost": 3 * int(costs.sum()), "pinned": pinned}
    return cfg, kwargs


def check_v2(d: Decision, cfg: GNMRConfig, kwargs: dict[str, Any], steps: int) -> list[int]:
    """The budgets of one second-policy decision, checked from the decision's own sets:
    ``|A_t| <= k_t``, ``cost(A_t) <= s_t W`` (as fractions), ``P_t`` the pinned mask exactly
    from its step on (empty before) and disjoint from ``A_t``. Returns ``[|A_t|, |P_t|, 1 if
    the cap bound (fewer chosen than both k_t and the candidates)]``; raises ``RuntimeError``
    on a breach."""
    chosen, pinned = list(d.chosen), list(d.pinned)
    cost = int(kwargs["costs"][chosen].sum()) if chosen else 0
    cap = Fraction(repr(cfg.max_share)) * kwargs["total_cost"]
    pin_from = max(1, steps // 4)
    want = np.flatnonzero(kwargs["pinned"]).tolist() if d.step >= pin_from else []
    budget = d.telemetry.budget
    ok = budget is not None and len(chosen) <= budget and cost <= cap and pinned == want
    if not ok or set(chosen) & set(pinned):
        raise RuntimeError(
            f"step {d.step}: budgets breached: chosen {chosen} (cost {cost}, "
            f"cap {float(cap)}, k {budget}), pinned {pinned} (want {want})"
        )
    bound = len(chosen) < min(budget, d.telemetry.num_candidates)
    return [len(chosen), len(pinned), int(bound)]


def time_steps(units: int, steps: int) -> dict[str, Any]:
    """Per-step wall times (seconds) of :data:`ARMS` on one fresh trace, the order rotating
    every step; raises if the controller and the twin differ or a v2 decision breaks a budget.
    Also, of the v2 arm: the mean ``|A_t|`` and ``|P_t|``, the share of steps the cost cap
    bound, and the latched units at the end."""
    cfg = GNMRConfig(max_active=budget_of(units))
    v2_cfg, kwargs = v2_setup(units, steps)
    ctrl, twin = GNMRController(units, cfg), NumpyTwin(units, cfg)
    v2 = GNMRController(units, v2_cfg, **kwargs)
    norms, lrs = trace(units, steps), lr_trace(steps)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    counts = []
    for i, row in enumerate(norms):
        x, lr = row.numpy(), float(lrs[i])  # the inputs, made before any clock starts
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("twin", lambda x=x: twin.step(x)),
            ("off", lambda row=row: ctrl.step(row)),
            ("v2", lambda row=row, lr=lr: v2.step(row, lr=lr)),
        ]
        got = {}
        for arm, call in calls[i % 3 :] + calls[: i % 3]:
            t0 = time.perf_counter()
            got[arm] = call()
            times[arm].append(time.perf_counter() - t0)
        if got["off"].active != got["twin"]:
            raise RuntimeError(f"step {i + 1}: controller and twin decide {got}")
        counts.append(check_v2(got["v2"], v2_cfg, kwargs, steps))
    skip = steps // 10  # warm-up iterations
    mean = np.mean(counts, axis=0).tolist()
    latched = int((v2.latches > 0).sum())
    return {
        "times": {arm: t[skip:] for arm, t in times.items()},
        "v2_mean_chosen": mean[0],
        "v2_mean_pinned": mean[1],
        "v2_cap_bound_share": mean[2],
        "v2_latched_at_end": latched,
        "v2_policy": v2_cfg.to_dict(),
    }


def summarize(units: int, res: dict[str, Any]) -> dict[str, Any]:
    """Median and 90th percentile (microseconds) per arm, and the ratios of the medians."""
    row: dict[str, Any] = {"units": units, "k": budget_of(units)}
    for arm, t in res["times"].items():
        row[f"{arm}_us"] = 1e6 * statistics.median(t)
        row[f"{arm}_p90_us"] = 1e6 * sorted(t)[int(0.9 * len(t))]
    row["off_over_twin"] = row["off_us"] / row["twin_us"]
    row["v2_over_twin"] = row["v2_us"] / row["twin_us"]
    row["v2_over_off"] = row["v2_us"] / row["off_us"]
    row["decisions_identical"] = True  # time_steps raises otherwise
    row["v2_budgets_held"] = True
    row.update({k: v for k, v in res.items() if k.startswith("v2_")})
    return row


def matmul_time(reps: int = 20) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return (time.perf_counter() - t0) / reps


def table(rows: Sequence[dict[str, Any]], gemm: float) -> str:
    """One line per unit count: the three arms' medians (us), p90 and the ratios."""
    lines = [
        f"{'units':>6} {'k':>4} {'twin us':>9} {'off us':>9} {'off p90':>9} {'v2 us':>9} "
        f"{'v2 p90':>9} {'off/twin':>8} {'v2/twin':>8} {'v2/off':>7} {'v2/matmul':>9}  "
        "mean |A|, |P|, cap bound, latched"
    ]
    for r in rows:
        lines.append(
            f"{r['units']:>6} {r['k']:>4} {r['twin_us']:>9.1f} {r['off_us']:>9.1f} "
            f"{r['off_p90_us']:>9.1f} {r['v2_us']:>9.1f} {r['v2_p90_us']:>9.1f} "
            f"{r['off_over_twin']:>8.2f} {r['v2_over_twin']:>8.2f} {r['v2_over_off']:>7.2f} "
            f"{r['v2_us'] * 1e-6 / gemm:>9.3f}  {r['v2_mean_chosen']:.1f}, "
            f"{r['v2_mean_pinned']:.1f}, {100 * r['v2_cap_bound_share']:.0f}%, "
            f"{r['v2_latched_at_end']}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = arg_parser(__doc__)
    parser.add_argument("--units", type=int, nargs="+", default=[28, 1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=str(RESULTS / "overhead_v2_controller.json"))
    args = parser.parse_args(argv)
    start_cli()
    logger.info(
        f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} threads"
    )
    gemm = matmul_time()
    logger.info(f"reference: one 1024x1024x1024 fp32 matmul = {gemm * 1e3:.2f} ms")
    rows = [summarize(u, time_steps(u, args.steps)) for u in args.units]
    logger.info(table(rows, gemm) + "\ndecisions of off and twin identical; v2 budgets held")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.overhead.controller",
        "args": vars(args),
        "matmul_1024_ms": gemm * 1e3,
        "rows": rows,
        "provenance": record(),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
