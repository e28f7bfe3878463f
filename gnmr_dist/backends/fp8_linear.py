"""The quantized linear of ``fp8_emulated``: one path's options, and its three GEMMs.

:class:`Fp8Options` is one ``low_cost`` / ``recovery`` block, :class:`LinearQuantSpec` its
resolved quantization, and :func:`fp8_linear` the linear whose forward, dgrad and wgrad GEMMs
take inputs quantized as the spec says, with the wgrad GEMM's error bound for ``B(u)``. The
maths, the options and the error score: :mod:`gnmr_dist.backends.fp8_emulated`; delayed
scaling's histories: :mod:`gnmr_dist.backends.fp8_scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gnmr_dist.backends.base import GemmProbe
from gnmr_dist.backends.fp8_scaling import AMAX_ALGOS, DelayedRecipe, DelayedScales
from gnmr_dist.backends.numerics.formats import (
    BLOCK_SCALED,
    FORMATS,
    GRANULARITIES,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    FloatFormat,
)
from gnmr_dist.backends.numerics.hadamard import hadamard_rotate
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize, quantize_dequantize_scaled
from gnmr_dist.core.validation import check_choice, check_nonnegative_int, check_positive_int

__all__ = [
    "SCALINGS",
    "Fp8Call",
    "Fp8LinearFn",
    "Fp8Options",
    "Fp8Probe",
    "InputNorms",
    "LinearQuantSpec",
    "fp8_linear",
]

SCALINGS = ("current", "delayed")
"""``"current"``: each call's own amax; ``"delayed"``: the amax history of earlier steps."""


