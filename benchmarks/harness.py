"""Side-by-side training arms for the seed experiments (``benchmarks/exp_*.py``).

Every arm of an experiment trains the same small Llama from the same initial weights on the same
batches in the same order (one process; CPU), and differs only in its precision policy:

- ``full``: no backend: every projection in full precision (FP32 here; BF16 on a GPU);
- ``static``: the backend on every unit, always the low-cost path (GNMR's budget is 0);
- ``recovery``: the backend on every unit, always the recovery path (the "8-bit" / "FP8" arm);
- ``gnmr``: the backend's low-cost path, and GNMR moves at most ``max_active`` units to the
  recovery path for the next step;
- ``first_last``: Megatron's static recipe -- the first and the last transformer layer always on
  the recovery path, every other unit on the low-cost path;
- ``zclip``: the low-cost path everywhere plus a ZClip-style global gradient-norm spike guard
  (an EMA of the global norm's mean and variance; a norm whose z-score exceeds ``z_thresh`` is
  clipped to ``mean + z_thresh * std``; Kumar et al., 2025), the global guard users pick today;
- ``random``: ``max_active`` eligible units on the recovery path, re-drawn every step (a
  generator seeded by ``Setup.seed``): the control every budgeted policy must beat;
- ``oracle``: every step, the recovery-gap probe measures every unit's gap on the step's own
  weights and batch first, and the ``max_active`` eligible units with the largest gap
  (``Arm.oracle_by``: gradient or update gap) run the recovery path: the upper bound of any
  selection at that budget (it costs two extra forward/backward passes per step).

``gnmr`` with ``controller={"gamma": ...}`` is GNMR with DESIGN.md section 2.1's error term: the
backend tracks its error sums and the runtime hands the controller their relative score.

``Setup.faults`` inject local, transient trouble by construction (:class:`Fault`): one input
channel (or the whole input) of one projection multiplied by a factor for a window of steps,
in every arm alike (probe passes included), so that the true gradient changes the same way and
only the precision policy differs.

Every arm runs the GNMR monitor and controller (GNMR's own policy), so exceedance rates -- the
fraction of eligible unit-steps whose risk ``max(GNMR/alpha_t, dGNMR/beta_t)`` is above 1 after
warm-up -- are measured on the same scale in every arm; only the ``gnmr`` arm acts on them. The
recovery rate is the fraction of eligible unit-steps whose forward actually ran the recovery
path (read from the backend's report, not from the plan).

Step times are wall-clock times of forward + backward + monitor + optimizer step (evaluations
excluded); arms run one after another, or with ``run_experiment(..., interleave=True)`` one step
of each arm in turn (every arm then samples the same stretch of machine load), so compare them
within one run of a command only. ``Arm.save_to`` keeps an arm's final weights (a base model
that ``Setup.init_from`` loads in a later experiment).

``Arm(probe_every=N)`` (any arm with a backend) runs the recovery-gap probe
(:class:`gnmr_dist.distributed.probe.RecoveryProbe`) on every N-th step, after the step's plan is
applied and before its forward, on the same weights and batch: two extra forward/backward
passes, every unit on the low-cost and on the recovery path. The step itself is unchanged (same
RNG, plan, gradients and decisions as without the probe) and its recorded time excludes the
probe, whose own time is kept apart (``ArmResult.probe_ms``). Each probe step records the
controller's risk at that step (scored from the same gradient the probe measured), the sets
below, and their selection figures (:func:`gnmr_dist.telemetry.selection.set_figures`: precision
against the top-|set| grad / update gaps and the share of the squared gaps covered):

- ``risk_topk``: the top ``probe_k`` units by this step's risk (precision@k of the risk);
- ``active``: the units that ran the recovery path during the step (the plan);
- ``decided``: the controller's new active set (chosen from this step's risk, runs next step);
- ``random``: ``probe_k`` eligible units drawn with a generator seeded by ``Setup.seed``;
- ``first_last``: the units of the first and the last layer (Megatron's recipe);
- ``oracle_grad`` / ``oracle_update``: the top ``probe_k`` by measured grad / update gap (the
  upper bound of any k-set: a precision of 1 and the largest share, checked at every probe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends import PrecisionBackend, get_backend
from gnmr_dist.core import Decision, GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.distributed.probe import ProbeResult, RecoveryProbe
from gnmr_dist.telemetry.selection import set_figures, spearman, top_k
from gnmr_dist.train.common import next_token_loss

logger = logging.getLogger("benchmarks.harness")

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("full", "static", "recovery", "gnmr", "first_last", "zclip", "random", "oracle")


@dataclass(frozen=True)
class Setup:
    """What every arm of one experiment shares."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn: int = 344
    seq_len: int = 128
    batch: int = 8
    steps: int = 400
    lr: float = 3e-3
    warmup_lr: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 1234
    data: str = "embedded:train"
    heldout: str = "embedded:heldout"
    max_bytes: int = 4_000_000
    eval_every: int = 50
    eval_batches: int = 16
    init_from: str | None = None
    """A ``state_dict`` file to start every arm from (fine-tuning experiments)."""
    lora_rank: int = 0
    gnmr: dict[str, Any] = field(default_factory=dict)
    """GNMR policy (``GNMRConfig`` keys) shared by every arm; ``max_active`` is per arm."""
    faults: tuple[Fault, ...] = ()
    """Injected input faults, the same in every arm."""


