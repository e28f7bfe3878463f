"""The shadow error route: the damage term's ``B(u)`` from the operands a unit's GEMMs read.

A backend whose GEMMs are its own measures ``B(u)`` inside them (:mod:`~gnmr_dist.backends.
error_sums`). One that runs someone else's fused kernels (``te_fp8``: Transformer Engine never
hands out its quantized tensors) cannot; the *shadow route* measures from outside. On a
measuring step (``gnmr.error_every``) it takes each GEMM call's input (a ``LayerNormLinear``'s
normalised input) and output gradient (in a hook registered only then), quantizes the two wgrad
operands along the tokens as the low-cost recipe does, and adds the bound every backend adds:

    ||dy||_F ||x - Q(x)||_F  +  ||Q(dy) - dy||_F ||x||_F

Recipes: :class:`ShadowRecipe`, Transformer Engine's (``delayed``, ``tensorwise``,
``blockwise``, ``mxfp8``, ``nvfp4``) in TE's arithmetic (:mod:`~gnmr_dist.backends.numerics.
te_casts`); :class:`SpecRecipe`, ``fp8_emulated``'s, whose sums the route reproduces bit for bit
(the tested maths). :func:`quantize_wgrad_operands` and :func:`wgrad_bound` work on plain
tensors (a GPU check compares them with TE's quantizers); :class:`ShadowRoute` attaches them to
forwards. Per measured GEMM: one cast of ``x`` (shared by projections of one input when the
recipe has no per-module scale) and of ``dy``, four norms; no GEMM, no host sync; the sums ride
the norms' all-reduce. ``docs/backends.md#the-shadow-route``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gnmr_dist.backends.emulated_options import LinearQuantSpec
from gnmr_dist.backends.emulated_scaling import amax_of, scale_of
from gnmr_dist.backends.error_sums import ErrorSums, GemmProbe
from gnmr_dist.backends.numerics import te_casts
from gnmr_dist.backends.numerics.formats import FORMATS
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled
from gnmr_dist.core.validation import check_choice

__all__ = [
    "SHADOW_RECIPES",
    "ShadowRecipe",
    "ShadowRoute",
    "SpecRecipe",
    "WgradOperands",
    "WgradQuantizer",
    "quantize_wgrad_operands",
    "wgrad_bound",
]

SHADOW_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")
"""Transformer Engine's recipes the shadow route reproduces (megatron's names)."""

_PER_TENSOR = ("delayed", "tensorwise")

ScaleSource = Tensor | Callable[[], Tensor] | None
"""A per-tensor scale or amax: a tensor, a function read when it is needed (a ``dy`` scale is
read in the backward), or ``None`` (computed from the tensor itself)."""


def _value(source: ScaleSource) -> Tensor | None:
    return source() if callable(source) else source


@dataclass(frozen=True)
class WgradOperands:
    """One wgrad GEMM's two operands, high precision and quantized, as the GEMM reads them."""

    x: Tensor
    """fp32 ``x`` flattened to ``[tokens, K]`` (rotated along the tokens by TE's Hadamard
    transform under ``nvfp4``, zero-padded to a multiple of 16 tokens)."""
    qx: Tensor | None
    """fp32 ``Q(x)``, same layout (``None``: a :class:`SpecRecipe` that keeps ``x``)."""
    dy: Tensor
    """fp32 ``dy``, as ``x``."""
    qdy: Tensor | None
    """fp32 ``Q(dy)``, same layout (``None``: not rounded)."""
    x_cast: te_casts.Cast | None = None
    """TE's quantized ``x`` for a :class:`ShadowRecipe` (``None`` otherwise), ``[tokens, K]``:
    TE's columnwise data and ``scale_inv`` of the block recipes are their transposes."""
    dy_cast: te_casts.Cast | None = None
    """The same for ``dy``."""


class WgradQuantizer(Protocol):
    """How a low-cost path quantizes the two operands of its wgrad GEMM."""

    def quantize_x(self, x2: Tensor, scale: ScaleSource, amax: ScaleSource) -> _Side:
        """``x`` (2-D ``[tokens, K]``) -> the operand and its quantization."""
        ...

    def quantize_dy(
        self, dy2: Tensor, scale: ScaleSource, amax: ScaleSource, seed: int | None
    ) -> _Side:
        """``dy`` (2-D ``[tokens, N]``) -> the operand and its quantization."""
        ...

    @property
    def shares_x(self) -> bool:
        """Whether GEMMs reading the same ``x`` share its quantization (no per-module scale)."""
        ...

    @property
    def stochastic(self) -> bool:
        """Whether ``dy`` is rounded stochastically (needs a seed per call)."""
        ...

    @property
    def rounds(self) -> tuple[bool, bool]:
        """Whether ``x`` and ``dy`` are rounded at all (a term whose factor is not is dropped)."""
        ...


