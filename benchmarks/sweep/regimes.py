"""The regimes of the sweeps: where the low-cost path hurts.

Every regime trains the harness's Llama (4 layers x 128, 28 projection units) on the embedded
corpus with one precision backend; what differs is where the damage sits. :data:`REGIMES`
(the selection sweeps, :mod:`benchmarks.sweep.selection`): ``act_quant`` and ``fp6_fp8`` spread
it over every unit and step, ``outlier`` and ``delayed`` make it local and transient by
construction (an outlier input channel, rising activation spikes). :data:`FP4_REGIMES` (the
branch estimator's sweeps, :mod:`benchmarks.sweep.branches`, at lr 1e-3, recovery in BF16):
``nvfp4``, ``mxfp4`` and the ``fp4_tensor`` stress. Each regime names its GNMR policy and the
error-term threshold ``gamma`` of its ``GNMR+e`` arms. Each regime in detail:
docs/benchmarks.md#sweep-regimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.harness.arms import Arm, Fault, OutlierPlan, Setup
from benchmarks.harness.bases import BASE, lora_setup
from benchmarks.harness.branch import Instrument
from benchmarks.harness.recipes import FP6_LOW_COST as FP6_BLOCK
from benchmarks.harness.recipes import FP6_STRESS as FP6_TENSOR
from benchmarks.harness.recipes import FP8_RECOVERY as FP8_BLOCK
from benchmarks.harness.recipes import act_quant_policy
from benchmarks.harness.recipes import fp6_fp8_policy as fp6_policy
from gnmr_dist.backends.te_recipes import DELAYED_DEFAULTS

__all__ = ["BRANCH_REGIMES", "FAULT_REGIMES", "FP4_REGIMES", "REGIMES", "PAPER_REGIMES", "Regime"]

FP8_DELAYED = {
    "format": "e4m3",
    "granularity": "tensor",
    "scaling": "delayed",
    "amax_history_len": 16,
    "amax_compute_algo": "max",
}
"""TE's delayed-scaling recipe (per-tensor e4m3 for x, W and dy, scale from the max of the last
16 steps' amaxes): a spike saturates until the history catches up."""

DELAYED_SPIKES = (
    Fault("model.layers.1.mlp.down_proj", 2.0, 40, 48, growth=2.0),
    Fault("model.layers.2.self_attn.o_proj", 2.0, 90, 98, growth=2.0),
)
"""Two activation spikes rising x2 per step (x2 .. x256) for 8 steps, each in one projection."""


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    setup: Setup
    backend: str
    low_cost: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)
    gamma: float = 1.0
    """Threshold of the error score ``e = B / G`` in the ``GNMR+e`` arms: about the median
    score of the static low-cost arm's units over its probe steps with seed 1234 (measured:
    act_quant 0.31, fp6_fp8 0.052, outlier 0.044, delayed 0.019), so that about half the units
    are candidates at any step and the budget goes to the largest scores. Seeds 7 and 42 did
    not enter it."""
    instrument: Instrument = field(default_factory=Instrument)
    """The branch estimator's trunk, branch points and horizon (FP4 regimes)."""
    arm_set: str = ""
    """The arms a branch sweep runs (:func:`benchmarks.sweep.branch_arms.make_arms`): ``""``,
    those of the regime's family; ``"compact"`` or ``"wgrad"``, issue 44's stage-5 sets."""
    stochastic: bool = False
    """Whether the low-cost path rounds stochastically (its seed is a null control)."""
    units: int = 28
    """Projection units of the harness's Llama (4 layers x 7)."""
    family: str = "fp4"
    """The branch sweeps' records folder (``results/<family>/<name>.jsonl``)."""
    trunk: str = "fp4"
    """The branch sweeps' trunk folder (``results/sweep/<trunk>/trunks``): regimes with the same
    setup and recovery path share their trunks."""
    high: str = "BF16"
    """The name of the arm that runs the recovery path on every unit (the static gap's upper
    end: BF16, or the regime's recovery format)."""
    gemm_dtype: str | None = None
    """The dtype every arm's linears compute in (:attr:`benchmarks.harness.arms.Arm.
    gemm_dtype`; ``None``: the harness's fp32 model)."""
    trunk_backend: dict[str, Any] | None = None
    """The trunk's backend (:class:`benchmarks.harness.arms.Arm` keyword arguments) when it is
    not this regime's recovery path: a regime that branches from another backend's trunks (the
    shared BF16 trunks of :data:`TRUNK_BF16`) names theirs, so that a missing trunk is rebuilt
    as the others' are."""

    def backend_args(self) -> dict[str, Any]:
        """The :class:`benchmarks.harness.arms.Arm` keyword arguments of this regime's backend."""
        args: dict[str, Any] = {
            "backend": self.backend,
            "low_cost": dict(self.low_cost),
            "recovery": dict(self.recovery),
        }
        if self.gemm_dtype is not None:
            args["gemm_dtype"] = self.gemm_dtype
        return args

    def trunk_arm(self) -> Arm:
        """The reference arm the trunks train: the recovery path on every unit, of this regime's
        backend or of :attr:`trunk_backend`."""
        args = self.backend_args() if self.trunk_backend is None else dict(self.trunk_backend)
        return Arm("trunk", "recovery", **args)

    def error_policy(self) -> dict[str, Any]:
        """The controller keys of a ``GNMR+e`` arm (the paper's policy plus ``gamma``)."""
        return {"gamma": self.gamma}


