"""Part (a) of :mod:`benchmarks.overhead`: GNMR's step time against the low-cost path.

The harness's small Llama trains under six arms (:func:`arm_specs`) built from the same initial
weights and fed the same batch each round; their steps are interleaved in an order that rotates
every round, so machine load hits every arm alike. Each step is timed in wall-clock and in this
process's CPU time; inside the GNMR arms the monitor's and the controller's own CPU time too.
Two backends (``act_quant``, ``fp8_emulated``), once in one process with
``GNMRRuntime(group=None)``, once under real DeepSpeed (ZeRO-1, world size 1 over gloo). The
six arms and what each difference to the baseline measures: docs/benchmarks.md#overhead-a-step-time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import RESULTS, arg_parser, deepspeed_world, hf_loss
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.model import Batches, build_model
from benchmarks.harness.recipes import ERROR_TARGET, TARGET
from benchmarks.overhead.config import (
    ERROR_EVERY,
    ERROR_GAMMA,
    GNMR_POLICY,
    backend_options,
    ds_config,
)

logger = logging.getLogger(__name__)

BACKENDS = ("act_quant", "fp8_emulated")


if TYPE_CHECKING:
    from gnmr_dist.distributed import GNMRRuntime


def observe_timed(runtime: GNMRRuntime | None) -> tuple[float, float]:
    """GNMR's part of a step after ``backward``: the monitor's pass over the gradients (with
    the error sums on a measuring step) and the controller's decision, each in CPU seconds
    (``(0, 0)`` for an arm without GNMR)."""
    if runtime is None:
        return 0.0, 0.0
    t1 = time.process_time()
    # the plan carries whether this step measures the error sums, as GNMRRuntime.step reads it
    norms = runtime.monitor.compute(with_errors=runtime.plan.measure_errors)
    t2 = time.process_time()
    runtime.observe(norms)
    return t2 - t1, time.process_time() - t2


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds. CPU time is this process's own: the time it waits while another
    process holds the core does not enter it (the slowdown of sharing caches still does)."""
    return time.perf_counter(), time.process_time()


@dataclass
class Timings:
    """What one arm measured over the recorded rounds (seconds)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    monitor: list[float] = field(default_factory=list)
    """CPU time of the monitor (local sums of squares, the all-reduce, square roots)."""
    controller: list[float] = field(default_factory=list)
    """CPU time of the controller's decision and the new plan (``GNMRRuntime.observe``)."""
    active: list[int] = field(default_factory=list)
    """Units whose forward ran the recovery path, per recorded step (the backend's report)."""


@dataclass(frozen=True)
class ArmSpec:
    """One timed arm: GNMR with ``max_active`` (``None``: no GNMR, ``fixed`` units always on
    the recovery path), with the error term when ``gamma`` is set (its sums measured every
    ``error_every`` steps)."""

    name: str
    backend: str
    options: dict[str, Any]
    """The backend's option block (:func:`benchmarks.overhead.config.backend_options`)."""
    max_active: int | None
    fixed: int = 0
    gamma: float | None = None
    error_every: int = 1


