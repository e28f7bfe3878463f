"""What a coarser ``error_every`` costs in selection: decisions replayed against every-step scores.

    python -m benchmarks.sweep.shadow_replay [--demo-trace runs/demo_e/trace.jsonl]
        [--fault-steps 200] [--intervals 1,5,10,25,50]

A run with ``gnmr.gamma`` measured at every step records each step's norms and error scores.
Replaying its controller with ``e`` measured only every ``N``-th step (and carried in between, as
the runtime carries it; ``e = 0`` before the first measured step) gives the decisions a run with
``"error_every": N`` would have made on the same gradients. The figure is the share of steps
whose active set is identical to the every-step replay's, and the share of the every-step
replay's recovered unit-steps that the coarser one also recovers. The replay is open-loop: the
gradients are the every-step run's, so a decision that would have changed later gradients is
compared on gradients it did not produce.

Two recordings: the demo (``configs/demo_deepspeed.hjson`` with ``gamma``, a trace written by
``gnmr-launch``; give its path) and the ``outlier_delayed`` fault regime (per-tensor e4m3 under
delayed scaling, one ``down_proj`` input channel rising x4 per step to 2^20; run here in one
process on the harness's Llama, GNMR+e at the regime's ``gamma``). Writes
``benchmarks/results/shadow_replay.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from benchmarks.harness.common import RESULTS, arg_parser, start_cli
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.provenance import record

INTERVALS = (1, 10, 25, 50, 100, 200)

Factory = Callable[[], Any]
"""Builds a fresh controller with the recorded policy."""


def carried(errors: torch.Tensor, every: int) -> torch.Tensor:
    """``[T, U]`` scores as a run with ``error_every = every`` feeds them: step ``t`` (1-based)
    gets the scores of the last measured step ``s <= t`` (``s % every == 0``), 0 before."""
    out = torch.zeros_like(errors)
    last = torch.zeros_like(errors[0])
    for i in range(errors.shape[0]):
        if (i + 1) % every == 0:
            last = errors[i]
        out[i] = last
    return out


def decide(
    factory: Factory, norms: torch.Tensor, errors: torch.Tensor, lrs: Sequence[float] | None
) -> list[tuple[int, ...]]:
    ctrl = factory()
    return [
        ctrl.step(norms[i], errors=errors[i], lr=None if lrs is None else lrs[i]).active
        for i in range(norms.shape[0])
    ]


def agreement(
    factory: Factory,
    norms: torch.Tensor,
    errors: torch.Tensor,
    lrs: Sequence[float] | None,
    intervals: Sequence[int],
) -> list[dict[str, Any]]:
    """Per interval: the share of identical active sets and of the every-step replay's
    recovered unit-steps kept, against the every-step replay."""
    base = decide(factory, norms, errors, lrs)
    base_units = sum(len(a) for a in base)
    rows = []
    for n in intervals:
        got = decide(factory, norms, carried(errors, n), lrs)
        same = sum(a == b for a, b in zip(got, base, strict=True))
        kept = sum(len(set(a) & set(b)) for a, b in zip(got, base, strict=True))
        rows.append(
            {
                "error_every": n,
                "steps": len(base),
                "identical_active_sets": same / len(base),
                "recovered_unit_steps_kept": kept / base_units if base_units else None,
                "recovered_unit_steps": sum(len(a) for a in got),
                "every_step_recovered_unit_steps": base_units,
            }
        )
    return rows


def demo(path: str, intervals: Sequence[int], quantile: float) -> dict[str, Any]:
    """The demo's trace, replayed with its recorded policy and ``gamma`` at the ``quantile`` of
    its recorded scores after warm-up (the demo is recorded with a ``gamma`` no score reaches,
    so its gradients are the demo's own)."""
    from gnmr_dist.core import GNMRConfig
    from gnmr_dist.telemetry.replay import Recording

    rec = Recording.read(path)
    if rec.errors is None:
        raise SystemExit(f"{path} holds no error scores: record the demo with gnmr.gamma set")
    recorded = rec.header.config
    warm = recorded.warmup_steps
    gamma = float(torch.quantile(rec.errors[warm:].flatten(), quantile))
    cfg = GNMRConfig.from_dict({**recorded.to_dict(), "gamma": gamma})
    factory = lambda: rec.controller(cfg)  # noqa: E731
    return {
        "trace": path,
        "recorded_gamma": recorded.to_dict().get("gamma"),
        "gamma": gamma,
        "gamma_quantile": quantile,
        "rows": agreement(factory, rec.norms, rec.errors, rec.lrs, intervals),
    }


def fault_run(
    steps: int, point: int, budget: int
) -> tuple[Factory, torch.Tensor, torch.Tensor, list[float], dict[str, Any]]:
    """``outlier_delayed``'s GNMR+e arm, measured every step, recorded in memory."""
    from benchmarks.harness.arms import Arm
    from benchmarks.harness.branch import _with_outlier
    from benchmarks.harness.model import Batches
    from benchmarks.harness.training import ArmRun
    from benchmarks.sweep.regimes import FAULT_REGIMES
    from gnmr_dist.distributed.runtime import build_controller

    regime = FAULT_REGIMES["outlier_delayed"]
    setup = replace(regime.setup, steps=steps, eval_every=10**9)
    setup = _with_outlier(setup, setup.seed, point)
    arm = Arm(
        "GNMR+e", "gnmr", max_active=budget, controller=regime.error_policy(), error_every=1,
        **regime.backend_args(),
    )  # fmt: skip
    run = ArmRun(setup, arm, Batches(setup.heldout, setup), evaluates=False)
    norms, errors, lrs = [], [], []
    observe = run.runtime.observe

    def recording(n: Any, *, lr: float | None = None) -> Any:
        decision = observe(n, lr=lr)
        norms.append(n.norms.clone())
        errors.append(decision.error.clone())
        lrs.append(lr)
        return decision

    run.runtime.observe = recording  # type: ignore[method-assign]
    train = Batches(setup.data, setup)
    for step in range(1, steps + 1):
        run.step(step, train)
    cfg = run.cfg
    factory = lambda: build_controller(run.registry, cfg)  # noqa: E731
    info = {"regime": regime.name, "gamma": regime.gamma, "budget": budget, "outliers": [
        {k: getattr(o, k) for k in ("module", "channel", "start")} for o in setup.outliers
    ]}  # fmt: skip
    return factory, torch.stack(norms), torch.stack(errors), lrs, info


def table(name: str, rows: Sequence[dict[str, Any]]) -> str:
    header = ["run", "error_every", "identical active sets", "recovered unit-steps kept"]
    body = [
        [name, str(r["error_every"]), f"{r['identical_active_sets']:.3f}",
         "-" if r["recovered_unit_steps_kept"] is None else f"{r['recovered_unit_steps_kept']:.3f}"]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, body)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arg_parser(__doc__)
    p.prog = "python -m benchmarks.sweep.shadow_replay"
    p.add_argument("--demo-trace", default=None, help="the demo's trace.jsonl, recorded with gamma")
    p.add_argument("--demo-quantile", type=float, default=0.95, help="the demo's gamma quantile")
    p.add_argument("--fault-steps", type=int, default=200, help="steps of the fault run")
    p.add_argument("--fault-point", type=int, default=100, help="where its outlier is planted")
    p.add_argument("--budget", type=int, default=3, help="max_active of the fault run")
    p.add_argument("--intervals", default=",".join(map(str, INTERVALS)))
    p.add_argument("--out", default=str(RESULTS / "shadow_replay.json"), help="the JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    start_cli(1)
    intervals = [int(n) for n in a.intervals.split(",")]
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "intervals": intervals}
    if a.demo_trace:
        out["demo"] = demo(a.demo_trace, intervals, a.demo_quantile)
        print(table("demo", out["demo"]["rows"]))
    factory, norms, errors, lrs, info = fault_run(a.fault_steps, a.fault_point, a.budget)
    out["fault"] = {**info, "rows": agreement(factory, norms, errors, lrs, intervals)}
    print(table("outlier_delayed", out["fault"]["rows"]))
    out["provenance"] = record()
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