@dataclass(frozen=True)
class _Side:
    """One operand: high precision, its quantization, and TE's cast when there is one."""

    t: Tensor
    q: Tensor | None
    """``None``: the path does not round this operand (its term is dropped)."""
    cast: te_casts.Cast | None = None


@dataclass(frozen=True)
class ShadowRecipe:
    """A Transformer Engine recipe's quantization of the wgrad operands (TE's arithmetic).

    ``ShadowRecipe.of("tensorwise", fp8_format="hybrid")`` for the recipe as ``te_fp8`` builds it;
    ``te_fp8`` reads the fields from the TE recipe object it runs
    (:func:`gnmr_dist.backends.te_shadow.shadow_recipe`).
    """

    name: str
    """``delayed``, ``tensorwise``, ``blockwise``, ``mxfp8`` or ``nvfp4``."""
    x_format: str = "e4m3"
    """The forward format (``x``): e4m3 (NVFP4: e2m1)."""
    grad_format: str = "e5m2"
    """The gradient format (``dy``): e5m2 under TE's ``HYBRID``, e4m3 under ``E4M3``."""
    pow2: bool = False
    """Power-of-two scales (``QParams.power_2_scale``: blockwise's default; tensorwise's
    ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``)."""
    eps: float = 0.0
    """``QParams.amax_epsilon``: the floor under an amax."""
    hadamard: bool = True
    """``nvfp4``: the random Hadamard transform of both wgrad operands."""
    stochastic_rounding: bool = True
    """``nvfp4``: ``dy`` rounded stochastically."""
    margin: int = 0
    """``delayed``: ``DelayedScaling.margin``, used only when no scale is given (the scale of
    the tensor's own amax, ``max / 2^margin / amax``: what a fresh history converges to)."""

    def __post_init__(self) -> None:
        check_choice(self.name, SHADOW_RECIPES, "recipe")
        check_choice(self.grad_format, ("e4m3", "e5m2"), "grad_format")
        if self.name == "nvfp4" and self.x_format != "e2m1":
            object.__setattr__(self, "x_format", "e2m1")

    @classmethod
    def of(cls, name: str, fp8_format: str = "hybrid", **fields: Any) -> ShadowRecipe:
        """The recipe ``te_fp8`` builds for ``name`` with TE's defaults (``fp8_format``:
        ``"hybrid"`` or ``"e4m3"``)."""
        grad = "e5m2" if fp8_format == "hybrid" else "e4m3"
        if name == "nvfp4":
            grad = "e4m3"  # unused: NVFP4 quantizes dy to e2m1
        defaults: dict[str, Any] = {"pow2": name == "blockwise", "grad_format": grad}
        return cls(name, **(defaults | fields))

    @property
    def shares_x(self) -> bool:
        return self.name != "delayed"  # delayed: each module's own scale

    @property
    def stochastic(self) -> bool:
        return self.name == "nvfp4" and self.stochastic_rounding

    @property
    def rounds(self) -> tuple[bool, bool]:
        return True, True

    def quantize_x(self, x2: Tensor, scale: ScaleSource, amax: ScaleSource) -> _Side:
        return self._side(x2, self.x_format, scale, amax, None)

    def quantize_dy(
        self, dy2: Tensor, scale: ScaleSource, amax: ScaleSource, seed: int | None
    ) -> _Side:
        return self._side(dy2, self.grad_format, scale, amax, seed if self.stochastic else None)

    def _side(
        self, t: Tensor, fmt: str, scale: ScaleSource, amax: ScaleSource, seed: int | None
    ) -> _Side:
        if self.name in _PER_TENSOR:
            cast = te_casts.cast_tensor(t, fmt, self._tensor_scale(t, fmt, scale, amax))
            return _Side(t.float(), cast.dequantized, cast)
        # the columnwise layout, quantized along the tokens, kept as [tokens, features]
        if self.name == "blockwise":
            cast = te_casts.cast_blocks(t, fmt, (128, 1), pow2=self.pow2, eps=self.eps)
        elif self.name == "mxfp8":
            cast = te_casts.cast_mxfp8(t, fmt, columnwise=True)
        else:
            if self.hadamard:  # TE needs a multiple of 16 tokens; zero rows change nothing
                t = te_casts.te_rht(F.pad(t, (0, 0, 0, (-t.shape[0]) % 16)), columnwise=True)
            rounding = "nearest" if seed is None else "stochastic"
            cast = te_casts.cast_nvfp4(
                t, amax=_value(amax), rounding=rounding, seed=seed, columnwise=True
            )
        return _Side(t.float(), cast.dequantized, cast)

    def _tensor_scale(self, t: Tensor, fmt: str, scale: ScaleSource, amax: ScaleSource) -> Tensor:
        """The per-tensor scale: given (delayed scaling's), or from the amax (current)."""
        given = _value(scale)
        if given is not None:
            return given.float().reshape(())
        a = _value(amax)
        a = t.detach().abs().amax().float() if a is None else a.float().reshape(())
        max_value = FORMATS[fmt].max_value
        if self.name == "delayed":  # TE's update: scaled_max / amax (fp32 max for inf)
            return te_casts.scale_from_amax(a, max_value / 2.0**self.margin)
        return te_casts.scale_from_amax(a, max_value, pow2=self.pow2, eps=self.eps)