@dataclass(frozen=True)
class Fp8Options:
    """One path's GEMM-input precision (the ``low_cost`` or ``recovery`` block)."""

    format: str = "e4m3"
    """Format of the forward GEMM inputs ``x`` and ``W`` (and of ``x`` in wgrad)."""
    grad_format: str | None = None
    """Format of the output gradient ``dy`` in dgrad and wgrad; ``None`` = ``format``."""
    granularity: str | None = None
    """Scale groups: tensor, row, block, none, nvfp4 or mxfp4; ``None`` = nvfp4 for e2m1, block
    for FP8/FP6, none otherwise."""
    block: int | None = None
    """Tile length along the reduction dim: 1 x block for x and dy, block x block for W
    (``None`` = 128; 16 for nvfp4 and 32 for mxfp4, fixed by those formats)."""
    weight_2d: bool | None = None
    """FP4 only: W in block x block tiles (the same tiles for fprop and dgrad) or 1 x block
    along each GEMM's reduction dim; ``None`` = True for nvfp4 (NVIDIA's 16 x 16), False for
    mxfp4."""
    stochastic_rounding: bool | None = None
    """Round ``dy`` (dgrad and wgrad) stochastically; ``None`` = True for nvfp4, else False."""
    hadamard: bool | None = None
    """Rotate both wgrad inputs along the tokens by the 16 x 16 random Hadamard transform
    before quantizing them; ``None`` = True for nvfp4, else False."""
    seed: int = 0
    """Stochastic rounding's seed, mixed with the step, the unit, the operator and the call
    (another seed is another draw of the rounding noise and nothing else)."""
    scaling: str = "current"
    """``"current"`` (each call's own amax) or ``"delayed"`` (TE's recipe; per tensor only)."""
    amax_history_len: int | None = None
    """Delayed only: steps of amax history, >= 1 (``None`` = 16; TE's default is 1024)."""
    amax_compute_algo: str | None = None
    """Delayed only: ``"max"`` or ``"most_recent"`` (``None`` = max, as TE)."""
    margin: int | None = None
    """Delayed only: binades of headroom, >= 0 (``None`` = 0, as TE)."""

    def __post_init__(self) -> None:
        check_choice(self.format, sorted(FORMATS), "format")
        if self.grad_format is not None:
            check_choice(self.grad_format, sorted(FORMATS), "grad_format")
        if self.granularity is not None:
            check_choice(self.granularity, GRANULARITIES, "granularity")
        b = self.block
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"block must be an integer >= 1, got {b!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("weight_2d", "stochastic_rounding", "hadamard"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null, got {value!r}")
        check_choice(self.scaling, SCALINGS, "scaling")
        if self.scaling == "delayed":
            self._check_delayed()
        else:
            self._refuse_delayed_only()
        self._check_fp4()

    @property
    def resolved_granularity(self) -> str:
        """:attr:`granularity` with its default: nvfp4 for e2m1, block for FP8/FP6, else none."""
        if self.granularity is not None:
            return self.granularity
        formats = (FORMATS[self.format], FORMATS[self.grad_format or self.format])
        if any(f.name == "e2m1" for f in formats):
            return "nvfp4"
        return "block" if any(f.scaled for f in formats) else "none"

    def _check_fp4(self) -> None:
        """The FP4 granularities take e2m1 (or an unscaled cast) and their own block; the FP4
        options need a narrow format to act on."""
        g = self.resolved_granularity
        grad = self.grad_format or self.format
        if g in BLOCK_SCALED:
            for key, name in (("format", self.format), ("grad_format", grad)):
                if FORMATS[name].scaled and name != "e2m1":
                    raise ValueError(
                        f"{key} {name!r} cannot use granularity {g!r}, which scales FP4 e2m1 "
                        f'blocks; use "e2m1" (or "bf16" for an unquantized {key}), or '
                        'granularity "block"'
                    )
            fixed = (NVFP4_BLOCK if g == "nvfp4" else MXFP4_BLOCK)[1]
            if self.block not in (None, fixed):
                raise ValueError(f"granularity {g!r} has blocks of {fixed}, got block {self.block}")
        elif self.weight_2d is not None:
            raise ValueError(
                f"weight_2d applies to granularity 'nvfp4' / 'mxfp4' (here {g!r}, whose weight "
                "tiles are block x block); remove it"
            )
        if self.stochastic_rounding and not FORMATS[grad].scaled:
            raise ValueError(
                f"stochastic_rounding needs a narrow grad_format (FP8/FP6/FP4), got {grad!r}"
            )

    def _check_delayed(self) -> None:
        if self.granularity != "tensor":
            shown = "None (= 'block')" if self.granularity is None else repr(self.granularity)
            raise ValueError(
                f"scaling 'delayed' keeps one amax history per tensor and needs per-tensor "
                f'scales, got granularity {shown}; set "granularity": "tensor" (or "scaling": '
                '"current")'
            )
        if self.amax_history_len is not None:
            check_positive_int(self.amax_history_len, "amax_history_len")
        if self.amax_compute_algo is not None:
            check_choice(self.amax_compute_algo, AMAX_ALGOS, "amax_compute_algo")
        if self.margin is not None:
            check_nonnegative_int(self.margin, "margin")
        self._refuse_with_delayed()

    def _refuse_with_delayed(self) -> None:
        for name in ("stochastic_rounding", "hadamard"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} applies to current scaling; delayed scaling rounds with one tensor "
                    f'scale per step (remove {name} or use "scaling": "current")'
                )

    def _refuse_delayed_only(self) -> None:
        for name in ("amax_history_len", "amax_compute_algo", "margin"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} applies only to delayed scaling (scaling is {self.scaling!r}); "
                    f'add "scaling": "delayed" and "granularity": "tensor", or remove {name}'
                )

    @property
    def delayed(self) -> DelayedRecipe | None:
        """The delayed-scaling settings with defaults filled in; ``None`` for current scaling."""
        if self.scaling != "delayed":
            return None
        d = DelayedRecipe()
        return DelayedRecipe(
            d.amax_history_len if self.amax_history_len is None else self.amax_history_len,
            d.amax_compute_algo if self.amax_compute_algo is None else self.amax_compute_algo,
            d.margin if self.margin is None else self.margin,
        )


