"""One arm of the harness in training (:class:`ArmRun`): model, backend, GNMR's monitor and
controller, optimizer, the policy's recovery set each step, and the measurements.

The policies and the probe are described in :mod:`benchmarks.harness.experiment`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from benchmarks.harness.arms import Arm, ArmResult, Setup
from benchmarks.harness.forwards import AutoswitchGemms, install_forwards
from benchmarks.harness.lean import LeanErrors
from benchmarks.harness.model import (
    Batches,
    build_model,
    evaluate,
    install_faults,
    lm_loss,
    save_state,
)
from benchmarks.harness.probes import probe_record, summarize_probes
from gnmr_dist.backends import PrecisionBackend, get_backend
from gnmr_dist.backends.emulated import EmulatedBackend
from gnmr_dist.core import Decision, GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.distributed.accounting import GEMM_ORDER
from gnmr_dist.distributed.probe import ProbeResult, RecoveryProbe
from gnmr_dist.telemetry.selection import top_k


def layer_units(registry: UnitRegistry, layers: Iterable[int]) -> frozenset[int]:
    """Ids of the units inside the given transformer layers (by global layer number)."""
    wanted = {f".layers.{i}." for i in layers}
    return frozenset(i for i, n in enumerate(registry.names) if any(w in n for w in wanted))


class ZClip:
    """ZClip-style adaptive spike guard on the global gradient norm (after ``warmup`` steps)."""

    def __init__(self, z_thresh: float, momentum: float = 0.97, warmup: int = 25) -> None:
        self.z, self.m, self.warmup = z_thresh, momentum, warmup
        self.seen: list[float] = []
        self.mean = self.var = 0.0

    def limit(self, norm: float) -> float | None:
        """The norm to clip to this step (None: leave the gradient alone); updates the EMA."""
        # ZClip's warm-up: the EMA starts from the plain mean and variance of the first norms, not
        # from 0, which would clip every early step
        if len(self.seen) < self.warmup:
            self.seen.append(norm)
            if len(self.seen) == self.warmup:
                self.mean, self.var = statistics.fmean(self.seen), statistics.pvariance(self.seen)
            return None
        std = math.sqrt(max(self.var, 1e-12))
        clipped = self.mean + self.z * std if (norm - self.mean) / std > self.z else None
        # the EMA takes the clipped norm: a spike must not inflate what judges the next one
        used = clipped if clipped is not None else norm
        self.mean = self.m * self.mean + (1 - self.m) * used
        self.var = self.m * self.var + (1 - self.m) * (used - self.mean) ** 2
        return clipped


class ArmRun:
    """One arm in training: model, backend, controller, optimizer and measurements.

    :meth:`step` trains one optimizer step (and evaluates on the ``eval_every`` grid);
    :func:`run_arm` drives one arm to the end, ``run_experiment(..., interleave=True)`` advances
    every arm by one step in turn.
    """

    def __init__(
        self,
        setup: Setup,
        arm: Arm,
        heldout: Batches,
        *,
        evaluates: bool = True,
        monitors: bool = True,
    ) -> None:
        self.setup, self.arm, self.heldout = setup, arm, heldout
        self.evaluates = evaluates
        """Whether :meth:`step` evaluates on the ``eval_every`` grid (a branch evaluates apart)."""
        self.monitors = monitors or arm.policy in ("gnmr", "zclip")
        """Whether GNMR's monitor and controller run (always for the policies that use them;
        ``False`` times a static policy without them, :mod:`benchmarks.sweep.fp4_step_time`)."""
        self.model = build_model(setup)
        self.registry = UnitRegistry.from_model(self.model, granularity="operator")
        self.current_step = 0
        self.switch: AutoswitchGemms | None = None
        """TE AutoswitchGemm's rule on every GEMM (the ``autoswitch`` policies)."""
        self.backend = self._wrapped_backend()
        self.cfg = GNMRConfig.from_dict(
            # the shared policy, then the arm's own keys over it, then its budget: an arm's
            # overrides win and max_active is always the arm's
            {**setup.gnmr, **arm.controller, "max_active": arm.max_active}
        )
        self.scored = self._scored()
        self.runtime = self._runtime()
        self.fixed = _fixed_active(arm, self.registry, setup.layers)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=setup.lr, weight_decay=setup.weight_decay)
        factor = _cosine(setup.warmup_lr, setup.steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor)
        self.guard = ZClip(arm.z_thresh) if arm.policy == "zclip" else None
        self.elig = self.registry.eligible
        self.n_elig = max(1, int(self.elig.sum()))
        self.losses: list[float] = []
        self.times: list[float] = []
        self.exceed: list[float] = []
        self.recovered: list[float] = []
        self.actives: list[int] = []
        self.eval_steps: list[int] = []
        self.eval_losses: list[float] = []
        self.clipped = 0
        self.unit_exceed = torch.zeros(self.registry.num_units, dtype=torch.int64)
        self.unit_recovered = torch.zeros(self.registry.num_units, dtype=torch.int64)
        self.probes: list[dict[str, Any]] = []
        self.probe_times: list[float] = []
        # random-k's draws and the probe's random set from two generators, seeded apart: probing a
        # step must not change which units the random arm draws next
        self.draw_gen = torch.Generator().manual_seed(setup.seed + 1)
        self.probe_gen = torch.Generator().manual_seed(setup.seed)
        self.first_last = layer_units(self.registry, (0, setup.layers - 1))
        self.probe = self._probe()
        sizes = self.registry.sizes or (1,) * self.registry.num_units
        self.sizes = torch.tensor(sizes, dtype=torch.float64)
        self.gemm_high = torch.zeros(3, dtype=torch.int64)
        """Unit-steps whose fprop, dgrad, wgrad ran high."""
        self.flops_recovered = 0.0
        """Recovered linear-layer work so far, in units of one step's whole linear work (each
        recovered GEMM of unit ``u`` adds ``size(u) / (3 sum size)``)."""
        self.last_step = setup.steps
        """The run's last step (a branch of :mod:`benchmarks.harness.branch` ends earlier)."""
        # a forward pre-hook runs before whatever forward the backend installed, so both paths and
        # the probe's passes see the same faulted input
        install_faults(self.model, setup.faults, lambda: self.current_step)

    def _wrapped_backend(self) -> PrecisionBackend | None:
        """The arm's backend wrapped on every unit (``None`` for the ``full`` policy)."""
        arm = self.arm
        if arm.backend is None:
            return None
        backend = get_backend(arm.backend, low_cost=arm.low_cost, recovery=arm.recovery)
        if arm.gemms:
            backend.set_gemms(arm.gemms)
        if arm.policy.startswith("autoswitch"):
            assert isinstance(backend, EmulatedBackend)
            self.switch = AutoswitchGemms(backend, self.registry, arm.policy == "autoswitch")
        step = lambda: self.current_step  # noqa: E731
        # before wrap: wrap builds each operator's two forwards from make_forward once, so an
        # override installed after it would never run
        install_forwards(
            backend, self.model, self.setup.outliers, step, self.switch, arm.gemm_dtype
        )
        backend.wrap(self.registry.local_modules)
        return backend

    def _scored(self) -> bool:
        """Whether the backend tracks its error sums: the controller uses them (``gamma``) or
        a probe grades them."""
        arm, backend = self.arm, self.backend
        probed = arm.probe_every > 0 or bool(arm.probe_steps)
        uses_errors = self.cfg.gamma is not None
        # tracking costs a measurement in every GEMM: only an arm that reads the sums pays for it
        return backend is not None and backend.reports_errors and (uses_errors or probed)

    def _runtime(self) -> GNMRRuntime:
        """GNMR's monitor and controller; the controller gets the backend's error sums when
        its policy has the error term (``gamma``)."""
        backend, every = self.backend, self.arm.error_every
        if self.scored and backend is not None:
            # the backend measures on the steps the runtime reads (every error_every-th) and the
            # runtime carries the last score between them: both must be given the same every
            backend.track_errors(self.registry.num_units, every=every)
        uses_errors = self.cfg.gamma is not None
        error_fn = backend.error_sums if uses_errors and backend is not None else None
        gemms = self.arm.gemms or GEMM_ORDER
        runtime = GNMRRuntime(
            self.registry, self.cfg, error_fn=error_fn, error_every=every, gemms=gemms
        )
        if self.arm.lean_rise:  # the lean arm's damage term (benchmarks/harness/lean.py)
            ctrl, gamma = runtime.controller, self.arm.controller["gamma"]
            lean = LeanErrors(ctrl.step, self.registry.num_units, gamma, self.arm.lean_rise)
            setattr(ctrl, "step", lean)  # noqa: B010 (an instance's method, replaced)
        return runtime

    def _probe(self) -> RecoveryProbe | None:
        """The recovery-gap probe of an arm that probes (or selects by it: the oracle)."""
        arm = self.arm
        if not ((arm.probe_every or arm.probe_steps or arm.policy == "oracle") and self.backend):
            return None
        if arm.probe_k > self.registry.num_units:
            units = self.registry.num_units
            raise ValueError(f"arm {arm.name}: probe_k ({arm.probe_k}) > units ({units})")
        return RecoveryProbe(self.registry, self.backend, self.opt)

    def step(self, step: int, train: Batches) -> None:
        """Optimizer step ``step`` (1-based) on batch ``step - 1``; timed without evaluation."""
        t0 = time.perf_counter()
        self.current_step = step
        # the plan first: the capped rule ranks by the previous step's ledger, which new_step clears
        planned = self._planned()
        if self.switch is not None:
            self.switch.new_step(step)
        active = self._apply(planned, step)
        batch = train(step - 1)
        # after the plan is applied, before the step's forward: the probe measures the very weights,
        # batch and plan of the step it is recorded with
        probed = self._measure(step, batch)
        if self.arm.policy == "oracle" and probed is not None:
            active = self._apply(self._oracle_set(probed[0]), step)
        loss = lm_loss(self.model, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        lr = float(self.opt.param_groups[0]["lr"])  # the rate this step's update applies
        # after backward, before the clip: GNMR's norms are of the raw gradients, and ZClip reads
        # their global norm from the runtime
        decision = self.runtime.step(lr=lr) if self.monitors else None
        scores = self._error_scores() if probed is not None and self._records(step) else None
        self._clip_and_update()
        # the probe's passes are timed apart: a probed step compares with an unprobed arm's
        self.times.append(time.perf_counter() - t0 - (probed[1] if probed else 0.0))
        if probed is not None:
            self.probe_times.append(probed[1])
            if self._records(step) and decision is not None:
                self._record_probe(step, probed[0], decision, active, scores or {})
        self._count(step, float(loss.detach()), decision, active)
        if self.evaluates:
            self._evaluate_and_save(step)

    def _apply(self, active: frozenset[int], step: int) -> frozenset[int]:
        """Put ``active`` on the recovery path for this step's passes (with a backend)."""
        if self.backend is not None:
            self.backend.apply(active, step)
        return active

    def _clip_and_update(self) -> None:
        """Clip the gradient to ``setup.clip`` (or to ZClip's lower limit on a spike), then the
        AdamW step and the learning-rate schedule."""
        limit = None
        if self.guard is not None and self.runtime.last_norms is not None:
            limit = self.guard.limit(self.runtime.last_norms.global_norm)
        self.clipped += limit is not None
        # ZClip only tightens the regime's clip: every arm keeps the same ceiling
        torch.nn.utils.clip_grad_norm_(self.params, min(self.setup.clip, limit or math.inf))
        self.opt.step()
        self.sched.step()

    def _count(
        self, step: int, loss: float, decision: Decision | None, active: frozenset[int]
    ) -> None:
        """The step's loss and plan size; after GNMR's warm-up, the eligible units whose risk
        exceeds 1 and those whose forward ran the recovery path (the backend's report)."""
        self.losses.append(loss)
        # GNMR's thresholds are unset in its warm-up: every arm's rates count from its end
        if step > self.cfg.warmup_steps:
            if decision is not None:
                over = (decision.risk > 1.0) & self.elig
                self.exceed.append(int(over.sum()) / self.n_elig)
                self.unit_exceed += over
            # what the backend reports it ran, not the plan: the rate is what the forwards did
            ran = self._ran()
            self.recovered.append(len(ran) / self.n_elig)
            self.unit_recovered[list(ran)] += 1
        # every step, warm-up included: the cost model divides it by all the branch's steps
        self.flops_recovered += self._recovered_work()
        self.actives.append(len(active))

    def _ran(self) -> frozenset[int]:
        """Units whose forward (or, under the AutoswitchGemm rule, any GEMM) ran high."""
        if self.switch is not None:
            return frozenset(torch.nonzero(self.switch.ledger.high.any(dim=1)).flatten().tolist())
        return self.backend.report().recovered if self.backend is not None else frozenset()

    def _recovered_work(self) -> float:
        """This step's recovered share of the units' linear work: per unit, its GEMMs that ran
        high (the rule's ledger; else ``gnmr.gemms`` of each recovered unit) times its size."""
        total = 3.0 * float(self.sizes.sum())
        if self.switch is not None:
            ledger = self.switch.ledger.high
            self.gemm_high += ledger.sum(dim=0)
            return float((ledger.sum(dim=1).double() * self.sizes).sum()) / total
        # no backend (the full arm): all its work runs at full precision, as if recovered
        if self.backend is None:
            return 1.0
        ran = list(self.backend.report().recovered)
        gemms = self.arm.gemms or GEMM_ORDER
        for g in gemms:
            self.gemm_high[GEMM_ORDER.index(g)] += len(ran)
        # policy v2 recovers only gnmr.gemms of a unit, each a third of the unit's work
        return len(gemms) * float(self.sizes[ran].sum()) / total

    def _evaluate_and_save(self, step: int) -> None:
        """Held-out loss on the ``eval_every`` grid and at the end; the weights at the end."""
        setup = self.setup
        if step % setup.eval_every == 0 or step == setup.steps:
            self.eval_steps.append(step)
            self.eval_losses.append(
                evaluate(self.model, self.heldout, setup.eval_batches, self.backend)
            )
        if step == setup.steps and self.arm.save_to is not None:
            save_state(self.model, self.arm.save_to)

    def _planned(self) -> frozenset[int]:
        """This step's recovery set before any measurement (the oracle's comes after its probe)."""
        if self.fixed is not None:
            return self.fixed
        if self.arm.policy == "late":
            # counted back from last_step, which a branch sets to its own end (Instrument.late_at):
            # the late window then ends right before the measurement
            late = self.current_step > self.last_step - self.arm.late_steps
            return frozenset(range(self.registry.num_units)) if late else frozenset()
        if self.arm.policy == "random":
            return self._draw(self.arm.max_active, self.draw_gen)
        if self.arm.policy == "autoswitch_k":
            return self._capped_rule()
        # the oracle's set needs this step's probe, which runs after the plan: it starts empty
        if self.arm.policy == "oracle":
            return frozenset()
        return self.runtime.plan.active

    def _capped_rule(self) -> frozenset[int]:
        """The capped AutoswitchGemm rule: the ``max_active`` eligible units whose score of the
        previous step exceeds 1, largest first (none before the first step)."""
        assert self.switch is not None
        scores = self.switch.ledger.unit_scores()
        # ineligible units and scores <= 1 at -1, so top_k never fills the budget with a unit the
        # uncapped rule would leave low
        ranked = torch.where(self.elig & (scores > 1.0), scores, torch.full_like(scores, -1.0))
        return frozenset(u for u in top_k(ranked, self.arm.max_active) if ranked[u] > 0)

    def _draw(self, k: int, gen: torch.Generator) -> frozenset[int]:
        eligible = torch.nonzero(self.elig).flatten()
        return frozenset(eligible[torch.randperm(len(eligible), generator=gen)[:k]].tolist())

    def _oracle_set(self, result: ProbeResult) -> frozenset[int]:
        gap = result.grad_gap if self.arm.oracle_by == "grad" else result.update_gap
        ranked = torch.where(self.elig, gap, torch.full_like(gap, -1.0))
        return top_k(ranked, self.arm.max_active)

    def _records(self, step: int) -> bool:
        every = self.arm.probe_every
        return (every > 0 and step % every == 0) or step in self.arm.probe_steps

    def _measure(self, step: int, batch: torch.Tensor) -> tuple[ProbeResult, float] | None:
        """The probe's result and its wall time on probe steps (before the step's forward);
        every step for the oracle, which selects by it."""
        if self.probe is None or not (self.arm.policy == "oracle" or self._records(step)):
            return None
        t0 = time.perf_counter()
        result = self.probe.measure(lambda: lm_loss(self.model, batch))
        return result, time.perf_counter() - t0

    def _error_scores(self) -> dict[str, torch.Tensor]:
        """Candidate error scores of this step's low-cost path (after backward, before the
        optimizer step): the bound ``B(u)``, ``B / n``, the controller's ``B / G`` and ``B``
        scaled as Adam scales it (:func:`adam_inverse_rms`)."""
        if not self.scored or self.backend is None or self.runtime.last_norms is None:
            return {}
        bound = self.backend.error_sums(torch.device("cpu"))
        if bound is None:
            return {}
        norms = self.runtime.last_norms
        n = norms.norms
        rel = torch.where((bound == 0) & (n == 0), torch.zeros_like(bound), bound / n)
        e = replace(norms, error_sums=bound).relative_errors()  # the controller's B / G
        return {
            "error_bound": bound,
            "error_relative": rel,
            "error_global": e,
            "error_adam": bound * adam_inverse_rms(self.registry, self.opt),
        }

    def _record_probe(
        self,
        step: int,
        result: ProbeResult,
        decision: Decision,
        active: frozenset[int],
        scores: dict[str, torch.Tensor],
    ) -> None:
        k = self.arm.probe_k
        sets = {
            "active": active,
            "decided": frozenset(decision.active),
            "random": self._draw(k, self.probe_gen),
            "first_last": self.first_last,
        }
        sets.update({f"{name}_topk": top_k(score, k) for name, score in scores.items()})
        self.probes.append(probe_record(step, result, decision.risk, sets, k, scores))

    def result(self) -> ArmResult:
        """The measurements so far (after the last step: the arm's result)."""
        held = self.eval_losses[-1]
        return ArmResult(
            name=self.arm.name,
            policy=self.arm.policy,
            losses=self.losses,
            eval_steps=self.eval_steps,
            eval_losses=self.eval_losses,
            heldout_loss=held,
            heldout_ppl=math.exp(held),
            exceedance_rate=_mean(self.exceed),
            recovery_rate=_mean(self.recovered),
            step_ms=1e3 * statistics.median(self.times),
            units=self.registry.num_units,
            max_active=self.arm.max_active,
            clipped_steps=self.clipped,
            active_per_step=self.actives,
            unit_names=list(self.registry.names),
            unit_exceedances=self.unit_exceed.tolist(),
            unit_recoveries=self.unit_recovered.tolist(),
            probes=self.probes,
            probe_summary=summarize_probes(self.probes),
            probe_ms=1e3 * statistics.median(self.probe_times) if self.probe_times else 0.0,
        )


def run_arm(setup: Setup, arm: Arm, train: Batches, heldout: Batches) -> ArmResult:
    """Train one arm from the shared initial weights and measure it."""
    run = ArmRun(setup, arm, heldout)
    for step in range(1, setup.steps + 1):
        run.step(step, train)
    return run.result()


def adam_inverse_rms(registry: UnitRegistry, opt: torch.optim.Optimizer) -> torch.Tensor:
    r"""float64 [U]: ``c_u = sqrt(mean over u's elements of 1 / (sqrt(v_hat) + eps)^2)``.

    If a unit's gradient error ``d`` is spread over its elements independently of Adam's
    second moment, ``E ||d / (sqrt(v_hat) + eps)||^2 = ||d||^2 mean(1 / (sqrt(v_hat) + eps)^2)``,
    so ``B(u) c_u`` bounds the update gap as ``B(u)`` bounds the gradient gap. Read from the
    optimizer state before this step's update; a parameter without state yet (before its
    first step) is left out of the mean, and a unit with none at all gets 0.
    """
    sums = torch.zeros(registry.num_units, dtype=torch.float64)
    counts = torch.zeros(registry.num_units, dtype=torch.float64)
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    for p, slot in zip(registry.params, registry.param_slots.tolist(), strict=True):
        state, group = opt.state.get(p, {}), groups.get(id(p))
        if slot >= registry.num_units or group is None or "exp_avg_sq" not in state:
            continue
        # bias-corrected, as AdamW's own update divides by it
        v_hat = state["exp_avg_sq"].double() / (1.0 - group["betas"][1] ** float(state["step"]))
        sums[slot] += float((v_hat.sqrt() + group["eps"]).reciprocal().square().sum())
        counts[slot] += p.numel()
    return torch.where(counts > 0, (sums / counts.clamp(min=1)).sqrt(), torch.zeros_like(sums))


def _fixed_active(arm: Arm, registry: UnitRegistry, layers: int) -> frozenset[int] | None:
    """The recovery set of a static policy (``None``: the policy chooses it every step)."""
    if arm.policy in ("static", "zclip", "full"):
        return frozenset()
    if arm.policy == "recovery":
        return frozenset(range(registry.num_units))
    if arm.policy == "first_last":
        return layer_units(registry, (0, layers - 1))
    if arm.policy == "fixed":
        return frozenset(arm.units)
    if arm.policy == "last_units":
        eligible = torch.nonzero(registry.eligible).flatten().tolist()
        return frozenset(eligible[-arm.max_active :])
    return None  # gnmr, random, oracle, late, autoswitch: chosen every step


def _cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor of step ``step`` (0-based): linear warm-up over ``warmup``
    steps, then a cosine from 1 down to 0.1 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        # capped at 1: a run past its schedule stays at the floor, not back up the cosine
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