REGIMES = {
    r.name: r
    for r in (
        Regime(
            "act_quant",
            "2-bit / 8-bit saved activations (act_quant)",
            Setup(steps=200, eval_every=50, gnmr=act_quant_policy()),
            "act_quant",
            {"bits": 2, "group_size": 128},
            {"bits": 8, "group_size": 128},
            gamma=0.3,
        ),
        Regime(
            "fp6_fp8",
            "per-tensor FP6 / block FP8 (fp8_emulated)",
            Setup(steps=150, eval_every=50, gnmr=fp6_policy()),
            "fp8_emulated",
            dict(FP6_TENSOR),
            dict(FP8_BLOCK),
            gamma=0.05,
        ),
        Regime(
            "outlier",
            "block FP6 / block FP8, one outlier input channel x100 in layers.2 "
            "up_proj for steps 60-109 (fp8_emulated)",
            Setup(
                steps=150,
                eval_every=50,
                gnmr=fp6_policy(),
                faults=(Fault("model.layers.2.mlp.up_proj", 100.0, 60, 110, channel=7),),
            ),
            "fp8_emulated",
            dict(FP6_BLOCK),
            dict(FP8_BLOCK),
            gamma=0.04,
        ),
        Regime(
            "delayed",
            "per-tensor FP8 e4m3 with TE's delayed scaling / bf16, two rising "
            "activation spikes (x2 per step for 8 steps) in one projection each (fp8_emulated)",
            Setup(steps=150, eval_every=50, gnmr=fp6_policy(), faults=DELAYED_SPIKES),
            "fp8_emulated",
            dict(FP8_DELAYED),
            {"format": "bf16"},
            gamma=0.02,
        ),
    )
}


FP4_SETUP = Setup(lr=1e-3, gnmr=fp6_policy())
"""The FP4 regimes' training: the harness's Llama at lr 1e-3 (warm-up 20, cosine to 0.1)."""


def _fp4(name: str, description: str, low_cost: dict[str, Any], **kw: Any) -> Regime:
    """An FP4 regime: E2M1 ``low_cost`` / BF16 on every projection, in ``fp8_emulated``."""
    return Regime(name, description, FP4_SETUP, "fp8_emulated", low_cost, {"format": "bf16"}, **kw)


FP4_REGIMES = {
    r.name: r
    for r in (
        _fp4(
            "nvfp4",
            "NVIDIA's NVFP4 recipe on every projection / BF16 (fp8_emulated)",
            {"format": "e2m1"},
            gamma=0.4,
            stochastic=True,
        ),
        _fp4(
            "mxfp4",
            "OCP MXFP4 (1 x 32, E8M0 scales) on every projection / BF16 (fp8_emulated)",
            {"format": "e2m1", "granularity": "mxfp4"},
            gamma=0.45,
        ),
        _fp4(
            "fp4_tensor",
            "stress: E2M1 with one scale per tensor on every projection / BF16 (fp8_emulated)",
            {"format": "e2m1", "granularity": "tensor"},
            gamma=1.0,
        ),
    )
}
"""The FP4 regimes of issue 24. ``gamma``: about the median error score ``e = B / G`` of the
static low-cost path's units on three steps after the seed-1234 trunk's step 175 (measured:
nvfp4 0.39, mxfp4 0.43, fp4_tensor 1.01), as for the other regimes."""


FAULT_POINTS = Instrument(points=(100, 175, 250, 325, 350), late_at="schedule")
"""The fault regimes' instrument: the FP4 regimes' branch points (the same trunks: a
function-preserving outlier leaves the BF16 trunk bit for bit alone) and 350, whose branches
end the trunk's schedule; the late rules act where a run has them (``late_at="schedule"``)."""