class Arm:
    """One training set-up stepped by :func:`interleave`."""

    _last: tuple[float, float, float, float, int]

    def __init__(self, spec: ArmSpec) -> None:
        self.spec, self.name, self.timings = spec, spec.name, Timings()
        self.fixed = frozenset(range(spec.fixed))

    def step(self, tokens: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    def record(self) -> None:
        """Keep the last step's measurements (``_last`` in the order of :class:`Timings`)."""
        for f, value in zip(fields(Timings), self._last, strict=True):
            getattr(self.timings, f.name).append(value)


class LocalArm(Arm):
    """One process, no torch.distributed: ``GNMRRuntime(group=None)`` when GNMR is on.

    ``model``: another model than the harness's Llama of ``setup`` (the shadow study's, whose
    projections are TE modules); a subclass names the operator types its backend finds in them
    (:meth:`operator_types`) and the region its forward runs in (:meth:`forward_region`)."""

    def __init__(self, spec: ArmSpec, setup: Setup, model: nn.Module | None = None) -> None:
        from gnmr_dist.backends import get_backend
        from gnmr_dist.distributed import UnitRegistry

        super().__init__(spec)
        self.model = build_model(setup) if model is None else model
        self.backend = get_backend(spec.backend, **spec.options)
        types = self.operator_types()
        registry = UnitRegistry.from_model(self.model, granularity="operator", operator_types=types)
        self.backend.wrap(registry.local_modules)
        self.runtime = None if spec.max_active is None else self._runtime(registry)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=setup.lr, weight_decay=setup.weight_decay)
        self.clip = setup.clip

    def _runtime(self, registry: Any) -> Any:
        """GNMR's runtime of the spec; with ``gamma`` the backend tracks its error sums."""
        from gnmr_dist.core import GNMRConfig
        from gnmr_dist.distributed import GNMRRuntime

        spec = self.spec
        extra = {} if spec.gamma is None else {"gamma": spec.gamma}
        cfg = GNMRConfig.from_dict({**GNMR_POLICY, **extra, "max_active": spec.max_active})
        error_fn = None
        if spec.gamma is not None:
            self.backend.track_errors(registry.num_units, every=spec.error_every)
            error_fn = self.backend.error_sums
        return GNMRRuntime(registry, cfg, error_fn=error_fn, error_every=spec.error_every)

    def operator_types(self) -> frozenset[str]:
        """Operator types the registry looks for besides its own (none for ``nn.Linear``)."""
        return frozenset()

    def forward_region(self) -> AbstractContextManager[Any]:
        """The region the forward runs in (none here; TE's autocast for TE modules)."""
        return contextlib.nullcontext()

    def step(self, tokens: torch.Tensor, step: int) -> None:
        w0, c0 = clock()
        active = self.runtime.plan.active if self.runtime is not None else self.fixed
        self.backend.apply(active, step)
        with self.forward_region():
            loss = hf_loss(self.model, tokens)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t_mon, t_ctl = observe_timed(self.runtime)
        nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        w1, c1 = clock()
        self._last = (w1 - w0, c1 - c0, t_mon, t_ctl, len(self.backend.report().recovered))


class DeepSpeedArm(Arm):
    """A DeepSpeed engine (world size 1 here); GNMR through ``gnmr_dist.deepspeed.initialize``."""

    def __init__(self, spec: ArmSpec, setup: Setup, stage: int = 1) -> None:
        import deepspeed

        import gnmr_dist.deepspeed as gds
        from gnmr_dist.backends import get_backend
        from gnmr_dist.distributed import UnitRegistry

        super().__init__(spec)
        model = build_model(setup)
        cfg = ds_config(setup, stage)
        self._mon = self._ctl = 0.0
        self.gnmr = spec.max_active is not None
        if self.gnmr:
            block = {"backend": spec.backend, **spec.options, **GNMR_POLICY}
            block.update(max_active=spec.max_active, log={"monitor": False})
            if spec.gamma is not None:
                block.update(gamma=spec.gamma, error_every=spec.error_every)
            self.engine, *_ = gds.initialize(model=model, config={**cfg, "gnmr": block})
            self.backend = self.engine.gnmr.backend
            self._time_gnmr(self.engine.gnmr.runtime)
        else:
            self.backend = get_backend(spec.backend, **spec.options)
            self.backend.wrap(UnitRegistry.from_model(model, granularity="operator").local_modules)
            self.engine, *_ = deepspeed.initialize(model=model, config=cfg)

    def _time_gnmr(self, runtime: Any) -> None:
        """Wrap the runtime's monitor (local sums + all-reduce) and controller with timers."""
        start, observe = runtime.monitor.start, runtime.observe

        def timed_start(*args: Any, **kwargs: Any) -> Callable[[], Any]:
            t0 = time.process_time()
            finish = start(*args, **kwargs)
            self._mon = time.process_time() - t0

            def timed_finish() -> Any:
                t1 = time.process_time()
                out = finish()
                self._mon += time.process_time() - t1
                return out

            return timed_finish

        def timed_observe(norms: Any) -> Any:
            t0 = time.process_time()
            out = observe(norms)
            self._ctl = time.process_time() - t0
            return out

        runtime.monitor.start, runtime.observe = timed_start, timed_observe

    def step(self, tokens: torch.Tensor, step: int) -> None:
        w0, c0 = clock()
        if not self.gnmr:  # plain DeepSpeed: the fixed plan, set as GNMR's hook would
            self.backend.apply(self.fixed, step)
        loss = hf_loss(self.engine, tokens)
        self.engine.backward(loss)
        active = len(self.backend.report().recovered)  # the forward's paths, before the hook
        self.engine.step()
        w1, c1 = clock()
        self._last = (w1 - w0, c1 - c0, self._mon, self._ctl, active)