@dataclass(frozen=True)
class LinearQuantSpec:
    """The resolved quantization of one path: what :class:`Fp8LinearFn` applies."""

    x_format: FloatFormat
    """Format of ``x`` (forward and wgrad) and of ``W`` (forward and dgrad)."""
    grad_format: FloatFormat
    """Format of ``dy`` (dgrad and wgrad)."""
    granularity: str
    """tensor, row, block, none, nvfp4 or mxfp4."""
    block: int = 128
    """Tile length along the reduction dimension."""
    delayed: DelayedRecipe | None = None
    """Delayed scaling's settings (per tensor); ``None``: current scaling."""
    weight_2d: bool = True
    """W in block x block tiles (else 1 x block along each GEMM's reduction dimension)."""
    stochastic: bool = False
    """``dy`` rounded stochastically (seeded per call: :meth:`Fp8Call.seed_of`)."""
    hadamard: bool = False
    """The wgrad GEMM's inputs rotated along the tokens before they are quantized."""
    seed: int = 0
    """The path's stochastic-rounding seed option."""

    @classmethod
    def from_options(cls, options: Fp8Options) -> LinearQuantSpec:
        """Fill the ``None`` defaults of ``options`` (NVIDIA's NVFP4 choices for nvfp4)."""
        granularity = options.resolved_granularity
        nvfp4 = granularity == "nvfp4"
        fixed = {"nvfp4": NVFP4_BLOCK[1], "mxfp4": MXFP4_BLOCK[1]}.get(granularity)
        return cls(
            FORMATS[options.format],
            FORMATS[options.grad_format or options.format],
            granularity,
            fixed or options.block or 128,
            options.delayed,
            granularity != "mxfp4" if options.weight_2d is None else options.weight_2d,
            nvfp4 if options.stochastic_rounding is None else options.stochastic_rounding,
            nvfp4 if options.hadamard is None else options.hadamard,
            options.seed,
        )

    @property
    def is_identity(self) -> bool:
        """True when nothing is rounded: the path is plain ``F.linear``."""
        return self.x_format.is_identity and self.grad_format.is_identity

    def _granularity_of(self, fmt: FloatFormat) -> str:
        """The FP4 granularities quantize e2m1; an unscaled format beside it is a plain cast."""
        return "none" if self.granularity in BLOCK_SCALED and not fmt.scaled else self.granularity

    def act(
        self, x: torch.Tensor, fmt: FloatFormat, dim: int, seed: int | None = None
    ) -> torch.Tensor:
        """``Q(x)`` of an activation or gradient: 1 x block tiles along ``dim``; rounded
        stochastically with ``seed`` when one is given (``dy`` of a stochastic spec)."""
        return quantize_dequantize(
            x,
            fmt,
            self._granularity_of(fmt),
            block=(1, self.block),
            dim=dim,
            rounding="nearest" if seed is None else "stochastic",
            seed=seed,
        )

    def weight(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """``Q(W)``: block x block tiles (or 1 x block along ``dim``), rows along ``dim``."""
        tile = (self.block if self.weight_2d else 1, self.block)
        granularity = self._granularity_of(self.x_format)
        return quantize_dequantize(w, self.x_format, granularity, block=tile, dim=dim)

    @property
    def weight_transposable(self) -> bool:
        """Whether ``Q_K(W) == Q_N(W)`` (the same tiles whichever dim they run along)."""
        return self.granularity != "row" and self.weight_2d

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """A wgrad input (flat ``[M, .]``) rotated along M when the spec says so (else ``t``)."""
        return hadamard_rotate(t, dim=0) if self.hadamard else t


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 accumulation, float64 when an input is float64 (gradcheck)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


@dataclass(frozen=True)
class Fp8Call:
    """What one call of :func:`fp8_linear` quantizes with, besides its operands."""

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

    def seed_of(self, gemm: int) -> int | None:
        """The seed of ``dy``'s quantization in GEMM ``gemm`` (0 dgrad, 1 wgrad), or ``None``
        when the spec rounds to nearest."""
        return sr_seed(self.seed, gemm) if self.spec.stochastic else None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as :attr:`spec`
        says (a :data:`~gnmr_dist.backends.base.Gemm`)."""
        return Fp8LinearFn.apply(x, weight, bias, self)  # type: ignore[no-untyped-call,no-any-return]


class Fp8LinearFn(torch.autograd.Function):
    """``y = Q(x) Q(W)^T + b`` with quantized dgrad and wgrad (``fp8_emulated``'s docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: Fp8Call
    ) -> torch.Tensor:
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
        y = xq.to(acc).mm(wq.t())
        if bias is not None:
            y = y + bias.to(acc)
        w_saved = wq if spec.weight_transposable else weight
        ctx.save_for_backward(x, w_saved)
        ctx.call, ctx.acc, ctx.has_bias = call, acc, bias is not None
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_saved = ctx.saved_tensors
        call: Fp8Call = ctx.call
        spec, acc = call.spec, ctx.acc
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        delayed = _delayed_dy(ctx, dy2)  # None: current scaling, per GEMM below
        if ctx.needs_input_grad[0]:
            wq = w_saved if spec.weight_transposable else spec.weight(w_saved, dim=0)
            dyq = delayed
            if dyq is None:
                dyq = spec.act(dy2, spec.grad_format, dim=-1, seed=call.seed_of(0))
            dx = dyq.to(acc).mm(wq.to(acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            xr, dyr = spec.rotate(x.reshape(-1, x.shape[-1])), spec.rotate(dy2)
            dyq_m = delayed
            if dyq_m is None:
                dyq_m = spec.act(dyr, spec.grad_format, dim=0, seed=call.seed_of(1))
            dyq_m, xq_m = dyq_m.to(acc), _wgrad_x(ctx, xr).to(acc)
            dw = dyq_m.t().mm(xq_m).to(ctx.w_dtype)
            if call.probe is not None:
                _record_wgrad_error(call.probe, spec, xr, dyr, xq_m, dyq_m, acc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(acc).sum(dim=0).to(ctx.b_dtype)
        return dx, dw, db, None


def _delayed_dy(ctx: Any, dy2: torch.Tensor) -> torch.Tensor | None:
    """``Q(dy)`` at this step's delayed scale (both GEMMs: one tensor scale), recorded once;
    ``None`` under current scaling or when no input needs a gradient."""
    call: Fp8Call = ctx.call
    if call.scales is None or not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None
    return call.scales.dy.quantize(dy2, record=call.record)[0]


def _wgrad_x(ctx: Any, x2: torch.Tensor) -> torch.Tensor:
    """``Q_M(x)`` for wgrad: the spec's tiles along M, or the forward's own delayed scale."""
    spec: LinearQuantSpec = ctx.call.spec
    if ctx.call.scales is None:
        return spec.act(x2, spec.x_format, dim=0)
    return quantize_dequantize_scaled(x2, spec.x_format, ctx.x_scale)


@dataclass
class InputNorms:
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
class Fp8Probe(GemmProbe):
    """A :class:`GemmProbe` whose ``x`` norms are shared with the GEMMs of the same input."""

    shared: InputNorms = field(default_factory=InputNorms)

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
    x2: torch.Tensor,
    dy2: torch.Tensor,
    xq_m: torch.Tensor,
    dyq_m: torch.Tensor,
    acc: torch.dtype,
) -> None:
    """``||dy|| ||x - Q_M(x)|| + ||Q_M(dy) - dy|| ||x||`` of one wgrad GEMM, from its operands
    (``x2``, ``dy2`` flat and, with the Hadamard transform, rotated: the rotation keeps the
    norms and the product, so the bound holds for the rotated operands as for the originals)."""
    assert isinstance(probe, Fp8Probe)
    if not probe.shared.done:  # projections of one input share its norms: cast it once
        probe.shared.fill(spec, x2.to(acc), xq_m)
    probe.record_dy(spec, dy2.to(acc), dyq_m)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: LinearQuantSpec
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as ``spec`` says:
    :class:`Fp8Call` with nothing measured and current scaling (the backend's calls add a probe
    and delayed scales)."""
    return Fp8Call(spec)(x, weight, bias)
