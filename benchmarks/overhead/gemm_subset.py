"""Per-step cost of GNMR with a GEMM subset against the plain switch at the same plan (issue 34).

    python -m benchmarks.overhead.gemm_subset [--formats e4m3 e2m1] [--steps 48] [--warm 8]
        [--repeats 4] [--budget 3] [--threads 1]

For each low-cost format of ``fp8_emulated`` (recovery ``bf16``, ``"gemms": ["fprop"]``: a
recovered unit runs its forward GEMM on the recovery path, dgrad and wgrad on the low-cost one),
four arms train the harness's Llama from the same initial weights on the same batches, one step
each in turn (the order rotating every round), in one process:

* ``gnmr fprop``: GNMR's monitor and controller every step (``GNMRRuntime(group=None)``, at most
  ``--budget`` units), the plan it chose applied to the next step;
* ``plain fprop``: the same backend and subset without GNMR (no monitor, no controller): each step
  applies the plan ``gnmr fprop`` ran at that step, set on the backend directly. It trains exactly
  as ``gnmr fprop`` (checked: the same weights at the end of every repeat), so the paired ratio
  ``gnmr fprop / plain fprop`` is GNMR's own cost under a subset (issue 34: <= 1.01);
* ``plain fprop again``: a second copy of ``plain fprop``, the null control: its ratio to
  ``plain fprop`` is 1 but for the measurement's own noise, so its interval is the resolution of
  every other ratio of the run;
* ``plain all``: the same replayed plan with whole-unit recovery (all three GEMMs), for context.

``--repeats`` rebuilds the arms and runs again (the same work: the same plans); every recorded
round gives one paired ratio per arm. Printed and written to ``results/overhead_v2.json``: the
median of the pooled paired ratios with a bootstrap 95% interval of that median, the per-repeat
medians (min/max), wall and CPU time, and the monitor's and controller's own CPU time inside
``gnmr fprop``: where GNMR's time goes. docs/benchmarks.md#overhead-gemm_subset.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import hf_loss, start_cli
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.model import Batches, build_model
from benchmarks.harness.provenance import record
from benchmarks.overhead.config import GNMR_POLICY
from benchmarks.overhead.step_time import Arm, ArmSpec, clock, interleave, timing_parser

logger = logging.getLogger(__name__)

TARGET = 1.01
"""Issue 34: step time of GNMR with a GEMM subset / the plain switch at the same plan."""

SUBSET = ("fprop",)
"""The recovered GEMMs of the subset arms (NVIDIA's forward-only switch, docs/gemms.md)."""

FORMATS = {"e4m3": {"format": "e4m3"}, "e2m1": {"format": "e2m1"}}
"""Low-cost blocks by name: FP8 e4m3 (1 x 128 / 128 x 128 blocks) and NVFP4 (e2m1: 1 x 16 /
16 x 16 blocks, stochastic rounding, the Hadamard transform); recovery is bf16 for both."""

GNMR, PLAIN, NULL, ALL = "gnmr fprop", "plain fprop", "plain fprop again", "plain all"
"""The four arms (module docstring)."""


class SubsetArm(Arm):
    """The harness Llama with ``fp8_emulated`` on every projection, recovering ``gemms``."""

    def __init__(self, spec: ArmSpec, setup: Setup, gemms: Sequence[str] | None) -> None:
        from gnmr_dist.backends import get_backend
        from gnmr_dist.distributed import UnitRegistry

        super().__init__(spec)
        self.model = build_model(setup)
        self.registry = UnitRegistry.from_model(self.model, granularity="operator")
        self.backend = get_backend(spec.backend, **spec.options)
        if gemms is not None:
            self.backend.set_gemms(list(gemms))
        self.backend.wrap(self.registry.local_modules)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=setup.lr, weight_decay=setup.weight_decay)
        self.clip = setup.clip
        self.own_wall: list[float] = []
        """Wall seconds of GNMR's work (:meth:`score`) in each recorded step."""
        self._own = 0.0

    def plan_for(self, step: int) -> frozenset[int]:
        raise NotImplementedError

    def score(self) -> tuple[float, float]:
        """GNMR's work after the backward: (monitor, controller) CPU seconds; none here."""
        return 0.0, 0.0

    def step(self, tokens: torch.Tensor, step: int) -> None:
        """One timed step: plan, forward, backward, (GNMR), clip, AdamW; the backend's report
        (which units ran the recovery path) is read after the clock stops."""
        w0, c0 = clock()
        self.backend.apply(self.plan_for(step), step)
        loss = hf_loss(self.model, tokens)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        w_own = time.perf_counter()
        t_mon, t_ctl = self.score()
        self._own = time.perf_counter() - w_own
        nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        w1, c1 = clock()
        self._last = (w1 - w0, c1 - c0, t_mon, t_ctl, len(self.backend.report().recovered))

    def record(self) -> None:
        super().record()
        self.own_wall.append(self._own)