def arm_specs(backend: str, budget: int) -> list[ArmSpec]:
    """The six arms of the module docstring, on ``backend`` with budget K = ``budget``."""
    options = backend_options()[backend]

    def arm(name: str, max_active: int | None, **kw: Any) -> ArmSpec:
        return ArmSpec(name, backend, options, max_active, **kw)

    return [
        arm("low-cost", None),
        arm("gnmr k=0", 0),
        arm(f"gnmr k={budget}", budget),
        arm(f"{budget} fixed on recovery", None, fixed=budget),
        arm(f"gnmr+e k={budget}", budget, gamma=ERROR_GAMMA),
        arm(f"gnmr+e/{ERROR_EVERY} k={budget}", budget, gamma=ERROR_GAMMA, error_every=ERROR_EVERY),
    ]


def timing_parser(
    doc: str | None, out: str, *, steps: int, warm: int, rounds: str = "per arm"
) -> argparse.ArgumentParser:
    """The command line every interleaved timing shares (:func:`interleave`): ``--steps``
    recorded rounds ``rounds``, ``--warm`` unrecorded ones first, ``--threads`` (torch's
    intra-op threads) and ``--out`` (the JSON file, ``benchmarks/results/<out>`` by default)."""
    p = arg_parser(doc)
    p.add_argument("--steps", type=int, default=steps, help=f"recorded rounds {rounds}")
    p.add_argument("--warm", type=int, default=warm, help="unrecorded rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", default=str(RESULTS / out), help="the JSON file")
    return p


def interleave(arms: Sequence[Arm], batch: Callable[[int], torch.Tensor], steps: int, warm: int):
    """Step every arm ``warm + steps`` rounds (rotating order), recording the last ``steps``."""
    for r in range(warm + steps):
        tokens = batch(r)
        k = r % len(arms)
        for arm in [*arms[k:], *arms[:k]]:
            arm.step(tokens, r + 1)
            if r >= warm:
                arm.record()


def summarize(arms: Sequence[Arm]) -> list[dict[str, Any]]:
    """Medians, and the median and quartiles of the per-round ratios to ``arms[0]``; GNMR's own
    work (monitor + controller CPU time) as a fraction of the baseline's CPU step."""
    base = arms[0].timings
    rows = []
    for arm in arms:
        t = arm.timings
        row: dict[str, Any] = {"arm": arm.name, "steps": len(t.wall)}
        for kind in ("wall", "cpu"):
            row.update(_paired_ratio(kind, getattr(t, kind), getattr(base, kind)))
        row["monitor_ms"] = 1e3 * statistics.median(t.monitor)
        row["controller_ms"] = 1e3 * statistics.median(t.controller)
        row["own_fraction"] = (row["monitor_ms"] + row["controller_ms"]) / (
            1e3 * statistics.median(base.cpu)
        )
        row["mean_active"] = statistics.fmean(t.active)
        rows.append(row)
    return rows


