"""Scaled fake quantization: divide by a scale per group, round to the format, scale back.

Eight, six or four bits cover a narrow window of magnitudes (e3m2: 0.0625 .. 28), so a tensor
is divided by a scale before rounding and multiplied back after (:func:`quantize_dequantize`):

    scale_g = amax(|x_g|) / max_value          (per group g; 1 where amax is 0)
    Q(x)_g  = round_to_format(x_g / scale_g) * scale_g

The group is the whole tensor (``"tensor"``), one row (``"row"``: one slice along the reduction
dimension) or one tile (``"block"``: DeepSeek-V3's 1 x 128 for activations and gradients,
128 x 128 for weights, so that an outlier only costs its own tile). Groups always run along the
GEMM's reduction dimension (``dim``), so that each scale factors out of a partial dot product
and can be applied to the fp32 accumulator, as a block-scaled GEMM kernel does.

FP4 (e2m1) lives on small blocks with a scale each:

* **NVFP4** (``"nvfp4"``): blocks of 16 with an E4M3 scale under one fp32 tensor scale::

      s_enc = 448 * 6 / amax(x)                      (fp32; 1 when amax is 0 or not finite)
      sc_b  = e4m3(amax_b / 6 * s_enc)               (nearest even, saturating at 448)
      Q(x)  = e2m1(x * s_enc / sc_b) * sc_b / s_enc  (0 in a block whose sc_b rounds to 0)

* **MXFP4** (``"mxfp4"``): blocks of 32 with the E8M0 scale ``2^(floor(log2 amax_b) - 2)``.

Each is evaluated left to right in fp32 exactly as written, so an independent implementation
reproduces every bit (``docs/backends.md#number-formats``: why, and what each costs).
:func:`sqnr_db` measures the result; each mantissa bit is worth about 6 dB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from gnmr_dist.backends.numerics.formats import (
    ACT_BLOCK,
    BLOCK_SCALED,
    FORMATS,
    GRANULARITIES,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    FloatFormat,
    get_format,
)
from gnmr_dist.backends.numerics.rounding import is_stochastic, round_to_format

__all__ = ["quantize_dequantize", "quantize_dequantize_scaled", "sqnr_db"]


@dataclass(frozen=True)
class _Scheme:
    """How one call of :func:`quantize_dequantize` scales and rounds each tile."""

    fmt: FloatFormat
    granularity: str
    rounding: str = "nearest"
    seed: int | None = None
    s_enc: torch.Tensor | None = None
    """NVFP4's per-tensor encode scale ``448 * 6 / amax(x)`` (``None`` for the others)."""

    def round(self, t: torch.Tensor) -> torch.Tensor:
        return round_to_format(t, self.fmt, rounding=self.rounding, seed=self.seed)

    def tiles(self, tiles: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """``Q`` of ``tiles`` ([R, br, C, bc]) given each tile's ``amax`` ([R, 1, C, 1])."""
        if self.granularity == "nvfp4":
            return self._nvfp4(tiles, amax)
        if self.granularity == "mxfp4":
            return self._mx(tiles, amax)
        scale = amax / self.fmt.max_value
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return self.round(tiles / scale) * scale

    def _nvfp4(self, tiles: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """``e2m1(x * s_enc / sc) * sc / s_enc`` with ``sc = e4m3(amax_b / 6 * s_enc)``; a block
        whose ``sc`` rounds to 0 is 0 (a NaN ``sc`` keeps the block NaN)."""
        assert self.s_enc is not None
        s_enc = self.s_enc
        sc = round_to_format(amax / self.fmt.max_value * s_enc, FORMATS["e4m3"])
        zero = sc == 0
        q = self.round(tiles * s_enc / torch.where(zero, torch.ones_like(sc), sc))
        return torch.where(zero, torch.zeros_like(q), q) * sc / s_enc

    def _mx(self, tiles: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """E8M0 scale ``2^(floor(log2 amax_b) - emax)`` (1 where ``amax_b`` is 0, NaN where it is
        not finite), exponent clamped to E8M0's [-127, 127]."""
        emax = math.floor(math.log2(self.fmt.max_value))
        _, e = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        scale = torch.exp2((e - 1 - emax).clamp(-127, 127).double()).float()
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, math.nan))
        return self.round(tiles / scale) * scale


def _nvfp4_encode_scale(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """0-dim fp32 ``448 * max(fmt) / amax(x)``; 1 when ``amax`` is 0 or not finite."""
    amax = x.detach().abs().amax().float()
    s_enc = torch.tensor(FORMATS["e4m3"].max_value * fmt.max_value, device=x.device) / amax
    return torch.where((amax > 0) & torch.isfinite(amax), s_enc, torch.ones_like(s_enc))


def _group_shape(granularity: str, block: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of one scale group in a 2-D tensor whose reduction dim is the last."""
    if granularity == "tensor":
        return rows, cols
    if granularity == "row":
        return 1, cols
    return block


def _default_block(granularity: str) -> tuple[int, int]:
    """The block of ``granularity`` when none is given (1 x 128 for ``"block"``)."""
    return {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}.get(granularity, ACT_BLOCK)


def _quantize_2d(x: torch.Tensor, scheme: _Scheme, tile: tuple[int, int]) -> torch.Tensor:
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
    q = scheme.tiles(tiles, tiles.abs().amax(dim=(1, 3), keepdim=True))
    return q.reshape(x.shape)[:rows, :cols]


def _check_granularity(granularity: str, fmt: FloatFormat) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if granularity in BLOCK_SCALED and fmt.name != "e2m1":
        raise ValueError(
            f"granularity {granularity!r} quantizes to FP4 e2m1 only, got format {fmt.name!r}"
        )


def quantize_dequantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    granularity: str = "tensor",
    *,
    block: tuple[int, int] | None = None,
    dim: int = -1,
    rounding: str = "nearest",
    seed: int | None = None,
) -> torch.Tensor:
    """``Q(x)``: ``x`` divided by a per-group scale, rounded to ``fmt``, scaled back (fp32).

    Args:
        x: any shape, any float dtype.
        fmt: a :class:`FloatFormat` or its name.
        granularity: ``"tensor"`` (one scale), ``"row"`` (one per slice along ``dim``),
            ``"block"`` (one per ``block`` tile), ``"none"`` (scale 1: plain rounding), or, for
            ``"e2m1"``, ``"nvfp4"`` / ``"mxfp4"`` (the two-level and the E8M0 block scales of
            the module docstring).
        block: ``(rows, cols)`` tile, ``cols`` along ``dim`` and ``rows`` along all other dims
            flattened. Default: 1 x 128 for ``"block"``, 1 x 16 for ``"nvfp4"`` (pass
            :data:`NVFP4_WEIGHT_BLOCK` for weights), 1 x 32 for ``"mxfp4"``.
        dim: the GEMM's reduction dimension, along which groups run.
        rounding: ``"nearest"`` or ``"stochastic"`` (with ``seed``; :func:`round_to_format`).
        seed: the stochastic rounding's seed (:func:`sr_seed`).

    ``fp32`` returns ``x`` itself, whatever its dtype (float64 stays float64).
    """
    fmt = get_format(fmt)
    _check_granularity(granularity, fmt)
    is_stochastic(rounding, seed, fmt)
    if fmt.is_identity:
        return x
    if granularity == "none" or x.numel() == 0:
        return round_to_format(x, fmt, rounding=rounding, seed=seed)
    block = block or _default_block(granularity)
    x = x.float()
    dim = dim + x.dim() if dim < 0 else dim
    if not 0 <= dim < x.dim():
        raise ValueError(f"dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
    s_enc = _nvfp4_encode_scale(x, fmt) if granularity == "nvfp4" else None
    scheme = _Scheme(fmt, granularity, rounding, seed, s_enc)
    if dim == x.dim() - 1:
        flat = x.reshape(-1, x.shape[-1])
        tile = _group_shape(granularity, block, *flat.shape)
        return _quantize_2d(flat, scheme, tile).reshape(x.shape)
    if x.dim() == 2:  # reduce along dim 0: transposed tiles on the original layout, no copy
        tr, tc = _group_shape(granularity, block, x.shape[1], x.shape[0])
        return _quantize_2d(x, scheme, (tc, tr))
    moved = x.movedim(dim, -1)
    return quantize_dequantize(
        moved, fmt, granularity, block=block, rounding=rounding, seed=seed
    ).movedim(-1, dim)


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