class GnmrArm(SubsetArm):
    """GNMR deciding each step under ``policy`` (``GNMRConfig`` keys); keeps the plan each step
    ran for the replaying arms."""

    def __init__(
        self, spec: ArmSpec, setup: Setup, gemms: Sequence[str] | None, policy: dict[str, Any]
    ) -> None:
        from gnmr_dist.core import GNMRConfig
        from gnmr_dist.distributed import GNMRRuntime

        super().__init__(spec, setup, gemms)
        self.runtime = GNMRRuntime(self.registry, GNMRConfig.from_dict(policy))
        self.plans: dict[int, frozenset[int]] = {}

    def plan_for(self, step: int) -> frozenset[int]:
        """The runtime's plan for ``step`` (published at the end of the step before)."""
        if step not in self.plans:
            plan = self.runtime.plan
            if plan.step != step:
                raise RuntimeError(f"{self.name}: asked for step {step}, plan is for {plan.step}")
            self.plans[step] = plan.active
        return self.plans[step]

    def score(self) -> tuple[float, float]:
        t0 = time.process_time()
        norms = self.runtime.monitor.compute()
        t1 = time.process_time()
        self.runtime.observe(norms)
        return t1 - t0, time.process_time() - t1


class ReplayArm(SubsetArm):
    """No GNMR: each step applies the plan ``source`` ran (or will run) at that step."""

    def __init__(
        self, spec: ArmSpec, setup: Setup, gemms: Sequence[str] | None, source: GnmrArm
    ) -> None:
        super().__init__(spec, setup, gemms)
        self.source = source

    def plan_for(self, step: int) -> frozenset[int]:
        return self.source.plan_for(step)


def build_arms(options: dict[str, Any], setup: Setup, policy: dict[str, Any]) -> list[SubsetArm]:
    """The four arms of the module docstring on one backend block, GNMR under ``policy``."""

    def spec(name: str, max_active: int | None) -> ArmSpec:
        return ArmSpec(name, "fp8_emulated", options, max_active)

    gnmr = GnmrArm(spec(GNMR, policy["max_active"]), setup, SUBSET, policy)
    return [
        gnmr,
        ReplayArm(spec(PLAIN, None), setup, SUBSET, gnmr),
        ReplayArm(spec(NULL, None), setup, SUBSET, gnmr),
        ReplayArm(spec(ALL, None), setup, None, gnmr),
    ]


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models hold bitwise the same parameters."""
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def median_interval(
    values: Sequence[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap 95% interval (percentiles 2.5 and 97.5) of the median of ``values``."""
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(lo), float(hi)


def ratio_stats(mine: list[list[float]], ref: list[list[float]]) -> dict[str, Any]:
    """Paired per-round ratios ``mine / ref`` (one list per repeat): the pooled median with its
    bootstrap interval, the per-repeat medians, and the ratio of the pooled medians."""
    per = [[a / b for a, b in zip(m, r, strict=True)] for m, r in zip(mine, ref, strict=True)]
    pooled = [x for rep in per for x in rep]
    reps = [statistics.median(rep) for rep in per]
    flat = [x for rep in mine for x in rep], [x for rep in ref for x in rep]
    return {
        "median": statistics.median(pooled),
        "ci95": median_interval(pooled),
        "repeat_medians": reps,
        "repeat_min_max": (min(reps), max(reps)),
        "ratio_of_medians": statistics.median(flat[0]) / statistics.median(flat[1]),
        "rounds": len(pooled),
    }


