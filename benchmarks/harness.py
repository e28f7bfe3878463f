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
  clipped to ``mean + z_thresh * std``; Kumar et al., 2025), the global guard users pick today.

Every arm runs the GNMR monitor and controller (GNMR's own policy), so exceedance rates -- the
fraction of eligible unit-steps whose risk ``max(GNMR/alpha_t, dGNMR/beta_t)`` is above 1 after
warm-up -- are measured on the same scale in every arm; only the ``gnmr`` arm acts on them. The
recovery rate is the fraction of eligible unit-steps whose forward actually ran the recovery
path (read from the backend's report, not from the plan).

Step times are wall-clock times of forward + backward + monitor + optimizer step (evaluations
excluded); arms run one after another, so compare them within one run of a command only.
"""

from __future__ import annotations

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

from gnmr_dist.backends import get_backend
from gnmr_dist.core import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

logger = logging.getLogger("benchmarks.harness")

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("full", "static", "recovery", "gnmr", "first_last", "zclip")


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


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    backend: str | None = None
    low_cost: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)
    max_active: int = 0
    z_thresh: float = 2.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if (self.policy == "full") != (self.backend is None):
            raise ValueError(f"arm {self.name}: 'full' runs without a backend, the others with one")


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
    return model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss  # type: ignore[no-any-return]


def evaluate(model: nn.Module, heldout: Batches, batches: int) -> float:
    model.eval()
    with torch.no_grad():
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


def run_arm(setup: Setup, arm: Arm, train: Batches, heldout: Batches) -> ArmResult:
    """Train one arm from the shared initial weights and measure it."""
    model = build_model(setup)
    registry = UnitRegistry.from_model(model, granularity="operator")
    backend = None
    if arm.backend is not None:
        backend = get_backend(arm.backend, low_cost=arm.low_cost, recovery=arm.recovery)
        backend.wrap(registry.local_modules)
    cfg = GNMRConfig.from_dict({**setup.gnmr, "max_active": arm.max_active})
    runtime = GNMRRuntime(registry, cfg)
    fixed = _fixed_active(arm, registry, setup.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(setup.warmup_lr, setup.steps))
    guard = ZClip(arm.z_thresh) if arm.policy == "zclip" else None
    elig = registry.eligible
    n_elig = max(1, int(elig.sum()))
    losses, times, exceed, recovered, actives = [], [], [], [], []
    eval_steps, eval_losses, clipped = [], [], 0
    for step in range(1, setup.steps + 1):
        t0 = time.perf_counter()
        active = fixed if fixed is not None else runtime.plan.active
        if backend is not None:
            backend.apply(active, step)
        loss = lm_loss(model, train(step - 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        decision = runtime.step()
        limit = guard.limit(runtime.last_norms.global_norm) if guard is not None else None
        clipped += limit is not None
        torch.nn.utils.clip_grad_norm_(params, min(setup.clip, limit or math.inf))
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if step > cfg.warmup_steps:
            exceed.append(int(((decision.risk > 1.0) & elig).sum()) / n_elig)
            ran = backend.report().recovered if backend is not None else frozenset()
            recovered.append(len(ran) / n_elig)
        actives.append(len(active))
        if step % setup.eval_every == 0 or step == setup.steps:
            eval_steps.append(step)
            eval_losses.append(evaluate(model, heldout, setup.eval_batches))
    held = eval_losses[-1]
    return ArmResult(
        name=arm.name, policy=arm.policy, losses=losses, eval_steps=eval_steps,
        eval_losses=eval_losses, heldout_loss=held, heldout_ppl=math.exp(held),
        exceedance_rate=_mean(exceed), recovery_rate=_mean(recovered),
        step_ms=1e3 * statistics.median(times), units=registry.num_units,
        max_active=arm.max_active, clipped_steps=clipped, active_per_step=actives,
    )  # fmt: skip


def _fixed_active(arm: Arm, registry: UnitRegistry, layers: int) -> frozenset[int] | None:
    if arm.policy in ("static", "zclip", "full"):
        return frozenset()
    if arm.policy == "recovery":
        return frozenset(range(registry.num_units))
    if arm.policy == "first_last":
        return layer_units(registry, (0, layers - 1))
    return None  # gnmr: the controller's plan


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


def run_experiment(name: str, setup: Setup, arms: Sequence[Arm]) -> dict[str, Any]:
    """Run every arm, print the table, write ``results/<name>.json`` and ``.png``."""
    train, heldout = Batches(setup.data, setup), Batches(setup.heldout, setup)
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
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(name, results, RESULTS / f"{name}.png")
    return out


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
    ax2.set(title="held-out loss", xlabel="step", ylabel="loss")
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