@dataclass(frozen=True)
class Fault:
    """Multiply the input of one projection by ``scale * growth^(t - start)`` for steps
    ``start <= t < stop``.

    ``module`` is the projection's module path (``model.layers.2.mlp.up_proj``); ``channel`` one
    input feature (an outlier channel, as LLM activations grow them), ``None`` every feature (an
    activation spike); ``growth > 1`` makes the spike rise geometrically, so that a scale taken
    from past amaxes (delayed scaling) lags it at every step of the window. The hook acts on the
    forward of the training step and of the probe's passes alike; evaluations run without it.
    """

    module: str
    scale: float
    start: int
    stop: int
    channel: int | None = None
    growth: float = 1.0

    def factor(self, step: int) -> float:
        """The multiplier at ``step`` (inside the window)."""
        return self.scale * self.growth ** (step - self.start)


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    backend: str | None = None
    low_cost: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)
    max_active: int = 0
    z_thresh: float = 2.5
    save_to: str | None = None
    """Write the arm's final ``state_dict`` here (a base checkpoint for a later experiment)."""
    controller: dict[str, Any] = field(default_factory=dict)
    """GNMR policy keys this arm overrides (its exceedances are then on its own thresholds)."""
    probe_every: int = 0
    """Run the recovery-gap probe on every step divisible by this (0: never)."""
    probe_k: int = 3
    """Size of the risk's top-k, random and oracle sets graded on probe steps."""
    probe_steps: tuple[int, ...] = ()
    """Further steps to probe (and record) besides every ``probe_every``-th: a fault's window."""
    oracle_by: str = "grad"
    """``oracle`` policy: rank units by the measured ``"grad"`` or ``"update"`` gap."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if (self.policy == "full") != (self.backend is None):
            raise ValueError(f"arm {self.name}: 'full' runs without a backend, the others with one")
        if self.probe_every < 0 or self.probe_k < 1:
            raise ValueError(
                f"arm {self.name}: probe_every ({self.probe_every}) must be >= 0 and probe_k "
                f"({self.probe_k}) >= 1"
            )
        probed = self.probe_every or self.probe_steps or self.policy == "oracle"
        if probed and self.backend is None:
            raise ValueError(f"arm {self.name}: the probe needs a backend (two paths to compare)")
        if self.policy in ("random", "oracle") and self.max_active < 1:
            raise ValueError(f"arm {self.name}: policy {self.policy} needs max_active >= 1")
        if self.oracle_by not in ("grad", "update"):
            raise ValueError(f"arm {self.name}: oracle_by must be 'grad' or 'update'")


@dataclass
class ArmResult:
    name: str
    policy: str
    losses: list[float]
    eval_steps: list[int]
    eval_losses: list[float]
    heldout_loss: float
    heldout_ppl: float
    exceedance_rate: float
    recovery_rate: float
    step_ms: float
    """Median wall time of a training step in milliseconds."""
    units: int
    max_active: int
    clipped_steps: int = 0
    active_per_step: list[int] = field(default_factory=list)
    unit_names: list[str] = field(default_factory=list)
    unit_exceedances: list[int] = field(default_factory=list)
    """Per unit: steps after warm-up with risk > 1 (eligible units; 0 for the others)."""
    unit_recoveries: list[int] = field(default_factory=list)
    """Per unit: steps after warm-up whose forward ran the recovery path."""
    probes: list[dict[str, Any]] = field(default_factory=list)
    """One record per probe step (:func:`probe_record`); empty without ``Arm.probe_every``."""
    probe_summary: dict[str, dict[str, float]] = field(default_factory=dict)
    """Mean of every probe figure over the probe steps (:func:`summarize_probes`)."""
    probe_ms: float = 0.0
    """Median wall time of one probe (two forward/backward passes) in milliseconds."""


# ====================================================================== model and data


def build_model(setup: Setup) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(setup.seed)
    cfg = LlamaConfig(
        vocab_size=258, hidden_size=setup.hidden, intermediate_size=setup.ffn,
        num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
        num_key_value_heads=setup.heads, max_position_embeddings=setup.seq_len,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    if setup.init_from is not None:
        model.load_state_dict(torch.load(setup.init_from, weights_only=True))
    if setup.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank, lora_dropout=0.0,
                          target_modules=targets)  # fmt: skip
        model = get_peft_model(model, lora)
    return model


class Batches:
    """Deterministic batches: batch ``i`` is samples ``i * batch ...`` of a fixed permutation."""

    def __init__(self, spec: str, setup: Setup) -> None:
        from gnmr_dist.data import make_dataset

        self.data = make_dataset(spec, setup.seq_len, max_bytes=setup.max_bytes)
        gen = torch.Generator().manual_seed(setup.seed)
        self.order = torch.randperm(len(self.data), generator=gen)
        self.batch = setup.batch

    def __call__(self, i: int) -> torch.Tensor:
        idx = [int(self.order[(i * self.batch + j) % len(self.order)]) for j in range(self.batch)]
        return torch.stack([self.data[k] for k in idx])


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the same as ``gnmr-ds-pretrain``'s)."""
    return next_token_loss(model, tokens)


