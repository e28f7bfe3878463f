"""The quantized linear of ``fp8_emulated``: three GEMMs whose inputs are rounded to FP8/FP6/FP4.

A linear layer ``y = x W^T + b`` (``x``: [M tokens, K in], ``W``: [N out, K]) runs three GEMMs
per training step. Each one's inputs are fake-quantized (:mod:`gnmr_dist.backends.numerics`:
scaled, rounded to the format, scaled back) along that GEMM's reduction dimension, and the
product is accumulated in fp32, as an FP8 tensor-core GEMM does:

    fprop  (reduce over K):  y  = Q_K(x)   @ Q_K(W)^T  + b
    dgrad  (reduce over N):  dx = Q_N(dy)  @ Q_N(W)
    wgrad  (reduce over M):  dW = Q_M(dy)^T @ Q_M(x)
    bias:                    db = sum_M dy               (not quantized)

``Q_K(W)`` and ``Q_N(W)`` are the same tensor for square weight tiles, so the forward saves the
dequantized ``Q(W)`` (fp32, one weight-sized buffer; with row scales it saves ``W`` and
re-quantizes it along N) and ``x`` as given, so wgrad quantizes the full-precision ``x`` once
(DeepSeek-V3 caches ``x`` as 1 x 128 FP8 and re-quantizes it, a second rounding not modelled).
With NVFP4's Hadamard transform wgrad runs on ``Q_M(H dy)^T Q_M(H x)`` (``(H dy)^T (H x) =
dy^T x``); ``dy`` may be rounded stochastically, with a seed per call (:class:`EmulatedCall`).

Error score (``B(u)``, ``docs/backends.md#error-scores``): per wgrad GEMM

    ||dy||_F ||x - Q_M(x)||_F + ||Q_M(dy) - dy||_F ||x||_F

with the GEMM's own operands (rotated ones under the Hadamard transform: same norms, same
product); a term whose format is ``fp32`` is dropped. Projections of one input share its
``x`` norms (:class:`InputNorms`). Two subtractions and four norms per GEMM, no host sync. A call
may run its dgrad and wgrad on other specs than its fprop (:attr:`EmulatedCall.dgrad`,
``gnmr.gemms``: ``docs/gemms.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gnmr_dist.backends.emulated_options import LinearQuantSpec
from gnmr_dist.backends.emulated_scaling import DelayedScales
from gnmr_dist.backends.error_sums import GemmProbe
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled

__all__ = ["EmulatedCall", "EmulatedLinearFn", "EmulatedProbe", "InputNorms", "emulated_linear"]


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp32 accumulation, float64 when an input is float64 (gradcheck)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


@dataclass(frozen=True)
class EmulatedCall:
    """What one call of :func:`emulated_linear` quantizes with, besides its operands."""

    spec: LinearQuantSpec
    """The path's quantization."""
    probe: GemmProbe | None = None
    """Receives the wgrad GEMM's error bound in the backward (``None``: nothing measured)."""
    scales: DelayedScales | None = None
    """The operator's delayed-scaling histories on the path (``None``: current scaling)."""
    record: bool = True
    """Whether this call's amaxes of x, W and (in the backward) dy join the step's."""
    seed: int = 0
    """Stochastic rounding's seed for this call (the backend mixes step, unit, operator and
    call in); its dgrad and wgrad quantizations of ``dy`` draw from two seeds derived here."""
    dgrad: EmulatedCall | None = None
    """The call whose spec and seed the dgrad GEMM runs with (``None``: this one). A recovered
    unit that recovers only some GEMMs (``gnmr.gemms``) runs each on its own path's call."""
    wgrad: EmulatedCall | None = None
    """The same for the wgrad GEMM (its error is recorded with that call's spec)."""

    def __post_init__(self) -> None:
        if (self.dgrad or self.wgrad) is not None and self.scales is not None:
            raise ValueError("a call with per-GEMM specs takes no delayed scales")

    def seed_of(self, gemm: int) -> int | None:
        """The seed of ``dy``'s quantization in GEMM ``gemm`` (0 dgrad, 1 wgrad), or ``None``
        when the spec rounds to nearest."""
        return sr_seed(self.seed, gemm) if self.spec.stochastic else None

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as :attr:`spec`
        says (a :data:`~gnmr_dist.backends.operators.Gemm`)."""
        return EmulatedLinearFn.apply(x, weight, bias, self)  # type: ignore[no-untyped-call,no-any-return]


class EmulatedLinearFn(torch.autograd.Function):
    """``y = Q(x) Q(W)^T + b`` with quantized dgrad and wgrad (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, call: EmulatedCall
    ) -> Tensor:
        spec, scales = call.spec, call.scales
        acc = _acc_dtype(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.x_scale = None
        if scales is None:
            wq = spec.weight(weight, dim=-1).to(acc)
            xq = spec.act(x2, spec.x_format, dim=-1)
        else:  # one tensor scale serves every GEMM: Q_K(x) = Q_M(x), Q_K(W) = Q_N(W)
            wq = scales.w.quantize(weight, record=call.record)[0].to(acc)
            xq, ctx.x_scale = scales.x.quantize(x2, record=call.record)
        # fprop: y[M,N] = Q_K(x)[M,K] @ Q_K(W)[N,K]^T
        y = xq.to(acc).mm(wq.t())
        if bias is not None:
            y = y + bias.to(acc)
        # dgrad reuses Q_K(W) when it runs this call's spec and Q_K(W) = Q_N(W)
        w_saved = wq if call.dgrad is None and spec.weight_transposable else weight
        ctx.save_for_backward(x, w_saved)
        ctx.call, ctx.acc, ctx.has_bias = call, acc, bias is not None
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w_saved = ctx.saved_tensors
        call: EmulatedCall = ctx.call
        acc = ctx.acc
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        delayed = _delayed_dy(ctx, dy2)  # None: current scaling, per GEMM below
        if ctx.needs_input_grad[0]:
            dcall = call.dgrad or call
            spec = dcall.spec
            wq = _dgrad_weight(call, w_saved)
            dyq = delayed
            if dyq is None:
                dyq = spec.act(dy2, spec.grad_format, dim=-1, seed=dcall.seed_of(0))
            # dgrad: dx[M,K] = Q_N(dy)[M,N] @ Q_N(W)[N,K]
            dx = dyq.to(acc).mm(wq.to(acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            wcall = call.wgrad or call
            spec = wcall.spec
            xr, dyr = spec.rotate(x.reshape(-1, x.shape[-1])), spec.rotate(dy2)
            dyq_m = delayed
            if dyq_m is None:
                dyq_m = spec.act(dyr, spec.grad_format, dim=0, seed=wcall.seed_of(1))
            dyq_m, xq_m = dyq_m.to(acc), _wgrad_x(ctx, spec, xr).to(acc)
            # wgrad: dW[N,K] = Q_M(dy)[M,N]^T @ Q_M(x)[M,K]  (M: tokens, rotated and padded
            # to a multiple of 16 under the Hadamard transform)
            dw = dyq_m.t().mm(xq_m).to(ctx.w_dtype)
            if call.probe is not None:
                _record_wgrad_error(call.probe, spec, xr, dyr, xq_m, dyq_m, acc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(acc).sum(dim=0).to(ctx.b_dtype)  # bias: db[N] = sum_M dy[M,N]
        return dx, dw, db, None


def _delayed_dy(ctx: Any, dy2: Tensor) -> Tensor | None:
    """``Q(dy)`` at this step's delayed scale (both GEMMs: one tensor scale), recorded once;
    ``None`` under current scaling or when no input needs a gradient."""
    call: EmulatedCall = ctx.call
    if call.scales is None or not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None
    return call.scales.dy.quantize(dy2, record=call.record)[0]


def _dgrad_weight(call: EmulatedCall, w_saved: Tensor) -> Tensor:
    """``Q_N(W)`` for dgrad: the forward's ``Q_K(W)`` when it is the same tensor, else ``W``
    quantized as the dgrad call's spec quantizes it on its own path (the same tiles its
    forward would have cut when they are transposable, so a GEMM recovered alone or kept on the
    low-cost path gets the bits that path gives it)."""
    if call.dgrad is None:
        spec = call.spec
        return w_saved if spec.weight_transposable else spec.weight(w_saved, dim=0)
    spec = call.dgrad.spec
    return spec.weight(w_saved, dim=-1 if spec.weight_transposable else 0)


def _wgrad_x(ctx: Any, spec: LinearQuantSpec, x2: Tensor) -> Tensor:
    """``Q_M(x)`` for wgrad: ``spec``'s tiles along M, or the forward's own delayed scale."""
    if ctx.call.scales is None:
        return spec.act(x2, spec.x_format, dim=0)
    return quantize_dequantize_scaled(x2, spec.x_format, ctx.x_scale)


@dataclass
class InputNorms:
    """``||x - Q_M(x)||`` and ``||x||`` of one forward input, taken once for all the GEMMs that
    read it (q/k/v, gate/up)."""

    x_err: Tensor | None = None
    x_norm: Tensor | None = None
    done: bool = False
    columns: Tensor | None = None
    """Per input feature ``c_k``: the trained parameter's gradient is the GEMM weight's with
    column ``k`` times ``c_k`` (a GEMM on a reparametrized weight ``W diag(c)``); the norms are
    then taken on ``x diag(c)`` and ``Q_M(x) diag(c)``, so ``B(u)`` bounds the error of the
    parameter's gradient (:meth:`~gnmr_dist.backends.emulated.EmulatedBackend.
    scale_gradient_columns`). ``None``: the weight is the parameter."""

    def fill(self, spec: LinearQuantSpec, x2: Tensor, xq_m: Tensor) -> None:
        """Measure from ``x2`` and its wgrad quantization ``xq_m`` (both flat, one dtype)."""
        if self.done:
            return
        if self.columns is not None:  # a column scale commutes with the rotation along M
            c = self.columns.to(x2.dtype)
            x2, xq_m = x2 * c, xq_m * c
        want_err, want_norm = not spec.x_format.is_identity, not spec.grad_format.is_identity
        tensors = [xq_m - x2] if want_err else []
        norms = torch._foreach_norm([*tensors, x2] if want_norm else tensors)
        self.x_err = norms[0] if want_err else None
        self.x_norm = norms[-1] if want_norm else None
        self.done = True


@dataclass
class EmulatedProbe(GemmProbe):
    """A :class:`GemmProbe` whose ``x`` norms are shared with the GEMMs of the same input."""

    shared: InputNorms = field(default_factory=InputNorms)

    def record_dy(self, spec: LinearQuantSpec, dy2: Tensor, dyq_m: Tensor) -> None:
        """``||dy||`` and ``||Q_M(dy) - dy||`` (one fused norm call), then the bound."""
        self.x_err, self.x_norm = self.shared.x_err, self.shared.x_norm
        if spec.grad_format.is_identity:
            self.record(torch.linalg.vector_norm(dy2))
            return
        dy_norm, dy_err = torch._foreach_norm([dy2, dyq_m - dy2])
        self.record(dy_norm, dy_err)


def _record_wgrad_error(
    probe: GemmProbe,
    spec: LinearQuantSpec,
    x2: Tensor,
    dy2: Tensor,
    xq_m: Tensor,
    dyq_m: Tensor,
    acc: torch.dtype,
) -> None:
    """``||dy|| ||x - Q_M(x)|| + ||Q_M(dy) - dy|| ||x||`` of one wgrad GEMM, from its operands
    (``x2``, ``dy2`` flat and, with the Hadamard transform, rotated: the rotation keeps the
    norms and the product, so the bound holds for the rotated operands as for the originals)."""
    assert isinstance(probe, EmulatedProbe)
    if not probe.shared.done:  # projections of one input share its norms: cast it once
        probe.shared.fill(spec, x2.to(acc), xq_m)
    probe.record_dy(spec, dy2.to(acc), dyq_m)


def emulated_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, spec: LinearQuantSpec
) -> Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as ``spec`` says:
    :class:`EmulatedCall` with nothing measured and current scaling (the backend's calls add a probe
    and delayed scales)."""
    return EmulatedCall(spec)(x, weight, bias)