def measure(
    name: str, options: dict[str, Any], setup: Setup, a: argparse.Namespace
) -> dict[str, Any]:
    """Every repeat of the four arms on one backend block, summarized."""
    train = None
    times: dict[str, dict[str, list[list[float]]]] = {}
    extra: dict[str, dict[str, list[float]]] = {}
    same = []
    for rep in range(a.repeats):
        t0 = time.perf_counter()
        arms = build_arms(options, setup, policy(a))
        train = train or Batches(setup.data, setup)
        interleave(arms, train, a.steps, a.warm)
        same.append(all(same_weights(arms[0].model, arm.model) for arm in arms[1:3]))
        for arm in arms:
            t = arm.timings
            for kind in ("wall", "cpu"):
                times.setdefault(arm.name, {}).setdefault(kind, []).append(getattr(t, kind))
            mine = extra.setdefault(arm.name, {"own_wall": []})
            mine["own_wall"] += arm.own_wall
            for key in ("monitor", "controller", "active"):
                mine.setdefault(key, []).extend(getattr(t, key))
        logger.info(f"  {name} repeat {rep + 1}: {time.perf_counter() - t0:.0f} s")
    return summarize(name, options, times, extra, same)


def summarize(
    name: str,
    options: dict[str, Any],
    times: dict[str, dict[str, list[list[float]]]],
    extra: dict[str, dict[str, list[float]]],
    same: list[bool],
) -> dict[str, Any]:
    """The result record of one format (see :func:`measure`)."""
    arms = []
    for arm, kinds in times.items():
        row: dict[str, Any] = {"arm": arm}
        for kind, reps in kinds.items():
            row[f"{kind}_ms"] = 1e3 * statistics.median([x for rep in reps for x in rep])
        row["monitor_ms"] = 1e3 * statistics.median(extra[arm]["monitor"])
        row["controller_ms"] = 1e3 * statistics.median(extra[arm]["controller"])
        row["own_wall_ms"] = 1e3 * statistics.median(extra[arm]["own_wall"])
        row["mean_active"] = statistics.fmean(extra[arm]["active"])
        arms.append(row)
    ratios = {
        f"{mine} / {ref}": {
            kind: ratio_stats(times[mine][kind], times[ref][kind]) for kind in ("wall", "cpu")
        }
        for mine, ref in ((GNMR, PLAIN), (NULL, PLAIN), (ALL, PLAIN))
    }
    own = arms[0]["monitor_ms"] + arms[0]["controller_ms"]
    accept = {
        kind: {"ratio": r["median"], "ci95": r["ci95"], "met": r["median"] <= TARGET}
        for kind, r in ratios[f"{GNMR} / {PLAIN}"].items()
    }
    return {
        "format": name,
        "options": options,
        "gemms": list(SUBSET),
        "arms": arms,
        "ratios": ratios,
        "own_fraction": own / arms[1]["cpu_ms"],
        "own_fraction_wall": arms[0]["own_wall_ms"] / arms[1]["wall_ms"],
        "acceptance": accept,
        "same_weights": same,
        "raw_ms": {
            arm: {
                kind: [[round(1e3 * x, 4) for x in rep] for rep in reps] for kind, reps in k.items()
            }
            for arm, k in times.items()
        },
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    """Per format and arm: medians, and the paired ratios to ``plain fprop`` with intervals."""
    header = ["low-cost", "arm", "wall ms", "CPU ms", "wall / plain fprop [95% CI]"]
    header += ["CPU / plain fprop [95% CI]", "repeat medians (CPU)", "GNMR ms: mon/ctl CPU (wall)"]
    header += ["mean active"]
    rows = []
    for res in results:
        for row in res["arms"]:
            key = f"{row['arm']} / {PLAIN}"
            cells = ["1", "1", "-"]
            if key in res["ratios"]:
                r = res["ratios"][key]
                cells = [_ci(r["wall"]), _ci(r["cpu"]), _span(r["cpu"]["repeat_medians"])]
            own = f"{row['monitor_ms']:.2f}/{row['controller_ms']:.2f} ({row['own_wall_ms']:.2f})"
            rows.append(
                [
                    res["format"],
                    row["arm"],
                    f"{row['wall_ms']:.1f}",
                    f"{row['cpu_ms']:.1f}",
                    *cells,
                    own if row["arm"] == GNMR else "-",
                    f"{row['mean_active']:.2f}",
                ]
            )
    return markdown_table(header, rows)


def _ci(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    return f"{r['median']:.4f} [{lo:.4f}, {hi:.4f}]"


def _span(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.4f}" for v in values)


def verdicts(results: Sequence[dict[str, Any]]) -> list[str]:
    """The acceptance lines per format: ``gnmr fprop / plain fprop`` against :data:`TARGET`,
    beside the null control's interval and GNMR's own work measured inside the step."""
    lines = []
    for res in results:
        r, null = res["ratios"][f"{GNMR} / {PLAIN}"], res["ratios"][f"{NULL} / {PLAIN}"]
        for kind in ("cpu", "wall"):
            med, (lo, hi) = r[kind]["median"], r[kind]["ci95"]
            met = "met" if med <= TARGET else "MISSED"
            upper = "inside" if hi <= TARGET else "above"
            lines.append(
                f"{res['format']} {kind}: {GNMR} / {PLAIN} = {med:.4f} [95% CI {lo:.4f}, "
                f"{hi:.4f}] -> {met} (target <= {TARGET}; upper bound {upper}); null control "
                f"{_ci(null[kind])}"
            )
        lines.append(
            f"{res['format']}: GNMR's own work inside the step (monitor + controller) = "
            f"{100 * res['own_fraction']:.2f}% of a plain step in CPU time, "
            f"{100 * res['own_fraction_wall']:.2f}% in wall time; same weights as replayed: "
            f"{all(res['same_weights'])}"
        )
    return lines


def policy(a: argparse.Namespace) -> dict[str, Any]:
    """The GNMR arm's policy: the overhead study's, ``--budget`` and the ``--gnmr`` overrides."""
    return {**GNMR_POLICY, "max_active": a.budget, **json.loads(a.gnmr)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    # 8 unrecorded rounds: GNMR's warm-up (GNMR_POLICY's 5 steps) ends before the recording
    p = timing_parser(__doc__, "overhead_v2.json", steps=48, warm=8, rounds="per repeat")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--repeats", type=int, default=4, help="fresh builds of the arms")
    p.add_argument("--budget", type=int, default=3, help="GNMR's max_active (of 28 units)")
    p.add_argument("--setup", default="{}", help="JSON overrides of the harness Setup")
    p.add_argument("--gnmr", default="{}", help="JSON overrides of the GNMR policy")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    start_cli(a.threads)
    setup = Setup(**json.loads(a.setup))
    results = [
        measure(name, {"low_cost": FORMATS[name], "recovery": {"format": "bf16"}}, setup, a)
        for name in a.formats
    ]
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.overhead.gemm_subset",
        "args": vars(a),
        "setup": asdict(setup),
        "gnmr_policy": policy(a),
        "target": TARGET,
        "results": results,
        "provenance": record(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    logger.info(
        f"{a.steps} interleaved rounds x {a.repeats} repeats per arm after {a.warm} warm-up, "
        f"{a.threads} thread(s), gemms {list(SUBSET)}, budget {a.budget} of "
        f"{7 * setup.layers} units\n"
        f"{table(results)}\n" + "\n".join(verdicts(results))
    )
    return out


if __name__ == "__main__":
    main()