def evaluate(
    model: nn.Module, heldout: Batches, batches: int, backend: PrecisionBackend | None = None
) -> float:
    """Mean held-out loss; inside the backend's ``measuring()`` (evaluation leaves training
    state such as delayed-scaling amax histories alone)."""
    model.eval()
    measuring = backend.measuring() if backend is not None else contextlib.nullcontext()
    with torch.no_grad(), measuring:
        losses = [float(lm_loss(model, heldout(i))) for i in range(batches)]
    model.train()
    return sum(losses) / len(losses)


# ====================================================================== one arm


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
        if len(self.seen) < self.warmup:
            self.seen.append(norm)
            if len(self.seen) == self.warmup:
                self.mean, self.var = statistics.fmean(self.seen), statistics.pvariance(self.seen)
            return None
        std = math.sqrt(max(self.var, 1e-12))
        clipped = self.mean + self.z * std if (norm - self.mean) / std > self.z else None
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

    def __init__(self, setup: Setup, arm: Arm, heldout: Batches) -> None:
        self.setup, self.arm, self.heldout = setup, arm, heldout
        self.model = build_model(setup)
        self.registry = UnitRegistry.from_model(self.model, granularity="operator")
        self.backend = None
        if arm.backend is not None:
            self.backend = get_backend(arm.backend, low_cost=arm.low_cost, recovery=arm.recovery)
            self.backend.wrap(self.registry.local_modules)
        self.cfg = GNMRConfig.from_dict(
            {**setup.gnmr, **arm.controller, "max_active": arm.max_active}
        )
        uses_errors = self.cfg.gamma is not None
        self.scored = (
            self.backend is not None
            and self.backend.reports_errors
            and (uses_errors or arm.probe_every > 0 or bool(arm.probe_steps))
        )
        if self.scored:
            self.backend.track_errors(self.registry.num_units)
        error_fn = self.backend.error_sums if uses_errors and self.backend is not None else None
        self.runtime = GNMRRuntime(self.registry, self.cfg, error_fn=error_fn)
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
        self.probe: RecoveryProbe | None = None
        self.probes: list[dict[str, Any]] = []
        self.probe_times: list[float] = []
        self.draw_gen = torch.Generator().manual_seed(setup.seed + 1)
        self.first_last = layer_units(self.registry, (0, setup.layers - 1))
        if (arm.probe_every or arm.probe_steps or arm.policy == "oracle") and self.backend:
            if arm.probe_k > self.registry.num_units:
                raise ValueError(f"arm {arm.name}: probe_k ({arm.probe_k}) > units "
                                 f"({self.registry.num_units})")  # fmt: skip
            self.probe = RecoveryProbe(self.registry, self.backend, self.opt)
            self.probe_gen = torch.Generator().manual_seed(setup.seed)
        self.current_step = 0
        install_faults(self.model, setup.faults, lambda: self.current_step)

    def step(self, step: int, train: Batches) -> None:
        """Optimizer step ``step`` (1-based) on batch ``step - 1``; timed without evaluation."""
        setup, backend = self.setup, self.backend
        t0 = time.perf_counter()
        self.current_step = step
        active = self._planned()
        if backend is not None:
            backend.apply(active, step)
        batch = train(step - 1)
        probed = self._measure(step, batch)
        if self.arm.policy == "oracle" and probed is not None and backend is not None:
            active = self._oracle_set(probed[0])
            backend.apply(active, step)
        loss = lm_loss(self.model, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        decision = self.runtime.step()
        scores = self._error_scores() if probed is not None and self._records(step) else None
        norm = self.runtime.last_norms.global_norm
        limit = self.guard.limit(norm) if self.guard is not None else None
        self.clipped += limit is not None
        torch.nn.utils.clip_grad_norm_(self.params, min(setup.clip, limit or math.inf))
        self.opt.step()
        self.sched.step()
        self.times.append(time.perf_counter() - t0 - (probed[1] if probed else 0.0))
        if probed is not None:
            self.probe_times.append(probed[1])
            if self._records(step):
                self._record_probe(step, probed[0], decision, active, scores or {})
        self.losses.append(float(loss.detach()))
        if step > self.cfg.warmup_steps:
            over = (decision.risk > 1.0) & self.elig
            self.exceed.append(int(over.sum()) / self.n_elig)
            self.unit_exceed += over
            ran = backend.report().recovered if backend is not None else frozenset()
            self.recovered.append(len(ran) / self.n_elig)
            self.unit_recovered[list(ran)] += 1
        self.actives.append(len(active))
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
        if self.arm.policy == "random":
            return self._draw(self.arm.max_active, self.draw_gen)
        if self.arm.policy == "oracle":
            return frozenset()
        return self.runtime.plan.active

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
        return {"error_bound": bound, "error_relative": rel, "error_global": e,
                "error_adam": bound * adam_inverse_rms(self.registry, self.opt)}  # fmt: skip

    def _record_probe(
        self,
        step: int,
        result: ProbeResult,
        decision: Decision,
        active: frozenset[int],
        scores: dict[str, torch.Tensor],
    ) -> None:
        k = self.arm.probe_k
        sets = {"active": active, "decided": frozenset(decision.active),
                "random": self._draw(k, self.probe_gen), "first_last": self.first_last}  # fmt: skip
        sets.update({f"{name}_topk": top_k(score, k) for name, score in scores.items()})
        self.probes.append(probe_record(step, result, decision.risk, sets, k, scores))

    def result(self) -> ArmResult:
        """The measurements so far (after the last step: the arm's result)."""
        held = self.eval_losses[-1]
        return ArmResult(
            name=self.arm.name, policy=self.arm.policy, losses=self.losses,
            eval_steps=self.eval_steps, eval_losses=self.eval_losses, heldout_loss=held,
            heldout_ppl=math.exp(held), exceedance_rate=_mean(self.exceed),
            recovery_rate=_mean(self.recovered), step_ms=1e3 * statistics.median(self.times),
            units=self.registry.num_units, max_active=self.arm.max_active,
            clipped_steps=self.clipped, active_per_step=self.actives,
            unit_names=list(self.registry.names), unit_exceedances=self.unit_exceed.tolist(),
            unit_recoveries=self.unit_recovered.tolist(), probes=self.probes,
            probe_summary=summarize_probes(self.probes),
            probe_ms=1e3 * statistics.median(self.probe_times) if self.probe_times else 0.0,
        )  # fmt: skip


def probe_record(
    step: int,
    result: ProbeResult,
    risk: torch.Tensor,
    sets: dict[str, frozenset[int]],
    k: int,
    scores: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One probe step: the gaps, the graded sets and their figures (JSON-ready).

    ``sets`` are the policy's sets of this step; the risk's top-``k`` and the two oracle top-``k``
    sets are added. Raises ``RuntimeError`` if the grad-gap oracle does not have precision 1 and
    the largest grad-gap share of the k-sets (a self-check of the probe's and selection's maths).
    """
    g, up = result.grad_gap, result.update_gap
    sets = {"risk_topk": top_k(risk, k), **sets, "oracle_grad": top_k(g, k),
            "oracle_update": top_k(up, k)}  # fmt: skip
    figures = {name: set_figures(s, g, up) for name, s in sets.items()}
    oracle = figures["oracle_grad"]
    best = max(f["share_grad"] for n, f in figures.items() if len(sets[n]) == k)
    if oracle["precision_grad"] != 1.0 or oracle["share_grad"] < best - 1e-12:
        raise RuntimeError(f"step {step}: the grad-gap oracle is not the best k-set: {figures}")
    return {
        "step": step, "k": k, "risk": risk.tolist(), "grad_gap": g.tolist(),
        "update_gap": up.tolist(), "grad_low_norm": result.grad_low_norm.tolist(),
        "grad_high_norm": result.grad_high_norm.tolist(), "loss_low": result.loss_low,
        "loss_high": result.loss_high, "sets": {n: sorted(s) for n, s in sets.items()},
        "figures": figures, "scores": {n: v.tolist() for n, v in (scores or {}).items()},
        "spearman": {f"{n}_{gap}": spearman(v, x) for n, v in {"risk": risk, **(scores or {})}
                     .items() for gap, x in (("grad", g), ("update", up))},
    }  # fmt: skip


def summarize_probes(probes: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean of every figure over the probe steps where it is defined (NaN: never defined)."""
    rows = [(name, fig) for p in probes for name, fig in p["figures"].items()]
    rows += [("spearman", p["spearman"]) for p in probes]
    out: dict[str, dict[str, list[float]]] = {}
    for name, fig in rows:
        for key, value in fig.items():
            out.setdefault(name, {}).setdefault(key, []).append(value)
    return {
        name: {key: _mean_defined(values) for key, values in fig.items()}
        for name, fig in out.items()
    }


def _mean_defined(values: Sequence[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return statistics.fmean(defined) if defined else math.nan


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
        v_hat = state["exp_avg_sq"].double() / (1.0 - group["betas"][1] ** float(state["step"]))
        sums[slot] += float((v_hat.sqrt() + group["eps"]).reciprocal().square().sum())
        counts[slot] += p.numel()
    return torch.where(counts > 0, (sums / counts.clamp(min=1)).sqrt(), torch.zeros_like(sums))


def install_faults(model: nn.Module, faults: Sequence[Fault], step: Callable[[], int]) -> None:
    """Forward pre-hooks applying ``faults`` while ``model.training`` and the step is in window."""
    modules = dict(model.named_modules())
    for fault in faults:
        if fault.module not in modules:
            near = [n for n in modules if n.endswith(fault.module.split(".")[-1])][:4]
            raise ValueError(f"fault module {fault.module!r} is not in the model; e.g. {near}")
        modules[fault.module].register_forward_pre_hook(_fault_hook(fault, step, model))


def _fault_hook(fault: Fault, step: Callable[[], int], model: nn.Module) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        t = step()
        if not (model.training and fault.start <= t < fault.stop):
            return None
        x = args[0]
        if fault.channel is None:
            return (x * fault.factor(t), *args[1:])
        factor = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        factor[fault.channel] = fault.factor(t)
        return (x * factor, *args[1:])

    return hook


def save_state(model: nn.Module, path: str | Path) -> None:
    """Write ``model.state_dict()`` to ``path`` (loadable by ``Setup.init_from``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)


def _fixed_active(arm: Arm, registry: UnitRegistry, layers: int) -> frozenset[int] | None:
    if arm.policy in ("static", "zclip", "full"):
        return frozenset()
    if arm.policy == "recovery":
        return frozenset(range(registry.num_units))
    if arm.policy == "first_last":
        return layer_units(registry, (0, layers - 1))
    return None  # gnmr, random, oracle: chosen every step


def _cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ====================================================================== experiment


def run_experiment(
    name: str, setup: Setup, arms: Sequence[Arm], *, interleave: bool = False
) -> dict[str, Any]:
    """Run every arm, print the table, write ``results/<name>.json`` and ``.png``.

    ``interleave``: train all arms at once, one step of each in turn (the order rotating every
    step), instead of one arm after another. Results are the same (every arm still sees the
    same init and batches); step times are fairer on a machine whose load changes, because
    every arm's steps are sampled over the same stretch of wall time.
    """
    train, heldout = Batches(setup.data, setup), Batches(setup.heldout, setup)
    t0 = time.perf_counter()
    if interleave:
        results = _run_interleaved(setup, arms, train, heldout)
        logger.info("%d arms interleaved: %.0f s", len(arms), time.perf_counter() - t0)
    else:
        results = []
        for arm in arms:
            t0 = time.perf_counter()
            results.append(run_arm(setup, arm, train, heldout))
            logger.info("arm %s: %.0f s", arm.name, time.perf_counter() - t0)
    out = {
        "experiment": name,
        "date": time.strftime("%Y-%m-%d"),
        "setup": asdict(setup),
        "arms": [asdict(a) for a in arms],
        "results": [asdict(r) for r in results],
        "interleaved": interleave,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(name, results, RESULTS / f"{name}.png")
    return out


def _run_interleaved(
    setup: Setup, arms: Sequence[Arm], train: Batches, heldout: Batches
) -> list[ArmResult]:
    runs = [ArmRun(setup, arm, heldout) for arm in arms]
    for step in range(1, setup.steps + 1):
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step, train)
        if step % setup.eval_every == 0:
            logger.info("step %d: held-out %s", step,
                        " ".join(f"{r.eval_losses[-1]:.3f}" for r in runs))  # fmt: skip
    return [run.result() for run in runs]


def table(results: Sequence[ArmResult], reference: str, low_cost: str) -> str:
    """Markdown table; loss deltas relative to the ``reference`` arm, times to ``low_cost``."""
    by = {r.name: r for r in results}
    ref, low = by[reference], by[low_cost]
    rows = [
        "| arm | held-out loss | vs " + reference + " | perplexity | exceedance | recovery "
        "| step time vs " + low_cost + " |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        delta = 100 * (r.heldout_loss / ref.heldout_loss - 1)
        rows.append(
            f"| {r.name} | {r.heldout_loss:.4f} | {delta:+.2f}% | {r.heldout_ppl:.2f} | "
            f"{100 * r.exceedance_rate:.3f}% | {100 * r.recovery_rate:.2f}% | "
            f"{r.step_ms / low.step_ms:.3f} |"
        )
    return "\n".join(rows)


def targets(
    results: Sequence[ArmResult],
    reference: str,
    low_cost: str,
    gnmr: str,
    *,
    tolerance: float = 0.01,
    seed_exceedance: float = 0.002,
    time_ratio: float = 1.03,
) -> str:
    """The seed's targets, checked on ``results`` (each line says met or missed).

    GNMR's held-out loss within ``tolerance`` of ``reference`` while ``low_cost`` (the static
    low-cost arm) is worse by more than ``tolerance``; GNMR's recovery rate next to its budget;
    every arm's exceedance rate next to the seed's ``seed_exceedance``; GNMR's step time over the
    low-cost arm's at most ``time_ratio``.
    """
    by = {r.name: r for r in results}
    ref, low, g = by[reference], by[low_cost], by[gnmr]

    def rel(r: ArmResult) -> float:
        return r.heldout_loss / ref.heldout_loss - 1

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    budget = g.max_active / max(1, g.units)
    rare = [r for r in results if r.exceedance_rate < seed_exceedance]
    ratio = g.step_ms / low.step_ms
    exceed = ", ".join(f"{r.name} {100 * r.exceedance_rate:.3f}%" for r in results)
    return "\n".join([
        f"- {gnmr} within {100 * tolerance:.0f}% of {reference}: {100 * rel(g):+.2f}% "
        f"-> {verdict(abs(rel(g)) <= tolerance)}",
        f"- {low_cost} worse than {reference} by more than {100 * tolerance:.0f}%: "
        f"{100 * rel(low):+.2f}% -> {verdict(rel(low) > tolerance)}",
        f"- {gnmr} recovery rate {100 * g.recovery_rate:.2f}% vs budget {100 * budget:.2f}% "
        f"({g.max_active} of {g.units} units)",
        f"- exceedance rate below the seed's {100 * seed_exceedance:.1f}%: {len(rare)} of "
        f"{len(results)} arms ({exceed})",
        f"- step time {gnmr} / {low_cost}: {ratio:.3f} (target <= {time_ratio}) "
        f"-> {verdict(ratio <= time_ratio)}",
    ])  # fmt: skip


def plot(name: str, results: Sequence[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        k = max(1, len(r.losses) // 50)
        smooth = [statistics.fmean(r.losses[max(0, i - k) : i + 1]) for i in range(len(r.losses))]
        ax1.plot(range(1, len(smooth) + 1), smooth, lw=1.2, label=r.name)
        ax2.plot(r.eval_steps, r.eval_losses, marker="o", ms=3, lw=1.2, label=r.name)
    ax1.set(title=f"{name}: training loss (moving mean)", xlabel="step", ylabel="loss")
    ax2.set(title="held-out loss (y zoomed on the later evaluations)", xlabel="step", ylabel="loss")
    lows = [min(r.eval_losses) for r in results]
    ax2.set_ylim(min(lows) - 0.05, max(r.eval_losses[len(r.eval_losses) // 3] for r in results))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_budget(arm: Arm, fraction: float, units: int) -> Arm:
    """``arm`` with ``max_active`` set to ``fraction`` of ``units`` (at least 1)."""
    return replace(arm, max_active=max(1, round(fraction * units)))
