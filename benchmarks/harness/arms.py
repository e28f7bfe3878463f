"""What an experiment of the harness (:mod:`benchmarks.harness.experiment`) is made of: its set-up,
its arms (the precision policies, described there), the faults it injects, and what an arm
measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

POLICIES = (
    "full",
    "static",
    "recovery",
    "gnmr",
    "first_last",
    "zclip",
    "random",
    "oracle",
    "last_units",
    "late",
    "autoswitch",
    "autoswitch_k",
    "fixed",
)


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
    outliers: tuple[Outlier, ...] = ()
    """Function-preserving outliers (:class:`Outlier`), the same in every arm."""
    outlier_plan: OutlierPlan | None = None
    """Where a branch's outlier strikes (:class:`OutlierPlan`): each branch of the branch
    estimator resolves it into :attr:`outliers` for its seed and point."""


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
class Outlier:
    """A function-preserving outlier inside one projection's GEMMs: channel ``channel`` of the
    input is multiplied by ``f_t`` and column ``channel`` of the weight divided by it, so that
    ``(x D)(W D^-1)^T = x W^T`` in real arithmetic, and bit for bit on a path whose GEMM inputs
    keep 8 exponent bits (BF16, fp32) when ``f_t`` is a power of two. Only a path that rounds to
    a narrow format sees it: a per-tensor (or per-block) scale then comes from the outlier, the
    other inputs of its scale group lose their bits, and the weight column shrinks toward
    underflow, as in real models whose massive activations meet small weights.

    ``channel=None`` scales every input feature (a whole-tensor spike that only a delayed scale
    lags). ``f_t = growth^min(t - start + 1, rise)`` for ``start <= t < start + rise + hold``:
    rising ``rise`` steps, then held.
    """

    module: str
    channel: int | None
    start: int
    rise: int = 10
    hold: int = 25
    growth: float = 2.0

    def __post_init__(self) -> None:
        if not math.log2(self.growth).is_integer() or self.rise < 1 or self.hold < 0:
            raise ValueError(
                f"outlier {self.module}: growth must be a power of two (so that BF16 and fp32 "
                f"paths stay exact), rise >= 1 and hold >= 0; got {self.growth}, {self.rise}, "
                f"{self.hold}"
            )

    def factor(self, step: int) -> float | None:
        """The multiplier at ``step``; ``None`` outside the window."""
        k = step - self.start
        if k < 0 or k >= self.rise + self.hold:
            return None
        return float(self.growth ** min(k + 1, self.rise))


@dataclass(frozen=True)
class OutlierPlan:
    """Where and when a regime's :class:`Outlier` strikes, relative to each branch point.

    The layer and the channel are drawn from the seed (``random.Random(seed)``), so that no
    fixed rule is favoured by where the fault sits; the window opens ``offset`` steps after
    the branch point.
    """

    projection: str = "mlp.down_proj"
    """The projection inside a layer (the SwiGLU output's, where Fishman et al. 2024 saw FP8
    training break)."""
    whole_input: bool = False
    """Scale every input feature (a whole-tensor spike) instead of one channel."""
    offset: int = 5
    rise: int = 10
    hold: int = 25
    growth: float = 2.0

    def at(self, seed: int, point: int, layers: int, width: int) -> Outlier:
        """The outlier of ``seed``'s branches at ``point`` in a model of ``layers`` layers whose
        projection takes ``width`` input features."""
        import random

        # from the seed alone, not the point: a seed's fault sits in one place at all its points, so
        # the seeds, the replicates, are what vary where it strikes
        draw = random.Random(seed)
        layer, channel = draw.randrange(layers), draw.randrange(width)
        return Outlier(
            f"model.layers.{layer}.{self.projection}",
            None if self.whole_input else channel,
            point + self.offset,
            self.rise,
            self.hold,
            self.growth,
        )


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
    error_every: int = 1
    """``GNMR+e``: measure the error sums on every ``error_every``-th step and carry the score
    in between (``gnmr.error_every``)."""
    late_steps: int = 0
    """``late`` policy: every unit runs the recovery path in the run's last ``late_steps``
    steps (the low-cost path before): NVIDIA's switch of the whole model to BF16 near the end
    of training. A branch counts them back from the end of the trunk's schedule, where a run
    has them (:mod:`benchmarks.harness.branch`)."""
    gemms: tuple[str, ...] = ()
    """``gnmr.gemms``: the GEMMs a recovered unit recovers (empty: all three; policy v2)."""
    units: tuple[int, ...] = ()
    """``fixed`` policy: the units on the recovery path at every step (the loss oracle's set,
    or one unit alone)."""
    lean_rise: float = 0.0
    """``GNMR+e lean``: the controller's damage term counts a unit's ``e`` only above this many
    times its own usual level (:mod:`benchmarks.harness.lean`; 0: the plain ``e``)."""
    gemm_dtype: str | None = None
    """The dtype the linears' GEMMs compute in (``"bf16"``: operands cast to BF16, the output
    back, as a BF16 model hands them; ``None``: the model's fp32), on both paths
    (:func:`benchmarks.harness.forwards.install_forwards`)."""

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
        # these pick max_active units; with 0 they would silently be the static low-cost arm
        budgeted = ("random", "oracle", "last_units", "autoswitch_k")
        if self.policy in budgeted and self.max_active < 1:
            raise ValueError(f"arm {self.name}: policy {self.policy} needs max_active >= 1")
        if self.policy == "late" and self.late_steps < 1:
            raise ValueError(f"arm {self.name}: policy late needs late_steps >= 1")
        if self.policy == "fixed" and not self.units:
            raise ValueError(f"arm {self.name}: policy fixed needs units")
        if self.policy.startswith("autoswitch") and self.backend != "fp8_emulated":
            raise ValueError(f"arm {self.name}: the AutoswitchGemm rule runs on fp8_emulated")
        if self.gemm_dtype is not None and self.backend is None:
            raise ValueError(f"arm {self.name}: gemm_dtype acts on a backend's GEMMs")
        if self.lean_rise and (self.lean_rise <= 1 or "gamma" not in self.controller):
            raise ValueError(
                f"arm {self.name}: lean_rise ({self.lean_rise}) must be > 1 and needs the damage "
                "term (controller gamma)"
            )
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


def with_budget(arm: Arm, fraction: float, units: int) -> Arm:
    """``arm`` with ``max_active`` set to ``fraction`` of ``units`` (at least 1)."""
    # at least one: a budget rounded to 0 would be the static arm under another name
    return replace(arm, max_active=max(1, round(fraction * units)))