def _fault(name: str, description: str, low_cost: dict[str, Any], **kw: Any) -> Regime:
    """A fault regime: ``low_cost`` / BF16 on every projection, the outlier of ``kw``."""
    plan = kw.pop("outlier", OutlierPlan())
    recovery = kw.pop("recovery", {"format": "bf16"})
    return Regime(
        name,
        description,
        replace(kw.pop("setup", FP4_SETUP), outlier_plan=plan),
        kw.pop("backend", "fp8_emulated"),
        low_cost,
        recovery,
        instrument=kw.pop("instrument", FAULT_POINTS),
        family="faults",
        **kw,
    )


RISE = OutlierPlan(growth=4.0, rise=10, hold=25)
"""The rising outlier: x4 per step for 10 steps, to 2^20, held 25 steps (a 35-step window).
It outruns per-tensor FP8's range (e4m3 spans about 2^18 with subnormals) and NVFP4's
per-tensor second-level scale; at 2^10, the size of the massive activations reported in LLMs,
every format here absorbed it (the pilot, docs/benchmarks.md#fault-regimes)."""

TRUNK_BF16 = {"backend": "fp8_emulated", "recovery": {"format": "bf16"}}
"""The FP4 and fault regimes' trunk: ``fp8_emulated``'s BF16 path (GEMM inputs rounded to BF16,
fp32 accumulation) on every unit. A regime of another backend that names it branches from the
very checkpoints the others branch from."""

TORCHAO_TENSORWISE = {"recipe": "tensorwise", "pad_inner_dim": True}
"""torchao's ``tensorwise`` recipe (e4m3 x and W, e5m2 dy, one scale per tensor); the harness's
FFN width 344 is not a multiple of 16, so its GEMMs pad the inner dimension with zeros (exact)."""

FAULT_REGIMES = {
    r.name: r
    for r in (
        _fault(
            "outlier_fp8_tensor",
            "per-tensor e4m3 (current scaling) / BF16; one input channel of one down_proj "
            "rises x4 per step to 2^20, held 25 steps (function-preserving)",
            {"format": "e4m3", "granularity": "tensor"},
            outlier=RISE,
            gamma=0.02,
        ),
        _fault(
            "outlier_torchao_tensorwise",
            "torchao float8 tensorwise (real FP8 casts and torch._scaled_mm GEMMs: e4m3 x and W, "
            "e5m2 dy) / BF16, the linears computing in BF16; outlier_fp8_tensor's rising outlier "
            "channel (function-preserving), branched from the same trunks",
            dict(TORCHAO_TENSORWISE),
            backend="torchao_fp8",
            recovery={"recipe": "bf16"},
            outlier=RISE,
            gamma=0.03,
            gemm_dtype="bf16",
            trunk_backend=TRUNK_BF16,
        ),
        _fault(
            "outlier_delayed",
            "per-tensor e4m3 with TE's delayed scaling / BF16; the same rising outlier channel "
            "(function-preserving)",
            dict(FP8_DELAYED),
            outlier=RISE,
            gamma=0.02,
        ),
        _fault(
            "outlier_nvfp4",
            "NVFP4 / BF16; the same rising outlier channel (function-preserving)",
            {"format": "e2m1"},
            outlier=RISE,
            gamma=0.4,
            stochastic=True,
        ),
        _fault(
            "outlier_mxfp4",
            "MXFP4 / BF16; one input channel rising x2 per step to x1024, held 25 steps "
            "(function-preserving; its E8M0 block scales keep it to its block)",
            {"format": "e2m1", "granularity": "mxfp4"},
            gamma=0.45,
        ),
        _fault(
            "outlier_fp4_tensor",
            "E2M1 with one scale per tensor / BF16; one input channel rising x2 per step to "
            "x1024, held 25 steps (function-preserving)",
            {"format": "e2m1", "granularity": "tensor"},
            gamma=1.0,
        ),
        _fault(
            "spike_delayed",
            "the selection sweeps' delayed regime, ported: per-tensor e4m3 with delayed scaling "
            "/ BF16, the whole input of one down_proj rising x4 per step for 8 steps "
            "(function-preserving)",
            dict(FP8_DELAYED),
            outlier=OutlierPlan(whole_input=True, growth=4.0, rise=8, hold=0),
            gamma=0.02,
        ),
        _fault(
            "outlier_block_fp6",
            "the selection sweeps' outlier regime, ported: block FP6 / block FP8, one input "
            "channel of one down_proj x128 for 35 steps (function-preserving)",
            dict(FP6_BLOCK),
            recovery=dict(FP8_BLOCK),
            outlier=OutlierPlan(rise=1, hold=34, growth=128.0),
            gamma=0.04,
        ),
    )
}
"""Local, transient faults (issue 35): a function-preserving outlier (:class:`benchmarks.harness.
arms.Outlier`) in one projection of the layer drawn per seed, opening 5 steps after each branch
point. ``gamma``: the FP4 and delayed regimes' values (not re-measured under the fault);
``outlier_torchao_tensorwise``'s (issue 43, docs/benchmarks.md#sweep-faults) is
``outlier_fp8_tensor``'s 0.02 scaled by the ratio of the two regimes' median low-cost error scores
without the fault (``python -m benchmarks.sweep.gamma``, seed 1234 after step 250: 0.174 / 0.116),
measured before any of its branches ran."""