@dataclass(frozen=True)
class SpecRecipe:
    """``fp8_emulated``'s low-cost quantization of the wgrad operands (its tiles along the
    tokens, its Hadamard transform and stochastic rounding); under delayed scaling the caller
    passes the two scales of the call, and without them each tensor is scaled by its own amax
    and the margin (an empty history's scale). The same operations, in the same layout, as
    :class:`~gnmr_dist.backends.emulated_linear.EmulatedLinearFn`'s wgrad GEMM."""

    spec: LinearQuantSpec

    @property
    def shares_x(self) -> bool:
        return self.spec.delayed is None

    @property
    def stochastic(self) -> bool:
        return self.spec.stochastic

    @property
    def rounds(self) -> tuple[bool, bool]:
        return not self.spec.x_format.is_identity, not self.spec.grad_format.is_identity

    def quantize_x(self, x2: Tensor, scale: ScaleSource, amax: ScaleSource) -> _Side:
        del amax
        return self._side(x2, self.spec.x_format, scale, None)

    def quantize_dy(
        self, dy2: Tensor, scale: ScaleSource, amax: ScaleSource, seed: int | None
    ) -> _Side:
        del amax
        return self._side(dy2, self.spec.grad_format, scale, seed if self.spec.stochastic else None)

    def _side(self, t2: Tensor, fmt: Any, scale: ScaleSource, seed: int | None) -> _Side:
        """One operand as the GEMM sees it: rotated, then quantized in ``fmt`` with the delayed
        scale when one is given, else the spec's own (``seed``: stochastic rounding of ``dy``)."""
        spec = self.spec
        tr = spec.rotate(t2)
        acc = _acc(tr)
        if fmt.is_identity:
            return _Side(tr.to(acc), None)
        given = self._delayed_scale(tr, fmt, scale)
        if given is not None:
            q = quantize_dequantize_scaled(tr, fmt, given)
        else:
            q = spec.act(tr, fmt, dim=0, seed=seed)
        return _Side(tr.to(acc), q.to(acc))

    def _delayed_scale(self, t: Tensor, fmt: Any, scale: ScaleSource) -> Tensor | None:
        """The given scale, or under delayed scaling that of ``t``'s own amax and the margin."""
        given = _value(scale)
        delayed = self.spec.delayed
        if given is None and delayed is not None:
            return scale_of(amax_of(t), fmt, delayed.margin)
        return given


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _flat(t: Tensor) -> Tensor:
    return t.detach().reshape(-1, t.shape[-1])


