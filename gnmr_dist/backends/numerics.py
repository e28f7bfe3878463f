"""Low-precision float formats emulated with torch ops: rounding and scaled fake quantization.

Formats
-------
A binary float format with ``E`` exponent bits, ``M`` mantissa bits and bias ``b`` represents

    normal:     (-1)^s * 2^(e - b) * (1 + m / 2^M)      e = 1 .. 2^E - 1, m = 0 .. 2^M - 1
    subnormal:  (-1)^s * 2^(1 - b) * (m / 2^M)          e = 0

minus the codes a format reserves for inf/NaN. The narrow formats used for training GEMMs:

======  ===  ===  ====  ========  ====================================================
name     E    M   bias  max       notes
======  ===  ===  ====  ========  ====================================================
e4m3     4    3    7    448       OCP FP8 E4M3FN: no inf, only S.1111.111 is NaN
e5m2     5    2   15    57344     OCP FP8 E5M2: IEEE-like, top exponent is inf/NaN
e3m2     3    2    3    28        OCP FP6 E3M2 (MX): no inf/NaN, every code is finite
e2m3     2    3    1    7.5       OCP FP6 E2M3 (MX): no inf/NaN, every code is finite
======  ===  ===  ====  ========  ====================================================

``bf16``, ``fp16`` and ``fp32`` are passthrough formats: a dtype cast (``fp32`` is the identity).

Rounding (:func:`round_to_format`) is round-to-nearest, ties to the code with an even mantissa
LSB, with subnormals, and *saturating*: anything beyond ``max_value`` (``inf`` included) becomes
``+-max_value``, as the hardware's "satfinite" conversions do; NaN stays NaN. FP8 uses torch's
``float8_e4m3fn`` / ``float8_e5m2`` casts after a clamp (torch's e5m2 cast overflows to inf).
FP6 has no torch dtype, so it is done with quantum arithmetic: for ``|x|`` in binade
``[2^k, 2^(k+1))`` the spacing is ``q = 2^(max(k, 1 - b) - M)`` and ``round(x / q) * q`` with
``torch.round`` (half to even) is exact in fp32, because ``q`` is a power of two.

Scaled fake quantization
------------------------
Eight or six bits cover a narrow window of magnitudes (e3m2: 0.0625 .. 28), so a tensor is
divided by a scale before rounding and multiplied back after (:func:`quantize_dequantize`):

    scale_g = amax(|x_g|) / max_value          (per group g; 1 where amax is 0)
    Q(x)_g  = round_to_format(x_g / scale_g) * scale_g

The group is the whole tensor (``"tensor"``), one row (``"row"``: one slice along the reduction
dimension) or one tile (``"block"``). One large value sets the scale of its whole group and
pushes every small value of that group into the subnormals or to zero. Activations of large
models carry such outliers in a few channels, so DeepSeek-V3 (arXiv 2412.19437, section 3.3)
scales per 1x128 tile (one token, 128 channels) for activations and gradients and per 128x128
block for weights: an outlier then only costs its own tile, and the FP8 e4m3 mantissa is used
for everything, gradients included. Groups always run along the GEMM's reduction dimension
(``dim``), so that each scale factors out of a partial dot product and can be applied to the
fp32 accumulator, as a block-scaled GEMM kernel does.

:func:`sqnr_db` measures the result: ``10 log10(sum x^2 / sum (x - Q(x))^2)``; each mantissa bit
is worth about 6 dB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = [
    "ACT_BLOCK",
    "FORMATS",
    "GRANULARITIES",
    "WEIGHT_BLOCK",
    "FloatFormat",
    "get_format",
    "quantize_dequantize",
    "quantize_dequantize_scaled",
    "round_to_format",
    "sqnr_db",
]

GRANULARITIES = ("tensor", "row", "block", "none")
"""Scale groups: one per tensor, per row (slice along ``dim``), per tile, or no scaling."""

ACT_BLOCK = (1, 128)
"""Default tile of activations and gradients: 1 row x 128 along the reduction dimension."""

WEIGHT_BLOCK = (128, 128)
"""Default tile of weights."""


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format (see the module docstring for the value formula)."""

    name: str
    """Config name: ``"e4m3"``, ``"e5m2"``, ``"e3m2"``, ``"e2m3"``, ``"bf16"``, ``"fp16"``, ..."""
    exp_bits: int
    """Exponent field width ``E``."""
    man_bits: int
    """Mantissa (fraction) field width ``M``."""
    bias: int
    """Exponent bias ``b``."""
    max_value: float
    """Largest finite magnitude; rounding saturates here."""
    dtype: torch.dtype | None = None
    """torch dtype that holds the format exactly (``None`` for FP6: emulated by arithmetic)."""
    scaled: bool = True
    """Whether the format is narrow enough to need a scale (FP8/FP6), not a passthrough cast."""

    @property
    def bits(self) -> int:
        """Total width: sign + exponent + mantissa."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value ``2^(1 - b)``."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value ``2^(1 - b - M)``."""
        return math.ldexp(1.0, 1 - self.bias - self.man_bits)

    @property
    def is_identity(self) -> bool:
        """True for ``fp32``: rounding and quantization leave a tensor untouched."""
        return self.dtype is torch.float32


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("e4m3", 4, 3, 7, 448.0, torch.float8_e4m3fn),
        FloatFormat("e5m2", 5, 2, 15, 57344.0, torch.float8_e5m2),
        FloatFormat("e3m2", 3, 2, 3, 28.0),
        FloatFormat("e2m3", 2, 3, 1, 7.5),
        FloatFormat("bf16", 8, 7, 127, torch.finfo(torch.bfloat16).max, torch.bfloat16, False),
        FloatFormat("fp16", 5, 10, 15, torch.finfo(torch.float16).max, torch.float16, False),
        FloatFormat("fp32", 8, 23, 127, torch.finfo(torch.float32).max, torch.float32, False),
    )
}
"""Every format by config name."""


