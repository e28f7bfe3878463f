"""TE AutoswitchGemm's rule, emulated: a GEMM runs in high precision for this iteration when a
quantized input of it loses too much.

TransformerEngine PR #2883 (``../shared/STACK-FACTS.md``) decides per layer and per GEMM, on
each rank alone, with no budget and no hold: the GEMM runs its high-precision path in the
current iteration when either of its two quantized inputs has

    underflow share = #{i : t_i != 0, Q(t)_i = 0} / numel(t)  >  5%     or
    MSE             = mean_i (t_i - Q(t)_i)^2                 >  1e-4

(its defaults; TE's ``LogFp8TensorStats`` documents both statistics this way). The inputs of
each GEMM (the layouts of :mod:`gnmr_dist.backends.emulated_linear`):

    fprop  Q_K(x),  Q_K(W)        dgrad  Q_N(dy), Q_N(W)        wgrad  Q_M(dy), Q_M(x)

:class:`AutoswitchFn` quantizes each pair on the low-cost spec, measures both statistics and
runs the GEMM on the low-cost or the high-precision spec, inside one autograd function, so the
backward's decisions see this iteration's ``dy``. Two arms use it (:mod:`benchmarks.harness.
training`): the rule as TE has it (``autoswitch``: every GEMM decides), and the rule capped at
the budget (``autoswitch_k``: the ``k`` units with the largest score of the previous step run
all three GEMMs high, the others stay low-cost; the score of a unit is
``max over its GEMMs and inputs of max(underflow / 5%, MSE / 1e-4)``, so a score above 1 is a
GEMM the uncapped rule would switch). A budget has to be decided before the step's first
forward, hence the one-step lag of the capped form: it is an error-only selector, the ablation
of GNMR's history scores.

Delayed scaling: the low-cost quantization uses the operator's delayed histories of the
backend (the scale TE's debug path would read), recording every call's amax as training does.
Stochastic rounding draws per (step, unit, operator, call), as the backend keys its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gnmr_dist.backends.emulated_options import LinearQuantSpec
from gnmr_dist.backends.emulated_scaling import DelayedScales
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled

__all__ = ["MSE", "UNDERFLOW", "AutoswitchFn", "GemmLedger", "Switch"]

UNDERFLOW = 0.05
"""TE AutoswitchGemm's default underflow threshold (a share of the tensor's elements)."""
MSE = 1e-4
"""Its default mean-squared-error threshold (absolute, in the tensor's own units)."""

FPROP, DGRAD, WGRAD = 0, 1, 2


@dataclass
class GemmLedger:
    """What the rule saw and did in one step: per unit and GEMM, the largest score of its calls
    and whether a call ran high (``[U, 3]`` each, GEMM order fprop, dgrad, wgrad)."""

    num_units: int
    score: Tensor = field(init=False)
    high: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new step."""
        self.score = torch.zeros(self.num_units, 3, dtype=torch.float64)
        self.high = torch.zeros(self.num_units, 3, dtype=torch.bool)

    def judge(self, uid: int, gemm: int, *pairs: tuple[Tensor, Tensor]) -> bool:
        """Score the GEMM's quantized inputs ``(t, Q(t))``; whether the rule switches it."""
        score = max(_score(t, q) for t, q in pairs)
        self.score[uid, gemm] = max(float(self.score[uid, gemm]), score)
        return score > 1.0

    def unit_scores(self) -> Tensor:
        """float64 ``[U]``: each unit's largest score this step (the capped rule's ranking)."""
        return self.score.max(dim=1).values


def _score(t: Tensor, q: Tensor) -> float:
    """``max(underflow / UNDERFLOW, MSE / MSE)`` of ``t`` against its quantization ``q``."""
    t, q = t.float(), q.float()
    underflow = ((q == 0) & (t != 0)).float().mean()
    mse = (t - q).square().mean()
    return float(torch.maximum(underflow / UNDERFLOW, mse / MSE))


@dataclass(frozen=True)
class Switch:
    """One call's settings: the two specs, the low-cost path's delayed histories (``None``:
    current scaling), the ledger, the unit, whether the rule decides (``decide``) or the plan
    does (``forced``: all three GEMMs high), and the call's stochastic-rounding key."""

    low: LinearQuantSpec
    high: LinearQuantSpec
    scales: DelayedScales | None
    ledger: GemmLedger
    uid: int
    decide: bool
    forced: bool
    key: tuple[int, ...]

    def run(self, gemm: int, bad: bool) -> bool:
        """Whether ``gemm`` runs high, and the ledger's note of it."""
        high = self.forced or (self.decide and bad)
        if high:
            self.ledger.high[self.uid, gemm] = True
        return high

    def seed(self, spec: LinearQuantSpec, gemm: int) -> int | None:
        """``dy``'s stochastic-rounding seed in ``gemm`` on ``spec`` (``None``: to nearest)."""
        return sr_seed(sr_seed(spec.seed, *self.key), gemm) if spec.stochastic else None

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return AutoswitchFn.apply(x, weight, bias, self)  # type: ignore[no-untyped-call,no-any-return]


def _act(spec: LinearQuantSpec, t: Tensor, grad: bool, dim: int, seed: int | None = None) -> Tensor:
    fmt = spec.grad_format if grad else spec.x_format
    return t if fmt.is_identity else spec.act(t, fmt, dim=dim, seed=seed)


def _weight(spec: LinearQuantSpec, w: Tensor, dim: int) -> Tensor:
    return w if spec.x_format.is_identity else spec.weight(w, dim=dim)


class AutoswitchFn(torch.autograd.Function):
    """``y = x W^T + b`` whose three GEMMs each run low-cost or high per the rule (module
    docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, sw: Switch) -> Tensor:
        low, high = sw.low, sw.high
        x2 = x.reshape(-1, x.shape[-1])
        ctx.x_scale = None
        if sw.scales is None:
            xq, wq = _act(low, x2, False, -1), _weight(low, weight, -1)
        else:
            # the delayed scale x was quantized with is kept: wgrad requantizes x with that scale,
            # as a real FP8 wgrad reuses the forward's quantized x
            xq, ctx.x_scale = sw.scales.x.quantize(x2, record=True)
            wq = sw.scales.w.quantize(weight, record=True)[0]
        # judged on the low-cost quantization the GEMM would run, then its inputs redone high: the
        # statistics come first, as in TE
        if sw.run(FPROP, sw.ledger.judge(sw.uid, FPROP, (x2, xq), (weight, wq))):
            xq, wq = _act(high, x2, False, -1), _weight(high, weight, -1)
        # fp32 accumulation, as a tensor core accumulates a low-precision GEMM
        y = xq.float().mm(wq.float().t())
        if bias is not None:
            y = y + bias.float()
        # the unquantized inputs: the backward quantizes along its own layouts (Q_N, Q_M), and a
        # GEMM that switches high needs the originals
        ctx.save_for_backward(x, weight)
        ctx.sw, ctx.has_bias = sw, bias is not None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        sw: Switch = ctx.sw
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        # one delayed quantization of dy for dgrad and wgrad: its amax enters the history once per
        # call, as in training
        delayed = None if sw.scales is None else sw.scales.dy.quantize(dy2, record=True)[0]
        dx = _dgrad(sw, dy2, weight, delayed).to(x.dtype).reshape(x.shape)
        dw = _wgrad(sw, dy2, x2, delayed, ctx.x_scale).to(weight.dtype)
        db = dy2.float().sum(dim=0).to(dy.dtype) if ctx.has_bias else None
        return dx, dw, db, None


def _dgrad(sw: Switch, dy2: Tensor, weight: Tensor, delayed: Tensor | None) -> Tensor:
    """``dx = Q_N(dy) Q_N(W)``, low-cost or high."""
    low, high = sw.low, sw.high
    if delayed is None:
        # dgrad and wgrad draw their own rounding of dy (keys 0, 1), as the backend keys its own
        dyq, wq = _act(low, dy2, True, -1, sw.seed(low, 0)), _weight(low, weight, 0)
    else:
        # record=False: the forward recorded W's amax; a second record would age its history twice
        dyq, wq = delayed, sw.scales.w.quantize(weight, record=False)[0]  # type: ignore[union-attr]
    if sw.run(DGRAD, sw.ledger.judge(sw.uid, DGRAD, (dy2, dyq), (weight, wq))):
        dyq, wq = _act(high, dy2, True, -1, sw.seed(high, 0)), _weight(high, weight, 0)
    return dyq.float().mm(wq.float())


def _wgrad(
    sw: Switch, dy2: Tensor, x2: Tensor, delayed: Tensor | None, x_scale: Tensor | None
) -> Tensor:
    """``dW = Q_M(dy)^T Q_M(x)`` (rotated operands under the Hadamard transform), low or high."""
    low, high = sw.low, sw.high
    xr, dyr = low.rotate(x2), low.rotate(dy2)
    if delayed is None:
        dyq, xq = _act(low, dyr, True, 0, sw.seed(low, 1)), _act(low, xr, False, 0)
    else:
        dyq, xq = delayed, quantize_dequantize_scaled(x2, low.x_format, x_scale)
    if sw.run(WGRAD, sw.ledger.judge(sw.uid, WGRAD, (dyr, dyq), (xr, xq))):
        xr, dyr = high.rotate(x2), high.rotate(dy2)
        dyq, xq = _act(high, dyr, True, 0, sw.seed(high, 1)), _act(high, xr, False, 0)
    return dyq.float().t().mm(xq.float())
