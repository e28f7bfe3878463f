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
    scaling      "current" (default: each call scales by its own tensor's amax) | "delayed"
                 (Transformer Engine's recipe, below; needs "granularity": "tensor")
    amax_history_len   delayed only: steps of amax history H, int >= 1 (default 16; TE's
                       ``DelayedScaling`` default is 1024, set it to match TE)
    amax_compute_algo  delayed only: "max" over the history (default, as TE) | "most_recent"
    margin             delayed only: binades of headroom, int >= 0 (default 0, as TE)

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

Delayed scaling (``"scaling": "delayed"``, TE's ``DelayedScaling``)
-------------------------------------------------------------------
Current scaling divides every tensor by its own ``amax / max_value``. Transformer Engine's
default recipe on Hopper scales by the past instead: every operator keeps, per GEMM input
(``x``, ``W``, ``dy``) and per path, the amaxes of its last ``H = amax_history_len`` steps, and
step t quantizes with

    a_t     = max(amax_{t-H}, ..., amax_{t-1})     ("max")   or   amax_{t-1}   ("most_recent")
    scale_t = a_t * 2^margin / max_value           (TE's scale is the inverse, fp8_max/a_t/2^m)
    Q(x)    = clamp(round(x / scale_t), +-max_value) * scale_t

(:func:`~gnmr_dist.backends.numerics.quantize_dequantize_scaled`). ``amax_t = max|x|`` over the
step's calls joins the history when the next step's plan is applied. So a spike
(``amax_t >> a_t``) saturates at ``+-max_value * scale_t`` until it is in the history, and once
it is, its amax keeps the scale too large for up to H steps ("max"): small values fall into the
subnormals or flush to zero until the spike leaves the window. Per-tensor scales only: one
history per tensor (``"granularity": "tensor"``, refused otherwise).

Choices, where TE leaves room:

* One history entry per optimizer step (:meth:`Fp8EmulatedBackend.apply`), the max over the
  step's calls. All forwards of a step (micro-batches, activation recomputation) read one scale
  as they read one plan, so a recomputed forward reproduces the first bit for bit and adds
  nothing new. TE pushes one entry per autocast region, one micro-batch in Megatron: the same
  with one micro-batch per step. Forwards under ``no_grad`` (evaluation) count too;
  run them inside :meth:`Fp8EmulatedBackend.measuring` to keep them out.
* An empty history (first step, after a reset) scales each call by its own amax (current
  scaling, margin included). TE starts from scale 1 and its first amax sets the second step's
  scale; from the second step on the two agree, without TE's unscaled first step.
* A unit whose plan returns it to the low-cost path resets its low-cost histories (DESIGN.md:
  a stale history must not overflow the first step back); one that enters the recovery path
  resets the recovery path's (when that path is delayed too). While a unit runs recovery its
  low-cost histories are frozen: the shadow error measurement quantizes with their scale but
  records nothing.
* Inside :meth:`Fp8EmulatedBackend.measuring` (the recovery-gap probe's passes) histories are
  read, never recorded, committed or reset, so a probe does not change the training run. A
  unit that a pass puts on another path than the training plan's quantizes there as it would
  on entering that path: with an empty stand-in history (each call by its own amax), not with
  the history it left (frozen while it runs recovery, reset before it is used again). So the
  probe's low-cost gap of a recovered unit is the gap of its return, which is also what its
  shadow error score measures.
* A scale that is 0 or not finite (all-zero tensor, inf in the history) falls back to 1 (TE
  keeps its previous scale).
* Not checkpointed: the backend has no ``state_dict``, so a restarted run re-seeds every
  history from the current amax, as on a return from recovery.

Cost: per GEMM input one amax (as per-tensor current scaling) and one ``maximum``; per history
and step one reduction over H values (cached for the step) and, at ``apply``, one fused copy of
all the step's amaxes; H floats per history on the parameter's device. No host sync: amaxes and
scales stay tensors, positions and counts are Python integers.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    quantize_dequantize_scaled,
)
from gnmr_dist.backends.options import parse_options
from gnmr_dist.core.validation import check_choice, check_nonnegative_int, check_positive_int

__all__ = [
    "AmaxHistory",
    "DelayedRecipe",
    "DelayedScales",
    "Fp8EmulatedBackend",
    "Fp8LinearFn",
    "Fp8Options",
    "LinearQuantSpec",
    "fp8_linear",
]

logger = logging.getLogger(__name__)

SCALINGS = ("current", "delayed")
"""``"current"``: each call's own amax; ``"delayed"``: the amax history of earlier steps."""

AMAX_ALGOS = ("max", "most_recent")
"""How delayed scaling reads its history (TE's ``amax_compute_algo``)."""


@dataclass(frozen=True)
class DelayedRecipe:
    """Delayed scaling's settings, named as TE's ``DelayedScaling`` fields."""

    amax_history_len: int = 16
    """Steps of amax history H (TE's default: 1024)."""
    amax_compute_algo: str = "max"
    """``"max"`` over the history or its ``"most_recent"`` entry (TE's default: max)."""
    margin: int = 0
    """``scale = a * 2^margin / max_value``: ``margin`` binades of headroom (TE's default: 0)."""


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
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block must be an integer >= 1, got {b!r}")
        check_choice(self.scaling, SCALINGS, "scaling")
        if self.scaling == "delayed":
            self._check_delayed()
        else:
            self._refuse_delayed_only()

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
    """tensor, row, block or none."""
    block: int = 128
    """Tile length along the reduction dimension."""
    delayed: DelayedRecipe | None = None
    """Delayed scaling's settings (per tensor); ``None``: current scaling."""

    @classmethod
    def from_options(cls, options: Fp8Options) -> LinearQuantSpec:
        """Fill the ``None`` defaults of ``options``."""
        fmt = FORMATS[options.format]
        grad = FORMATS[options.grad_format or options.format]
        granularity = options.granularity or ("block" if fmt.scaled or grad.scaled else "none")
        return cls(fmt, grad, granularity, options.block, options.delayed)

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


def _scale_of(amax: torch.Tensor, fmt: FloatFormat, margin: int) -> torch.Tensor:
    """``amax * 2^margin / max_value`` (0-dim fp32), 1 where that is 0 or not finite.

    Divided first, as :func:`~gnmr_dist.backends.numerics.quantize_dequantize` does, so an empty
    history's scale equals current per-tensor scaling's bit for bit (``2^margin`` is exact).
    """
    scale = amax / fmt.max_value
    if margin:
        scale = scale * 2.0**margin
    return torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


class AmaxHistory:
    """Delayed scaling of one GEMM input (one of x / W / dy of one operator on one path).

    A ring of the last H steps' amaxes (``[H]`` fp32 on the input's device, made at the first
    commit); :meth:`quantize` reads it, :meth:`commit` adds the finished step's amax (module
    docstring, "Delayed scaling").
    """

    def __init__(self, fmt: FloatFormat, recipe: DelayedRecipe) -> None:
        self.fmt, self.recipe = fmt, recipe
        self.history: torch.Tensor | None = None
        """The ring buffer; entries ``[0, filled)`` are valid until it wraps."""
        self.filled = 0
        """Steps committed since the last reset, at most H (0: empty, use the call's amax)."""
        self.step_amax: torch.Tensor | None = None
        """Max ``|x|`` of this step's recorded calls, not yet committed (``None``: none ran)."""
        self._pos = 0
        self._scale: torch.Tensor | None = None  # this step's scale: the history is constant

    def quantize(self, t: torch.Tensor, *, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q(t), scale)`` with this step's delayed scale; ``record`` folds ``amax(t)`` into
        :attr:`step_amax`. An ``fp32`` input is returned as it is (its scale is 1)."""
        if self.fmt.is_identity:
            return t, torch.ones((), device=t.device)
        amax = _amax(t) if record or self.filled == 0 else None
        scale = self.scale(amax)
        if record:
            assert amax is not None
            step = self.step_amax
            self.step_amax = amax if step is None else torch.maximum(step, amax)
        return quantize_dequantize_scaled(t, self.fmt, scale), scale

    def scale(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """This step's 0-dim scale: from the history, or from ``amax`` while it is empty."""
        if self.filled == 0:
            if amax is None:
                raise ValueError("an empty amax history needs the current amax to scale by")
            return _scale_of(amax, self.fmt, self.recipe.margin)
        if self._scale is None:
            self._scale = _scale_of(self._history_amax(), self.fmt, self.recipe.margin)
        return self._scale

    def _history_amax(self) -> torch.Tensor:
        """``a_t``: the max of the valid entries, or the most recent one."""
        assert self.history is not None
        if self.recipe.amax_compute_algo == "most_recent":
            return self.history[(self._pos - 1) % self.recipe.amax_history_len]
        return self.history[: self.filled].amax()

    def finite_step_amax(self) -> torch.Tensor:
        """:attr:`step_amax`, or where it is not finite the history's amax (0 when empty)."""
        assert self.step_amax is not None
        kept = self._history_amax() if self.filled else torch.zeros_like(self.step_amax)
        return torch.where(torch.isfinite(self.step_amax), self.step_amax, kept)

    def drop_step(self) -> None:
        """Forget this step's recorded amaxes (a step that is run again, or evaluation)."""
        self.step_amax = None

    def next_slot(self) -> torch.Tensor:
        """The 0-dim view :meth:`commit` writes :attr:`step_amax` into (history made here)."""
        assert self.step_amax is not None
        if self.history is None:
            h = self.recipe.amax_history_len
            self.history = torch.zeros(h, dtype=torch.float32, device=self.step_amax.device)
        return self.history[self._pos]

    def advance(self) -> None:
        """After :attr:`step_amax` was written into :meth:`next_slot`: a new step begins."""
        self._pos = (self._pos + 1) % self.recipe.amax_history_len
        self.filled = min(self.filled + 1, self.recipe.amax_history_len)
        self.step_amax, self._scale = None, None

    def commit(self) -> None:
        """Add this step's amax to the history (nothing when no call was recorded)."""
        commit_all([self])

    def reset(self) -> None:
        """Forget everything: the next call scales by its own amax."""
        self.filled, self._pos, self.step_amax, self._scale = 0, 0, None, None


def _amax(t: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 ``max |t|`` (0 for an empty tensor), on ``t``'s device."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def commit_all(histories: Iterable[AmaxHistory]) -> None:
    """:meth:`AmaxHistory.commit` of many histories with one fused copy.

    A non-finite step amax (an overflowed step) is replaced by the history's current amax, so
    the scale stays what it was, as TE keeps its previous scale; no host sync decides it.
    """
    ran = [h for h in histories if h.step_amax is not None]
    if not ran:
        return
    amaxes = [h.finite_step_amax() for h in ran]
    torch._foreach_copy_([h.next_slot() for h in ran], amaxes)  # type: ignore[misc]
    for h in ran:
        h.advance()


@dataclass
class DelayedScales:
    """One operator's delayed-scaling state on one path: a history per GEMM input."""

    x: AmaxHistory
    w: AmaxHistory
    dy: AmaxHistory

    @classmethod
    def of(cls, spec: LinearQuantSpec) -> DelayedScales:
        """Empty histories for ``spec`` (a delayed spec)."""
        if spec.delayed is None:
            raise ValueError("DelayedScales.of needs a spec with delayed scaling")
        r = spec.delayed
        x, w, dy = (AmaxHistory(f, r) for f in (spec.x_format, spec.x_format, spec.grad_format))
        return cls(x, w, dy)

    @property
    def histories(self) -> tuple[AmaxHistory, AmaxHistory, AmaxHistory]:
        """``(x, w, dy)``."""
        return self.x, self.w, self.dy

    def reset(self) -> None:
        """Reset the three histories (the next call of each scales by its own amax)."""
        for h in self.histories:
            h.reset()


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
        scales: DelayedScales | None = None,
        record: bool = True,
    ) -> torch.Tensor:
        acc = _acc_dtype(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.x_scale = None
        if scales is None:
            wq = spec.weight(weight, dim=-1).to(acc)
            xq = spec.act(x2, spec.x_format, dim=-1)
        else:  # one tensor scale serves every GEMM: Q_K(x) = Q_M(x), Q_K(W) = Q_N(W)
            wq = scales.w.quantize(weight, record=record)[0].to(acc)
            xq, ctx.x_scale = scales.x.quantize(x2, record=record)
        y = xq.to(acc).mm(wq.t())
        if bias is not None:
            y = y + bias.to(acc)
        w_saved = wq if spec.weight_transposable else weight
        ctx.save_for_backward(x, w_saved)
        ctx.spec, ctx.acc, ctx.has_bias, ctx.probe = spec, acc, bias is not None, probe
        ctx.scales, ctx.record = scales, record
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_saved = ctx.saved_tensors
        spec: LinearQuantSpec = ctx.spec
        acc: torch.dtype = ctx.acc
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        dyq_t = _delayed_dy(ctx, dy2)  # None: current scaling, per GEMM below
        if ctx.needs_input_grad[0]:
            wq = w_saved if spec.weight_transposable else spec.weight(w_saved, dim=0)
            dyq = spec.act(dy2, spec.grad_format, dim=-1) if dyq_t is None else dyq_t
            dx = dyq.to(acc).mm(wq.to(acc)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dyq_m = (spec.act(dy2, spec.grad_format, dim=0) if dyq_t is None else dyq_t).to(acc)
            xq_m = _wgrad_x(ctx, x.reshape(-1, x.shape[-1])).to(acc)
            dw = dyq_m.t().mm(xq_m).to(ctx.w_dtype)
            if ctx.probe is not None:
                _record_wgrad_error(ctx.probe, spec, x, dy2, xq_m, dyq_m, acc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(acc).sum(dim=0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None


def _delayed_dy(ctx: Any, dy2: torch.Tensor) -> torch.Tensor | None:
    """``Q(dy)`` at this step's delayed scale (both GEMMs: one tensor scale), recorded once;
    ``None`` under current scaling or when no input needs a gradient."""
    if ctx.scales is None or not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None
    scales: DelayedScales = ctx.scales
    return scales.dy.quantize(dy2, record=ctx.record)[0]


def _wgrad_x(ctx: Any, x2: torch.Tensor) -> torch.Tensor:
    """``Q_M(x)`` for wgrad: the spec's tiles along M, or the forward's own delayed scale."""
    spec: LinearQuantSpec = ctx.spec
    if ctx.scales is None:
        return spec.act(x2, spec.x_format, dim=0)
    return quantize_dequantize_scaled(x2, spec.x_format, ctx.x_scale)


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
    *,
    scales: DelayedScales | None = None,
    record: bool = True,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs' inputs quantized as ``spec`` says.

    ``probe`` receives the wgrad GEMM's error bound in the backward (module docstring).
    ``scales``: the operator's delayed-scaling histories (``None``: current scaling); with
    ``record`` this call's amaxes of x, W and (in the backward) dy join the step's.
    """
    return Fp8LinearFn.apply(x, weight, bias, spec, probe, scales, record)  # type: ignore[no-untyped-call,no-any-return]


class Fp8EmulatedBackend(PrecisionBackend):
    """Emulated FP8/FP6 GEMMs on the low-cost path, bf16 (or any format) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks of :class:`Fp8Options`; defaults
    ``{"format": "e4m3"}`` (1x128 / 128x128 block scales) and ``{"format": "bf16"}``. A path with
    ``"scaling": "delayed"`` keeps amax histories per operator (module docstring).
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
        self.recovery = parse_options(Fp8Options, recovery, "gnmr.recovery", {"format": "bf16"})
        self.specs = {
            LOW_COST: LinearQuantSpec.from_options(self.low_cost),
            RECOVERY: LinearQuantSpec.from_options(self.recovery),
        }
        self._last_input: tuple[Any, int, _InputNorms] = (None, 0, _InputNorms())
        self._delayed: dict[int, dict[str, DelayedScales]] = {}  # id(operator) -> path -> state
        self._measuring = False
        self._training_plan: frozenset[int] = frozenset()  # the plan measuring() was entered in
        self._stand_ins: dict[tuple[int, str], DelayedScales] = {}  # (id(op), path), measuring

    # ------------------------------------------------------------------ delayed scaling

    def apply(self, active: Iterable[int], step: int) -> None:
        """Commit the finished step's amaxes to the delayed-scaling histories when ``step``
        advances (not inside :meth:`measuring`), then set the plan as
        :meth:`PrecisionBackend.apply` does.

        An ``apply`` that does not advance the step (the same step set again: a step DeepSpeed
        or megatron skipped and runs again, a plan re-applied after evaluation forwards or by
        the recovery-gap probe) drops the amaxes recorded since the last one: only the forwards
        of the step that trains enter the history.
        """
        if not self._measuring:
            histories = [h for d in self._all_delayed() for h in d.histories]
            if step > self._step:
                commit_all(histories)
            else:
                for h in histories:
                    h.drop_step()
        super().apply(active, step)

    def _all_delayed(self) -> Iterator[DelayedScales]:
        for paths in self._delayed.values():
            yield from paths.values()

    def _on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
        """A unit entering a path starts that path's histories afresh (not inside
        :meth:`measuring`): back from recovery, a stale low-cost history must not overflow."""
        if self._measuring:
            self._set_stand_ins(after)
            return
        if not self._delayed:
            return
        entering = [(u, LOW_COST) for u in before - after] + [(u, RECOVERY) for u in after - before]
        reset = 0
        for uid, path in entering:
            for op in self._wrapped.get(uid, ()):
                state = self._delayed.get(id(op), {}).get(path)
                if state is not None:
                    state.reset()
                    reset += 1
        if reset:
            logger.debug("%s: reset the amax histories of %d operators", self.name, reset)

    def _set_stand_ins(self, plan: frozenset[int]) -> None:
        """Inside :meth:`measuring`: an empty history for every (operator, path) that ``plan``
        runs but the training plan does not (what entering the path would start with)."""
        training = self._training_plan
        entering = [(u, LOW_COST) for u in training - plan] + [
            (u, RECOVERY) for u in plan - training
        ]
        want = {
            (id(op), path)
            for uid, path in entering
            if self.specs[path].delayed is not None
            for op in self._wrapped.get(uid, ())
        }
        self._stand_ins = {
            key: self._stand_ins.get(key) or DelayedScales.of(self.specs[key[1]]) for key in want
        }

    def _scales_now(
        self, op: nn.Module, path: str, scales: DelayedScales | None
    ) -> DelayedScales | None:
        """``scales``, or the operator's stand-in history on ``path`` inside :meth:`measuring`."""
        return self._stand_ins.get((id(op), path), scales) if self._measuring else scales

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Histories are read but not recorded, committed or reset inside (probe passes,
        evaluation): what runs inside does not change the training run's scales. A unit moved to
        another path inside uses a stand-in history there (module docstring)."""
        outer, self._measuring = self._measuring, True
        if not outer:
            self._training_plan, self._stand_ins = self._recover, {}
        try:
            yield
        finally:
            self._measuring = outer
            if not outer:
                self._stand_ins = {}

    def delayed_scales(self, op: nn.Module, path: str = LOW_COST) -> DelayedScales | None:
        """The delayed-scaling state of wrapped operator ``op`` on ``path`` (``None``: that path
        uses current scaling)."""
        if self.specs[path].delayed is None:
            return None
        paths = self._delayed.setdefault(id(op), {})
        if path not in paths:
            paths[path] = DelayedScales.of(self.specs[path])
        return paths[path]

    def unwrap(self) -> None:
        """Remove every installed forward and drop the delayed-scaling state."""
        super().unwrap()
        self._delayed.clear()

    # ------------------------------------------------------------------ forwards

    def _gemm_fn(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        spec, low = self.specs[path], self.specs[LOW_COST]
        path_scales, low_scales = self.delayed_scales(op, path), self.delayed_scales(op, LOW_COST)

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            probe, record = None, not self._measuring
            scales = self._scales_now(op, path, path_scales)
            if weight.requires_grad and not low.is_identity:
                probe = self._probe(x)
            if path == LOW_COST and probe is not None:
                return fp8_linear(x, weight, bias, spec, probe, scales=scales, record=record)
            if spec.is_identity:
                y = F.linear(x, weight, bias)
            else:
                y = fp8_linear(x, weight, bias, spec, scales=scales, record=record)
            if probe is not None and y.requires_grad:
                self._shadow(probe, x, y, low_scales)
            return y

        return gemm

    def _probe(self, x: torch.Tensor) -> _Fp8Probe | None:
        """A probe for the running unit, sharing ``x``'s norms with the last GEMM of the same
        ``x`` (one slot keyed on its identity and version, as ``act_quant``'s shared pack)."""
        base = self._error_probe()
        if base is None:
            return None
        if self.specs[LOW_COST].delayed is not None:  # each operator has its own x scale
            return _Fp8Probe(base.sink, base.unit)
        ref, version, shared = self._last_input
        if ref is None or ref() is not x or version != x._version:
            shared = _InputNorms()
            self._last_input = (weakref.ref(x), x._version, shared)
        return _Fp8Probe(base.sink, base.unit, shared=shared)

    def _shadow(
        self, probe: _Fp8Probe, x: torch.Tensor, y: torch.Tensor, low_scales: DelayedScales | None
    ) -> None:
        """Measure the low-cost wgrad error of a recovered GEMM: ``x`` now, ``dy`` in a hook.

        Under delayed scaling both are scaled by their own amax and nothing is recorded: a
        unit returning to the low-cost path starts with a reset history, whose first step
        scales each call by its own amax, so that is what the low-cost path would do now (the
        frozen history of before the recovery would score a path that never runs again).
        """
        low = self.specs[LOW_COST]
        if not probe.shared.done:  # projections of one input share its norms: cast it once
            x2 = x.detach().reshape(-1, x.shape[-1])
            x2 = x2.to(torch.promote_types(x2.dtype, torch.float32))
            probe.shared.fill(low, x2, _low_cost_q(low, low_scales, x2, "x").to(x2.dtype))

        def hook(dy: torch.Tensor) -> None:
            dy2 = dy.reshape(-1, dy.shape[-1])
            dy2 = dy2.to(torch.promote_types(dy2.dtype, torch.float32))
            probe.record_dy(low, dy2, _low_cost_q(low, low_scales, dy2, "dy").to(dy2.dtype))

        y.register_hook(hook)  # type: ignore[no-untyped-call]


def _low_cost_q(
    low: LinearQuantSpec, scales: DelayedScales | None, t: torch.Tensor, role: str
) -> torch.Tensor:
    """The low-cost wgrad quantization ``Q_M`` of ``t`` (role ``"x"`` or ``"dy"``), for the
    shadow measurement: the spec's tiles along M, or, under delayed scaling, the scale of a
    reset history (``t``'s own amax, the margin applied; nothing recorded)."""
    fmt = low.x_format if role == "x" else low.grad_format
    if scales is not None:
        if fmt.is_identity:
            return t
        margin = (scales.x if role == "x" else scales.dy).recipe.margin
        return quantize_dequantize_scaled(t, fmt, _scale_of(_amax(t), fmt, margin))
    return t if fmt.is_identity else low.act(t, fmt, dim=0)