def get_format(fmt: FloatFormat | str) -> FloatFormat:
    """The :class:`FloatFormat` called ``fmt`` (a format passes through)."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown float format {fmt!r}; allowed: {sorted(FORMATS)}")
    return FORMATS[fmt]


# ---------------------------------------------------------------------------------- rounding


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^exponent`` for integer exponents in the normal range, built from bits."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _round_by_quantum(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round fp32 ``x`` (already clamped to +-max) to ``fmt`` by spacing arithmetic.

    The binade ``floor(log2|x|)`` is read from the fp32 exponent field (cheaper than
    ``frexp``); below the smallest normal of ``fmt`` the spacing stays at the subnormal quantum.
    """
    top = math.floor(math.log2(fmt.max_value))
    binade = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    quantum = _pow2(binade.clamp_(1 - fmt.bias, top) - fmt.man_bits)
    return torch.round(x / quantum) * quantum


def round_to_format(x: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """``x`` rounded to ``fmt`` (nearest, ties to even, saturating, NaN kept), as fp32.

    Input of any float dtype is first converted to fp32 (for float64 input this rounds twice;
    the second rounding can differ from a direct one only on exact midpoints of ``fmt``).
    ``bf16`` and ``fp16`` saturate too (a plain cast would overflow to inf); ``fp32`` is the
    identity and keeps inf.
    """
    fmt = get_format(fmt)
    x = x.float()
    if fmt.is_identity:
        return x
    x = x.clamp(-fmt.max_value, fmt.max_value)  # saturate; clamp keeps NaN
    if fmt.dtype is not None:
        return x.to(fmt.dtype).float()
    return _round_by_quantum(x, fmt)


# ---------------------------------------------------------------------- scaled quantization


def _group_shape(granularity: str, block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of one scale group in a 2-D tensor whose reduction dim is the last."""
    if granularity == "tensor":
        return rows, cols
    if granularity == "row":
        return 1, cols
    return block


def _quantize_2d(x: torch.Tensor, fmt: FloatFormat, tile: tuple[int, int]) -> torch.Tensor:
    """Scaled fake quantization of a 2-D fp32 tensor with one scale per ``tile``.

    Ragged edges are zero-padded to whole tiles; zeros do not change a tile's amax, so the
    last tile of a row is scaled by its real values only.
    """
    rows, cols = x.shape
    br, bc = tile
    pad_r, pad_c = (-rows) % br, (-cols) % bc
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    tiles = x.reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = amax / fmt.max_value
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = round_to_format(tiles / scale, fmt) * scale
    return q.reshape(x.shape)[:rows, :cols]


def quantize_dequantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    granularity: str = "tensor",
    *,
    block: tuple[int, int] = ACT_BLOCK,
    dim: int = -1,
) -> torch.Tensor:
    """``Q(x)``: ``x`` divided by a per-group scale, rounded to ``fmt``, scaled back (fp32).

    Args:
        x: any shape, any float dtype.
        fmt: a :class:`FloatFormat` or its name.
        granularity: ``"tensor"`` (one scale), ``"row"`` (one per slice along ``dim``),
            ``"block"`` (one per ``block`` tile) or ``"none"`` (scale 1: plain rounding).
        block: ``(rows, cols)`` tile, ``cols`` along ``dim`` and ``rows`` along all other dims
            flattened (1x128 for activations and gradients, 128x128 for weights).
        dim: the GEMM's reduction dimension, along which groups run.

    ``fp32`` returns ``x`` itself, whatever its dtype (float64 stays float64).
    """
    fmt = get_format(fmt)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if fmt.is_identity:
        return x
    if granularity == "none" or x.numel() == 0:
        return round_to_format(x, fmt)
    x = x.float()
    dim = dim + x.dim() if dim < 0 else dim
    if not 0 <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
    if dim == x.dim() - 1:
        flat = x.reshape(-1, x.shape[-1])
        tile = _group_shape(granularity, block, *flat.shape)
        return _quantize_2d(flat, fmt, tile).reshape(x.shape)
    if x.dim() == 2:  # reduce along dim 0: transposed tiles on the original layout, no copy
        tr, tc = _group_shape(granularity, block, x.shape[1], x.shape[0])
        return _quantize_2d(x, fmt, (tc, tr))
    moved = x.movedim(dim, -1)
    return quantize_dequantize(moved, fmt, granularity, block=block).movedim(-1, dim)


def quantize_dequantize_scaled(
    x: torch.Tensor, fmt: FloatFormat | str, scale: torch.Tensor
) -> torch.Tensor:
    """``round_to_format(x / scale, fmt) * scale`` with a given 0-dim (or broadcastable) ``scale``.

    Nothing checks that ``x / scale`` fits the format: what exceeds ``max_value`` saturates to
    ``+-max_value * scale`` and what falls below the smallest subnormal flushes to zero. With
    ``scale = amax(|x|) / max_value`` it equals ``quantize_dequantize(x, fmt, "tensor")``
    bit for bit. ``fp32`` returns ``x`` itself; other formats return fp32.
    """
    fmt = get_format(fmt)
    if fmt.is_identity:
        return x
    return round_to_format(x.float() / scale, fmt) * scale


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(|ref|^2 / |ref - approx|^2)`` in dB.

    Computed in float64; ``inf`` when ``approx`` equals ``reference``.
    """
    ref = reference.double()
    noise = (ref - approx.double()).square().sum().item()
    signal = ref.square().sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
