"""``fp8_emulated``: linear layers whose GEMM inputs are rounded to FP8/FP6, on any device.

A linear layer ``y = x W^T + b`` (``x``: [M tokens, K in], ``W``: [N out, K]) runs three GEMMs
per training step. Each one's inputs are fake-quantized (:mod:`gnmr_dist.backends.numerics`:
scaled, rounded to the format, scaled back) along that GEMM's reduction dimension, and the
product is accumulated in fp32, as an FP8 tensor-core GEMM does:

    forward  (reduce over K):  y  = Q_K(x)   @ Q_K(W)^T  + b
    dgrad    (reduce over N):  dx = Q_N(dy)  @ Q_N(W)
    wgrad    (reduce over M):  dW = Q_M(dy)^T @ Q_M(x)
    bias:                      db = sum_M dy               (not quantized)

With ``granularity="block"`` (the default) activations and gradients get one scale per 1 x block
tile and weights one per block x block tile, DeepSeek-V3's fine-grained recipe: tiles along the
reduction dimension let a kernel apply the scales to partial sums, and an outlier only spoils
its own tile. ``Q_K(W)`` and ``Q_N(W)`` are the same tensor for square weight tiles; ``Q_M(x)``
uses 128 x 1 tiles of ``x``. The forward saves ``x`` as given and the dequantized ``Q(W)`` (fp32,
one weight-sized buffer; with row scales it saves ``W`` and re-quantizes it along N), so wgrad
quantizes the full-precision ``x`` once. DeepSeek caches ``x`` as 1 x 128 FP8 and re-quantizes
it into 128 x 1 tiles, a second rounding this emulation does not model.

Options (one block per path, parsed strictly):

    format       "e4m3" | "e5m2" | "e3m2" | "e2m3" | "bf16" | "fp16" | "fp32"   (x and W)
    grad_format  same choices or None (= format)                                  (dy)
    granularity  "tensor" | "row" | "block" | "none" or None
                 (None = "block" for FP8/FP6, "none" for bf16/fp16/fp32: a plain cast)
    block        tile length along the reduction dimension (default 128)

Defaults: low-cost ``{"format": "e4m3"}`` (e4m3 for x, W and dy with 1x128 / 128x128 blocks, as
DeepSeek-V3: fine-grained scales make e5m2's extra range for gradients unnecessary; set
``"grad_format": "e5m2"`` for the hybrid recipe); recovery ``{"format": "bf16"}`` (bf16 GEMM
inputs, fp32 accumulation). A path whose formats are both ``fp32`` is the unwrapped module:
plain ``F.linear``.

On the CPU the rounding costs a few elementwise passes per GEMM (see the step-time check in
``tests/backends/test_fp8_emulated.py``); nothing is faster than fp32, it only behaves like FP8.

Error score (``gnmr.gamma``, DESIGN.md section 2.1; after ``track_errors``)
---------------------------------------------------------------------------
Both factors of the weight gradient are rounded, so per GEMM the backend reports

    ||dy||_F ||x - Q_M(x)||_F + ||Q_M(dy) - dy||_F ||x||_F

with the wgrad GEMM's own quantizers (tiles along M, the low-cost formats; a term whose format
is ``fp32`` is dropped), summed into ``B(u)``. On the low-cost path the backward already holds
``Q_M(x)`` and ``Q_M(dy)``: the score costs two subtractions and four norms per GEMM. A unit on
the recovery path is measured in shadow: ``Q_M(x)`` at the low-cost format once in the forward
and ``Q_M(dy)`` once in a hook on the output gradient, only to take the norms. The rounding of
``W`` does not enter the weight gradient and is not scored. No GEMM, no host sync.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, GemmProbe, PrecisionBackend
from gnmr_dist.backends.numerics import (
    FORMATS,
    GRANULARITIES,
    FloatFormat,
    quantize_dequantize,
)
from gnmr_dist.backends.options import parse_options

__all__ = ["Fp8EmulatedBackend", "Fp8LinearFn", "Fp8Options", "LinearQuantSpec", "fp8_linear"]


def _check_choice(field: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Fp8Options:
    """One path's GEMM-input precision (the ``low_cost`` or ``recovery`` block)."""

    format: str = "e4m3"
    """Format of the forward GEMM inputs ``x`` and ``W`` (and of ``x`` in wgrad)."""
    grad_format: str | None = None
    """Format of the output gradient ``dy`` in dgrad and wgrad; ``None`` = ``format``."""
    granularity: str | None = None
    """Scale groups: tensor, row, block or none; ``None`` = block for FP8/FP6, none otherwise."""
    block: int = 128
    """Tile length along the reduction dim: 1 x block for x and dy, block x block for W."""

    def __post_init__(self) -> None:
        _check_choice("format", self.format, sorted(FORMATS))
        if self.grad_format is not None:
            _check_choice("grad_format", self.grad_format, sorted(FORMATS))
        if self.granularity is not None:
            _check_choice("granularity", self.granularity, GRANULARITIES)
        b = self.block
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block must be an integer >= 1, got {b!r}")


