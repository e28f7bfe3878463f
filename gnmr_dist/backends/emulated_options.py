"""The ``fp8_emulated`` backend's options: one path's block, parsed strictly, and its resolved spec.

:class:`EmulatedOptions` is one ``low_cost`` / ``recovery`` block, :class:`LinearQuantSpec` the
quantization it resolves to (what :mod:`~gnmr_dist.backends.emulated_linear` applies)::

    format       "e4m3" | "e5m2" | "e3m2" | "e2m3" | "e2m1" | "bf16" | "fp16" | "fp32"  (x, W)
    grad_format  same choices or None (= format)                                         (dy)
    granularity  "tensor" | "row" | "block" | "none" | "nvfp4" | "mxfp4" or None
                 (None = "nvfp4" for e2m1, "block" for FP8/FP6, "none" for bf16/fp16/fp32)
    block        tile length along the reduction dimension (default 128; nvfp4 16, mxfp4 32)
    weight_2d    FP4: W in block x block tiles (None = true for nvfp4, false for mxfp4)
    stochastic_rounding  dy rounded stochastically (None = true for nvfp4)
    hadamard     wgrad inputs rotated by the 16 x 16 random Hadamard transform (None = true
                 for nvfp4)
    seed         stochastic rounding's seed option (default 0)
    scaling      "current" (default: each call scales by its own tensor's amax) | "delayed"
                 (Transformer Engine's recipe: :class:`DelayedRecipe`; needs "granularity":
                 "tensor")
    amax_history_len   delayed only: steps of amax history H, int >= 1 (default 16; TE's
                       ``DelayedScaling`` default is 1024, set it to match TE)
    amax_compute_algo  delayed only: "max" over the history (default, as TE) | "most_recent"
    margin             delayed only: binades of headroom, int >= 0 (default 0, as TE)

Defaults: low-cost ``{"format": "e4m3"}`` (DeepSeek-V3's 1 x 128 / 128 x 128 blocks for x, W
and dy), recovery ``{"format": "bf16"}``; ``"format": "e2m1"`` is NVIDIA's NVFP4 recipe. The
recipes and their trade-offs: ``docs/backends.md#fp8_emulated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gnmr_dist.backends.numerics.formats import (
    BLOCK_SCALED,
    FORMATS,
    GRANULARITIES,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
)
from gnmr_dist.backends.numerics.hadamard import hadamard_rotate
from gnmr_dist.backends.numerics.scaled import quantize_dequantize
from gnmr_dist.core.validation import check_choice, check_nonnegative_int, check_positive_int

if TYPE_CHECKING:
    from gnmr_dist.backends.numerics.formats import FloatFormat

__all__ = ["AMAX_ALGOS", "SCALINGS", "DelayedRecipe", "EmulatedOptions", "LinearQuantSpec"]

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
class EmulatedOptions:
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
    """The resolved quantization of one path: what :class:`EmulatedLinearFn` applies."""

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
    """``dy`` rounded stochastically (seeded per call: :meth:`EmulatedCall.seed_of`)."""
    hadamard: bool = False
    """The wgrad GEMM's inputs rotated along the tokens before they are quantized."""
    seed: int = 0
    """The path's stochastic-rounding seed option."""

    @classmethod
    def from_options(cls, options: EmulatedOptions) -> LinearQuantSpec:
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