ABLATION = ("outlier_delayed", "outlier_fp8_tensor")
"""The regimes of issue 44's ablation (``e-only 4``, ``GNMR+e lean 4``): each is run again as
``<name>_ablation``, the same regime (setup, outlier, trunks, ``gamma``) with its own records
file, so that every arm of its pre-registered comparisons is recorded from one commit on one
host (docs/benchmarks.md#sweep-faults, the ablation)."""

FAULT_REGIMES |= {
    f"{n}_ablation": replace(
        FAULT_REGIMES[n],
        name=f"{n}_ablation",
        description=FAULT_REGIMES[n].description + "; issue 44's ablation, its own records",
    )
    for n in ABLATION
}


# -- issue 44, stage 5 -------------------------------------------------------------------------

FP8_TE_DELAYED = {
    "format": "e4m3",
    "grad_format": "e5m2",
    "granularity": "tensor",
    "scaling": "delayed",
    **DELAYED_DEFAULTS,
}
"""Transformer Engine's ``DelayedScaling()`` as it comes: ``fp8_format=Format.HYBRID`` (e4m3 for
x and W, e5m2 for dy, each scaled against its own format's maximum: 448 forward, 57344 backward),
``amax_history_len=1024``, ``amax_compute_algo="max"``, ``margin=0`` (read from TE's
``transformer_engine/common/recipe/__init__.py``, class ``DelayedScaling``, at commit 000b637;
the ``te_fp8`` backend's defaults, :data:`gnmr_dist.backends.te_recipes.DELAYED_DEFAULTS`). A
branch starts from a BF16 trunk with empty histories, so within a 50-step branch the 1024-step
history never wraps: every scale is the max over the branch's steps so far."""

DEEP_SETUP = replace(FP4_SETUP, layers=16, hidden=64, heads=4, ffn=172)
"""A deeper, narrower Llama: 16 layers x 64 (4 heads of 16, SwiGLU width 172, the harness's
ratio), 112 projection units, at the FP4 and fault regimes' lr 1e-3."""

DEEP_POINTS = Instrument(points=(100,), late_at="schedule")
"""The deep regime's instrument: the fault regimes' 400-step schedule and 50-step branches, one
branch point (100), so its trunks train 100 steps."""

WGRAD_POINTS = Instrument(points=(325,))
"""The wgrad-only FP4 regimes' branch point: 325 of the FP4 regimes' points, where their
records' static gaps were largest and steadiest over seeds (nvfp4 +0.0035, mxfp4 +0.0105 after
50 steps, 5 seeds; read before this design was fixed)."""


def _wgrad(fp4: str) -> Regime:
    """The FP4 regime ``fp4`` as a fault-family regime ``<fp4>_wgrad``: the same damage, the
    wgrad-only recovery arms (``arm_set="wgrad"``) at :data:`WGRAD_POINTS`."""
    base = FP4_REGIMES[fp4]
    return replace(
        base,
        name=f"{fp4}_wgrad",
        description=base.description + "; wgrad-only recovery rows",
        instrument=WGRAD_POINTS,
        family="faults",
        arm_set="wgrad",
    )