@dataclass(frozen=True)
class LinearQuantSpec:
    """The resolved quantization of one path: what :class:`Fp8LinearFn` applies."""

    x_format: FloatFormat
    """Format of ``x`` (forward and wgrad) and of ``W`` (forward and dgrad)."""
    grad_format: FloatFormat
    """Format of ``dy`` (dgrad and wgrad)."""
    granularity: str
    """tensor, row, block or none."""
    block: int = 128
    """Tile length along the reduction dimension."""

    @classmethod
    def from_options(cls, options: Fp8Options) -> LinearQuantSpec:
        """Fill the ``None`` defaults of ``options``."""
        fmt = FORMATS[options.format]
        grad = FORMATS[options.grad_format or options.format]
        granularity = options.granularity or ("block" if fmt.scaled or grad.scaled else "none")
        return cls(fmt, grad, granularity, options.block)

    @property
    def is_identity(self) -> bool:
        """True when nothing is rounded: the path is plain ``F.linear``."""
        return self.x_format.is_identity and self.grad_format.is_identity

    def act(self, x: torch.Tensor, fmt: FloatFormat, dim: int) -> torch.Tensor:
        """``Q(x)`` of an activation or gradient: 1 x block tiles along ``dim``."""
        return quantize_dequantize(x, fmt, self.granularity, block=(1, self.block), dim=dim)

    def weight(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """``Q(W)``: block x block tiles, rows along ``dim``."""
        tile = (self.block, self.block)
        return quantize_dequantize(w, self.x_format, self.granularity, block=tile, dim=dim)

    @property
    def weight_transposable(self) -> bool:
        """Whether ``Q_K(W) == Q_N(W)`` (the same tiles whichever dim they run along)."""
        return self.granularity != "row"


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 accumulation, float64 when an input is float64 (gradcheck)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


class Fp8LinearFn(torch.autograd.Function):
    """``y = Q(x) Q(W)^T + b`` with quantized dgrad and wgrad (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: LinearQuantSpec,
        probe: GemmProbe | None = None,
    ) -> torch.Tensor:
        acc = _acc_dtype(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        wq = spec.weight(weight, dim=-1).to(acc)
        y = spec.act(x2, spec.x_format, dim=-1).to(acc).mm(wq.t())
        if bias is not None:
            y = y + bias.to(acc)
        w_saved = wq if spec.weight_transposable else weight
        ctx.save_for_backward(x, w_saved)
        ctx.spec, ctx.acc, ctx.has_bias, ctx.probe = spec, acc, bias is not None, probe
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_saved = ctx.saved_tensors
        spec: LinearQuantSpec = ctx.spec
        acc: torch.dtype = ctx.acc
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            wq = w_saved if spec.weight_transposable else spec.weight(w_saved, dim=0)
            dyq = spec.act(dy2, spec.grad_format, dim=-1).to(acc)
            dx = dyq.mm(wq.to(acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dyq_m = spec.act(dy2, spec.grad_format, dim=0).to(acc)
            xq_m = spec.act(x.reshape(-1, x.shape[-1]), spec.x_format, dim=0).to(acc)
            dw = dyq_m.t().mm(xq_m).to(ctx.w_dtype)
            if ctx.probe is not None:
                _record_wgrad_error(ctx.probe, spec, x, dy2, xq_m, dyq_m, acc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(acc).sum(dim=0).to(ctx.b_dtype)
        return dx, dw, db, None, None


@dataclass
class _InputNorms:
    """``||x - Q_M(x)||`` and ``||x||`` of one forward input, taken once for all the GEMMs that
    read it (q/k/v, gate/up)."""

    x_err: torch.Tensor | None = None
    x_norm: torch.Tensor | None = None
    done: bool = False

    def fill(self, spec: LinearQuantSpec, x2: torch.Tensor, xq_m: torch.Tensor) -> None:
        """Measure from ``x2`` and its wgrad quantization ``xq_m`` (both flat, one dtype)."""
        if self.done:
            return
        want_err, want_norm = not spec.x_format.is_identity, not spec.grad_format.is_identity
        tensors = [xq_m - x2] if want_err else []
        norms = torch._foreach_norm([*tensors, x2] if want_norm else tensors)
        self.x_err = norms[0] if want_err else None
        self.x_norm = norms[-1] if want_norm else None
        self.done = True


@dataclass
class _Fp8Probe(GemmProbe):
    """A :class:`GemmProbe` whose ``x`` norms are shared with the GEMMs of the same input."""

    shared: _InputNorms = field(default_factory=_InputNorms)

    def record_dy(self, spec: LinearQuantSpec, dy2: torch.Tensor, dyq_m: torch.Tensor) -> None:
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
    x: torch.Tensor,
    dy2: torch.Tensor,
    xq_m: torch.Tensor,
    dyq_m: torch.Tensor,
    acc: torch.dtype,
) -> None:
    """``||dy|| ||x - Q_M(x)|| + ||Q_M(dy) - dy|| ||x||`` of one wgrad GEMM, from its operands."""
    assert isinstance(probe, _Fp8Probe)
    if not probe.shared.done:  # projections of one input share its norms: cast it once
        probe.shared.fill(spec, x.reshape(-1, x.shape[-1]).to(acc), xq_m)
    probe.record_dy(spec, dy2.to(acc), dyq_m)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: LinearQuantSpec,
    probe: GemmProbe | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as ``spec`` says.

    ``probe`` receives the wgrad GEMM's error bound in the backward (module docstring).
    """
    return Fp8LinearFn.apply(x, weight, bias, spec, probe)  # type: ignore[no-untyped-call,no-any-return]


class Fp8EmulatedBackend(PrecisionBackend):
    """Emulated FP8/FP6 GEMMs on the low-cost path, bf16 (or any format) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks of :class:`Fp8Options`; defaults
    ``{"format": "e4m3"}`` (1x128 / 128x128 block scales) and ``{"format": "bf16"}``.
    """

    name = "fp8_emulated"
    reports_errors = True

    def __init__(
        self,
        *,
        low_cost: Mapping[str, Any] | None = None,
        recovery: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.low_cost = parse_options(Fp8Options, low_cost, "gnmr.low_cost")
        rec = {"format": "bf16", **(recovery or {})}
        self.recovery = parse_options(Fp8Options, rec, "gnmr.recovery")
        self.specs = {
            LOW_COST: LinearQuantSpec.from_options(self.low_cost),
            RECOVERY: LinearQuantSpec.from_options(self.recovery),
        }
        self._last_input: tuple[Any, int, _InputNorms] = (None, 0, _InputNorms())

    def _gemm_fn(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        spec, low = self.specs[path], self.specs[LOW_COST]

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            probe = None
            if weight.requires_grad and not low.is_identity:
                probe = self._probe(x)
            if path == LOW_COST and probe is not None:
                return fp8_linear(x, weight, bias, spec, probe)
            y = F.linear(x, weight, bias) if spec.is_identity else fp8_linear(x, weight, bias, spec)
            if probe is not None and y.requires_grad:
                self._shadow(probe, x, y)
            return y

        return gemm

    def _probe(self, x: torch.Tensor) -> _Fp8Probe | None:
        """A probe for the running unit, sharing ``x``'s norms with the last GEMM of the same
        ``x`` (one slot keyed on its identity and version, as ``act_quant``'s shared pack)."""
        base = self._error_probe()
        if base is None:
            return None
        ref, version, shared = self._last_input
        if ref is None or ref() is not x or version != x._version:
            shared = _InputNorms()
            self._last_input = (weakref.ref(x), x._version, shared)
        return _Fp8Probe(base.sink, base.unit, shared=shared)

    def _shadow(self, probe: _Fp8Probe, x: torch.Tensor, y: torch.Tensor) -> None:
        """Measure the low-cost wgrad error of a recovered GEMM: ``x`` now, ``dy`` in a hook."""
        low = self.specs[LOW_COST]
        if not probe.shared.done:  # projections of one input share its norms: cast it once
            x2 = x.detach().reshape(-1, x.shape[-1])
            x2 = x2.to(torch.promote_types(x2.dtype, torch.float32))
            xq_m = low.act(x2, low.x_format, dim=0) if not low.x_format.is_identity else x2
            probe.shared.fill(low, x2, xq_m.to(x2.dtype))

        def hook(dy: torch.Tensor) -> None:
            dy2 = dy.reshape(-1, dy.shape[-1])
            dy2 = dy2.to(torch.promote_types(dy2.dtype, torch.float32))
            dyq_m = dy2 if low.grad_format.is_identity else low.act(dy2, low.grad_format, dim=0)
            probe.record_dy(low, dy2, dyq_m.to(dy2.dtype))

        y.register_hook(hook)