def _paired_ratio(kind: str, mine: list[float], ref: list[float]) -> dict[str, Any]:
    """``<kind>_ms``: the median; ``<kind>_ratio`` and ``<kind>_iqr``: median and quartiles of
    the per-round ratios ``mine[r] / ref[r]`` (same round: the same stretch of machine load)."""
    paired = [a / b for a, b in zip(mine, ref, strict=True)]
    q1, _, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    return {
        f"{kind}_ms": 1e3 * statistics.median(mine),
        f"{kind}_ratio": statistics.median(paired),
        f"{kind}_iqr": (q1, q3),
    }


def part_a(
    setup: Setup, steps: int, warm: int, budget: int, local_only: bool = False
) -> dict[str, Any]:
    """Every arm on both backends, in one process, then (unless ``local_only``) under DeepSpeed."""
    train = Batches(setup.data, setup)
    out: dict[str, Any] = {}

    def run(arm: Callable[[ArmSpec, Setup], Arm], runtime: str, label: str) -> None:
        for backend in BACKENDS:
            t0 = time.perf_counter()
            arms = [arm(spec, setup) for spec in arm_specs(backend, budget)]
            interleave(arms, train, steps, warm)
            out[f"{backend} / {runtime}"] = summarize(arms)
            logger.info(f"  (a) {backend} {label}: {time.perf_counter() - t0:.0f} s")

    run(LocalArm, "GNMRRuntime", "single process")
    if not local_only:
        with deepspeed_world():
            run(DeepSpeedArm, "DeepSpeed ZeRO-1", "DeepSpeed")
    return out


def table_a(results: dict[str, list[dict[str, Any]]]) -> str:
    """Part (a)'s table: per backend, runtime and arm, the medians and paired ratios."""
    header = ["backend / runtime", "arm", "CPU ms", "CPU / low-cost [IQR]", "wall ms"]
    header += ["wall / low-cost [IQR]", "monitor ms", "controller ms", "(mon + ctl) / low-cost"]
    rows = []
    for where, arms in results.items():
        for a in arms:
            own = [f"{a['monitor_ms']:.2f}", f"{a['controller_ms']:.2f}"]
            own = [*own, f"{100 * a['own_fraction']:.2f}%"]
            times = [
                (f"{a[k + '_ms']:.1f}", f"{a[k + '_ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
                for k in ("cpu", "wall")
                for lo, hi in [a[k + "_iqr"]]
            ]
            own = own if a["arm"].startswith("gnmr") else ["-"] * 3
            rows.append([where, a["arm"], *times[0], *times[1], *own, f"{a['mean_active']:.2f}"])
    return markdown_table([*header, "mean active"], rows)


def verdict(where: str, arms: Sequence[dict[str, Any]], budget: int) -> str:
    """The target lines: measured ratio (CPU, paired median, IQR) and GNMR's own work, for GNMR
    (target ``TARGET``) and GNMR with the error term (``ERROR_TARGET``)."""
    lines = []
    for name, target in (
        (f"gnmr k={budget}", TARGET),
        (f"gnmr+e k={budget}", ERROR_TARGET),
        (f"gnmr+e/{ERROR_EVERY} k={budget}", ERROR_TARGET),
    ):
        g = next(a for a in arms if a["arm"] == name)
        lo, hi = g["cpu_iqr"]
        own = 1 + g["own_fraction"]
        lines.append(
            f"{where}: {name} / low-cost = {g['cpu_ratio']:.3f} [IQR {lo:.3f}, {hi:.3f}] "
            f"-> {'met' if g['cpu_ratio'] <= target else 'MISSED'} (target <= {target}); "
            f"GNMR's own work alone: 1 + {own - 1:.4f} -> {'met' if own <= target else 'MISSED'}"
        )
    return "\n".join(lines)