def quantize_wgrad_operands(
    x: Tensor,
    dy: Tensor,
    recipe: ShadowRecipe | SpecRecipe,
    *,
    x_scale: Tensor | None = None,
    dy_scale: Tensor | None = None,
    x_amax: Tensor | None = None,
    dy_amax: Tensor | None = None,
    seed: int | None = None,
) -> WgradOperands:
    """The wgrad GEMM's operands of one linear call, as ``recipe`` quantizes them.

    Args:
        x: the GEMM's input ``[..., K]`` (a ``LayerNormLinear``'s normalised input), any dtype.
        dy: the output gradient ``[..., N]``, the same leading dims.
        recipe: a :class:`ShadowRecipe` (TE's arithmetic) or a :class:`SpecRecipe`.
        x_scale, dy_scale: per-tensor scales TE used (``delayed``: the module's
            ``fp8_meta["scaling_fwd"].scale[0]`` and ``fp8_meta["scaling_bwd"].scale[0]``);
            ``None``: from the tensor's amax (current scaling; ``delayed``: with its margin).
        x_amax, dy_amax: a per-tensor amax to use instead of the tensor's own (TE's amax reduced
            over the tensor-parallel group under sequence parallelism; ``nvfp4``'s tensor amax).
        seed: stochastic rounding's seed for ``dy`` (``nvfp4``; ignored otherwise).

    No host sync: everything stays on the tensors' device.
    """
    xs = recipe.quantize_x(_flat(x), x_scale, x_amax)
    ds = recipe.quantize_dy(_flat(dy), dy_scale, dy_amax, seed)
    return WgradOperands(xs.t, xs.q, ds.t, ds.q, xs.cast, ds.cast)


def _x_norms(side: _Side, want_norm: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(||x - Q(x)||, ||x||)`` in one fused call; ``None`` for a norm no term needs."""
    err = [] if side.q is None else [side.q - side.t]
    norms = torch._foreach_norm([*err, side.t] if want_norm else err)
    return (norms[0] if err else None), (norms[-1] if want_norm else None)


def _dy_norms(side: _Side) -> tuple[Tensor, Tensor | None]:
    """``(||dy||, ||Q(dy) - dy||)``; the second ``None`` when ``dy`` is not rounded."""
    if side.q is None:
        return torch.linalg.vector_norm(side.t), None
    dy_norm, dy_err = torch._foreach_norm([side.t, side.q - side.t])
    return dy_norm, dy_err


def wgrad_bound(ops: WgradOperands) -> Tensor:
    """0-dim ``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` of one wgrad GEMM (float64)."""
    x_err, x_norm = _x_norms(_Side(ops.x, ops.qx), want_norm=True)
    dy_norm, dy_err = _dy_norms(_Side(ops.dy, ops.qdy))
    assert x_err is not None and x_norm is not None and dy_err is not None
    return dy_norm.double() * x_err.double() + dy_err.double() * x_norm.double()


class ShadowRoute:
    """Attaches the route to forwards: :meth:`measure` is called with one GEMM call's input and
    output; it takes the ``x`` norms now and the ``dy`` norms in a hook on the output's gradient
    (registered only then), and adds the bound to ``B(unit)`` of ``sink``.

    GEMMs reading the same input tensor (q/k/v, gate/up) share its ``x`` norms when the recipe
    allows (no per-module scale): one slot keyed on the tensor's identity and version.
    """

    def __init__(self, recipe: WgradQuantizer) -> None:
        self.recipe = recipe
        self._last: tuple[Any, int, tuple[Tensor | None, Tensor | None] | None] = (None, 0, None)

    def measure(
        self,
        sink: ErrorSums,
        unit: int,
        x: Tensor,
        y: Tensor,
        *,
        x_scale: ScaleSource = None,
        dy_scale: ScaleSource = None,
        x_amax: ScaleSource = None,
        dy_amax: ScaleSource = None,
        seed: int | None = None,
    ) -> None:
        """Measure one GEMM call of ``unit``: ``x`` its input (``[..., K]``), ``y`` its output
        (``[..., N]``, in the graph). ``dy_scale`` / ``dy_amax`` may be functions, called in
        the backward hook (delayed scaling's backward scale is read when ``dy`` arrives)."""
        if not y.requires_grad:
            return
        x_err, x_norm = self._x_norms(x, x_scale, x_amax)
        probe = GemmProbe(sink, unit, x_err, x_norm)
        recipe = self.recipe

        def hook(dy: Tensor) -> None:
            side = recipe.quantize_dy(_flat(dy), dy_scale, dy_amax, seed)
            dy_norm, dy_err = _dy_norms(side)
            probe.record(dy_norm, dy_err)

        y.register_hook(hook)  # type: ignore[no-untyped-call]

    def _x_norms(
        self, x: Tensor, scale: ScaleSource, amax: ScaleSource
    ) -> tuple[Tensor | None, Tensor | None]:
        shared = self.recipe.shares_x and scale is None and amax is None
        if shared:
            ref, version, norms = self._last
            if norms is not None and ref is not None and ref() is x and version == x._version:
                return norms
        norms = _x_norms(self.recipe.quantize_x(_flat(x), scale, amax), self.recipe.rounds[1])
        if shared:
            self._last = (weakref.ref(x), x._version, norms)
        return norms