STAGE5_REGIMES = {
    r.name: r
    for r in (
        _fault(
            "outlier_delayed_hybrid",
            "TE's delayed-scaling defaults (HYBRID: per-tensor e4m3 x and W, e5m2 dy; amax "
            "history 1024, max) / BF16; outlier_delayed's rising outlier channel "
            "(function-preserving)",
            dict(FP8_TE_DELAYED),
            outlier=RISE,
            gamma=0.03,
            arm_set="compact",
        ),
        _fault(
            "outlier_delayed_deep",
            "outlier_delayed on a deeper, narrower Llama (16 layers x 64, 112 units): per-tensor "
            "e4m3 with delayed scaling (history 16) / BF16, the same rising outlier channel",
            dict(FP8_DELAYED),
            outlier=RISE,
            gamma=0.003,
            arm_set="compact",
            units=112,
            trunk="deep",
            setup=DEEP_SETUP,
            instrument=DEEP_POINTS,
        ),
        _wgrad("mxfp4"),
        _wgrad("nvfp4"),
    )
}
"""Issue 44's stage 5 (docs/benchmarks.md#sweep-stage-5): TE's delayed defaults as a delayed
regime beside ``outlier_delayed``; ``outlier_delayed`` on a model of 112 units, where a budget of
4 is 3.6% of them (14% in the 28-unit model); and the NVFP4 and MXFP4 uniform damage with
wgrad-only recovery at the same linear-work share as whole-unit recovery. Each has its own
records (``results/faults/<name>.jsonl``), comparisons and stopping rule
(:mod:`benchmarks.harness.preregistered`). ``gamma``, measured with :mod:`benchmarks.sweep.gamma`
on seed 1234's trunk before any branch ran: the fault regimes' ``outlier_delayed`` 0.02 scaled
by the ratio of the static low-cost units' median ``e`` to ``outlier_delayed``'s at the same
point, so that it sits at the same place among its units (as ``outlier_torchao_tensorwise``'s):
HYBRID 0.1799 / 0.1231 after step 250 (0.029, set 0.03; e5m2 gradients round coarser), the deep
model 0.01018 / 0.06741 after step 100 (0.0030; its narrower units' scores are smaller and more
spread, quartiles 0.0020 and 0.022); the wgrad rows keep their parents' FP4 values."""

FAULT_REGIMES |= STAGE5_REGIMES


def _paper(name: str, description: str, setup: Setup, backend: str, **kw: Any) -> Regime:
    """A paper experiment on the branch estimator: its own trunks (its recovery path)."""
    return Regime(name, description, setup, backend, family="paper", trunk=name, **kw)


PAPER_REGIMES = {
    r.name: r
    for r in (
        _paper(
            "paper_act_quant",
            "paper experiment 1: 2-bit / 8-bit saved activations (act_quant, groups of 128)",
            Setup(gnmr=act_quant_policy()),
            "act_quant",
            low_cost={"bits": 2, "group_size": 128},
            recovery={"bits": 8, "group_size": 128},
            gamma=0.56,
            high="8-bit",
            instrument=Instrument(trunk_steps=300, points=(75, 150, 225), late_at="schedule"),
        ),
        _paper(
            "paper_fp6_fp8",
            "paper experiment 2: DeepSeek-style block-scaled FP6 / FP8 (fp8_emulated, 1 x 128 and "
            "128 x 128 scales)",
            FP4_SETUP,
            "fp8_emulated",
            low_cost=dict(FP6_BLOCK),
            recovery=dict(FP8_BLOCK),
            gamma=0.16,
            high="FP8",
        ),
        _paper(
            "paper_lora_int8",
            "paper experiment 3: LoRA fine-tuning of experiment 1's FP32 base on an unseen "
            "domain, the frozen base in W8A8 INT8 (row / token scales) / BF16 (int8)",
            replace(lora_setup(BASE), init_from=str(BASE)),
            "int8",
            low_cost={"weight_granularity": "row", "act_granularity": "token"},
            recovery={"dtype": "bf16"},
            gamma=0.05,
            instrument=Instrument(trunk_steps=200, points=(50, 100, 150), late_at="schedule"),
        ),
    )
}
"""The paper's three experiments on the branch estimator (issue 35 item 2). The trunk runs the
recovery path (8-bit saved activations, block FP8, BF16), the static gap's upper end (the arm
named :attr:`Regime.high`); experiment 3 fine-tunes experiment 1's FP32 base, pretrained when
missing (:func:`benchmarks.harness.bases.ensure_base`). ``gamma``, the median error score of
the static low-cost path's 28 units over 3 steps after seed 1234's middle branch point, measured
by :mod:`benchmarks.sweep.gamma`: act_quant 0.56 (quartiles 0.43, 0.92), fp6_fp8 0.16 (0.12,
0.27), INT8 LoRA 0.049 (0.035, 0.072)."""

BRANCH_REGIMES = {**FP4_REGIMES, **FAULT_REGIMES, **PAPER_REGIMES}
"""Every regime of the branch sweeps (:mod:`benchmarks.sweep.branches`)."""
