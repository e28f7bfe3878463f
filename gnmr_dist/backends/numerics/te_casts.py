"""Transformer Engine's casts, reproduced bit for bit on any device.

``fp8_emulated`` rounds ``x / (amax / max)`` (:mod:`~.scaled`); Transformer Engine's quantizers
use another convention, one rounding apart, and a score that is to say what TE's GEMMs read must
use TE's. Read from TE 2.20's kernels (``transformer_engine/common``) and its Python references
(the test references and ``reference_nvfp4.py``), each step in fp32 as written there:

* scale from an amax (``compute_scale_from_amax``): ``max_fp8 / max(amax, eps)``, 1 for an amax
  of 0, inf or NaN, an infinite scale replaced by ``value_for_inf`` (fp32's max per tensor, the
  input dtype's max per block), power-of-two scales by clearing the mantissa;
* FP8 cast: ``fp8(clamp(x * scale))``, dequantized as ``codes * (1 / scale)``: per tensor
  (delayed, current), per tile (``Float8BlockScaling``: 1 x 128, 128 x 128), per row;
* MXFP8: per 32 values ``amax * fl(1 / max_fp8)`` rounded *up* to an E8M0 power of two
  (``float_to_e8m0``); the data times ``2^(127 - e)``, dequantized by ``2^(e - 127)``;
* NVFP4: ``S_enc = min(2688 / A, fp32 max)``, block scale ``e4m3(amax_b * (S_enc * fl(1/6)))``,
  encode ``min(1 / (sc * fl(1 / S_enc)), fp32 max)``, e2m1 codes (nearest even or stochastic),
  dequantized by ``(sc * A) * fl(1 / 2688)``; the wgrad operands first rotated by TE's random
  Hadamard transform (:func:`te_rht`: TE's signs, 1/4, rounded to the input dtype).

Functions quantize along the last dimension (``columnwise=True``: along the first, which is TE's
columnwise data without transposing it) and return a :class:`Cast`: codes, dequantizing factors,
and the dequantized fp32 tensor. The formulas, their tests and where torchao differs:
``docs/backends.md#the-shadow-route``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from gnmr_dist.backends.numerics.formats import FORMATS, FloatFormat, get_format
from gnmr_dist.backends.numerics.rounding import round_to_format

__all__ = [
    "FP32_MAX",
    "RHT_SIGNS",
    "Cast",
    "cast_blocks",
    "cast_mxfp8",
    "cast_nvfp4",
    "cast_tensor",
    "e8m0_round_up",
    "scale_from_amax",
    "te_rht",
]

FP32_MAX = torch.finfo(torch.float32).max
"""TE's ``value_for_inf`` of per-tensor current scaling, and NVFP4's cap on its scales."""

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TE's fixed random signs of the wgrad Hadamard transform (``get_wgrad_sign_vector``)."""

_NVFP4_BLOCK = 16
_MX_BLOCK = 32
_E8M0_BIAS = 127


@dataclass(frozen=True)
class Cast:
    """One quantized tensor: what TE's quantized tensor holds, and what the GEMM reads."""

    codes: torch.Tensor
    """The narrow values (FP8 dtype; for FP4 the e2m1 values as fp32), input shape (flattened
    to 2-D for the block formats)."""
    scale_inv: torch.Tensor
    """The dequantizing factor: 0-dim per tensor, one per tile / block (fp32), E8M0 exponents
    (uint8) for MXFP8, the E4M3 block scales for NVFP4."""
    dequantized: torch.Tensor
    """fp32: the tensor the GEMM multiplies (codes times their factor), the input's shape."""


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def scale_from_amax(
    amax: torch.Tensor,
    max_value: float,
    *,
    pow2: bool = False,
    eps: float = 0.0,
    value_for_inf: float = FP32_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` elementwise (module docstring), fp32."""
    amax = amax.float()
    a = torch.where(amax < eps, _f32(eps, amax), amax)  # NaN < eps is false: NaN stays
    scale = _f32(max_value, a) / a
    scale = torch.where(torch.isinf(scale), _f32(value_for_inf, a), scale)
    if pow2:
        bits = scale.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32)  # 0xFF800000
        scale = bits.view(torch.float32)
    special = torch.isinf(a) | (a == 0) | torch.isnan(a)
    return torch.where(special, torch.ones_like(scale), scale)


def _fp8(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Saturating cast of fp32 ``t`` to ``fmt``'s torch dtype (NaN stays NaN)."""
    if fmt.dtype is None or not fmt.scaled or fmt.bits != 8:
        raise ValueError(f"an FP8 cast needs e4m3 or e5m2, got {fmt.name!r}")
    return t.clamp(-fmt.max_value, fmt.max_value).to(fmt.dtype)


def cast_tensor(x: torch.Tensor, fmt: FloatFormat | str, scale: torch.Tensor) -> Cast:
    """Per-tensor FP8 with TE's ``scale`` (delayed scaling's from the module's state, or
    :func:`scale_from_amax` of the tensor's amax for current scaling): ``fp8(x * scale)`` and
    ``codes * (1 / scale)``."""
    fmt = get_format(fmt)
    scale = scale.float()
    codes = _fp8(x.float() * scale, fmt)
    scale_inv = torch.reciprocal(scale)
    return Cast(codes, scale_inv, codes.float() * scale_inv)


def _tiles(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """``x`` (2-D) zero-padded to whole tiles and viewed as ``[R, tr, C, tc]``."""
    rows, cols = x.shape
    tr, tc = tile
    padded = F.pad(x, (0, (-cols) % tc, 0, (-rows) % tr))
    r, c = padded.shape
    return padded.reshape(r // tr, tr, c // tc, tc), rows, cols


def _untile(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[R, tr, C, tc]`` tiles back to the 2-D ``[rows, cols]`` they were cut from."""
    r, tr, c, tc = tiles.shape
    return tiles.reshape(r * tr, c * tc)[:rows, :cols]


def cast_blocks(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    tile: tuple[int, int] = (1, 128),
    *,
    pow2: bool = True,
    eps: float = 0.0,
) -> Cast:
    """``Float8BlockQuantizer``: one scale per ``tile`` (rows x columns of the flattened 2-D
    ``x``; ``(1, 128)`` for activations and gradients, ``(128, 128)`` for weights, ``(1, K)``
    for one scale per row), from the tile's amax with power-of-two scales (TE's default) and
    the input dtype's max for an infinite scale. Ragged edges are zero-padded, as TE pads."""
    fmt = get_format(fmt)
    flat = x.reshape(-1, x.shape[-1])
    tiles, rows, cols = _tiles(flat.float(), tile)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    inf_value = torch.finfo(x.dtype).max if x.dtype.is_floating_point else FP32_MAX
    scale = scale_from_amax(amax, fmt.max_value, pow2=pow2, eps=eps, value_for_inf=inf_value)
    codes = _fp8(tiles * scale, fmt)
    scale_inv = torch.reciprocal(scale)
    deq = _untile(codes.float() * scale_inv, rows, cols).reshape(x.shape)
    return Cast(_untile(codes, rows, cols), scale_inv[:, 0, :, 0], deq)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0``: the biased E8M0 exponent (uint8) of fp32 ``v >= 0`` rounded up
    to a power of two, saturating at 254; 255 for NaN, 254 for inf, 0 for 0 and below 2^-127."""
    bits = v.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + up.to(torch.int32)
    exponent = torch.where(torch.isinf(v), torch.full_like(exponent, 0xFE), exponent)
    exponent = torch.where(torch.isnan(v), torch.full_like(exponent, 0xFF), exponent)
    exponent = torch.where(v == 0, torch.zeros_like(exponent), exponent)
    return exponent.to(torch.uint8)


def _pow2_of_biased(e: torch.Tensor, sign: int) -> torch.Tensor:
    """``2^(sign * (e - 127))`` of biased E8M0 exponents, built from fp32 bits as TE's
    ``exp2f_rcp`` (``sign = -1``) builds them; NaN for 255."""
    e = e.to(torch.int32)
    field = 254 - e if sign < 0 else e
    bits = torch.where(field > 0, field << 23, torch.full_like(field, 0x00400000))  # 2^-127
    out = bits.view(torch.float32)
    return torch.where(e == 0xFF, torch.full_like(out, math.nan), out)


def cast_mxfp8(
    x: torch.Tensor, fmt: FloatFormat | str, block: int = _MX_BLOCK, *, columnwise: bool = False
) -> Cast:
    """``MXFP8Quantizer``: blocks of ``block`` along the last dim (zero-padded), E8M0 scales
    rounded up from ``amax * fl(1 / max_fp8)`` (module docstring). ``columnwise``: blocks along
    the first dim of the 2-D ``x`` instead (TE's columnwise data, without transposing: codes and
    scales are the transposes of TE's)."""
    fmt = get_format(fmt)
    flat = x.reshape(-1, x.shape[-1])
    tiles, rows, cols = _tiles(flat.float(), (block, 1) if columnwise else (1, block))
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    e = e8m0_round_up(amax * _f32(1.0 / fmt.max_value, amax))
    codes = _fp8(tiles * _pow2_of_biased(e, -1), fmt)
    deq = _untile(codes.float() * _pow2_of_biased(e, 1), rows, cols).reshape(x.shape)
    return Cast(_untile(codes, rows, cols), e[:, 0, :, 0], deq)


_RHT: dict[torch.device, torch.Tensor] = {}


def _rht_matrix(device: torch.device) -> torch.Tensor:
    """``diag(RHT_SIGNS) H / 4`` (fp32), cached per device."""
    if device not in _RHT:
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < _NVFP4_BLOCK:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
        _RHT[device] = (signs[:, None] * h * 0.25).to(device)
    return _RHT[device]


def te_rht(x: torch.Tensor, *, columnwise: bool = False) -> torch.Tensor:
    """TE's random Hadamard transform of the columnwise layout: each run of 16 along the last
    dim times ``diag(RHT_SIGNS) H / 4`` (``NVFP4QuantizerRef._apply_rht``), computed in fp32
    and rounded to ``x``'s dtype; ``columnwise``: runs along the first dim of the 2-D ``x``
    (the same numbers, transposed). That dim must be a multiple of 16 (TE's requirement)."""
    n = x.shape[0] if columnwise else x.shape[-1]
    if n % _NVFP4_BLOCK:
        raise ValueError(f"the Hadamard transform needs a multiple of 16 along the tokens, got {n}")
    transform = _rht_matrix(x.device)
    if columnwise:  # row r of a run times T: T^T @ the run's [16, K] block
        out = torch.matmul(transform.t(), x.float().reshape(-1, _NVFP4_BLOCK, x.shape[-1]))
    else:
        out = x.float().reshape(-1, _NVFP4_BLOCK) @ transform
    return out.reshape(x.shape).to(x.dtype)


def cast_nvfp4(
    x: torch.Tensor,
    *,
    amax: torch.Tensor | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    columnwise: bool = False,
) -> Cast:
    """``NVFP4Quantizer`` with 1 x 16 blocks along the last dim (module docstring): ``amax``
    is the tensor amax ``A`` TE uses (default: ``x``'s; under sequence parallelism TE's reduced
    one), ``rounding="stochastic"`` rounds the e2m1 values with the seeded draws of
    :func:`~gnmr_dist.backends.numerics.rounding.round_to_format` (TE draws its own: the same
    distribution, other bits). ``scale_inv`` holds the E4M3 block scales. ``columnwise``: the
    blocks run along the first dim of the 2-D ``x`` (TE's columnwise data, transposed)."""
    flat = x.reshape(-1, x.shape[-1])
    tile = (_NVFP4_BLOCK, 1) if columnwise else (1, _NVFP4_BLOCK)
    tiles, rows, cols = _tiles(flat.float(), tile)
    a = (flat.float().abs().amax() if amax is None else amax.float()).reshape(())
    fmax, e4m3 = FORMATS["e2m1"].max_value, FORMATS["e4m3"]
    s_enc = torch.minimum(_f32(e4m3.max_value * fmax, a) / a, _f32(FP32_MAX, a))
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.reciprocal(s_enc)
    block_amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    sc = torch.minimum(block_amax * (s_enc * _f32(1.0 / fmax, a)), _f32(FP32_MAX, a))
    sc = _fp8(sc, e4m3).float()
    enc = torch.minimum(torch.reciprocal(sc * s_dec), _f32(FP32_MAX, a))
    scaled = (tiles * enc).clamp(-fmax, fmax)
    codes = round_to_format(scaled, "e2m1", rounding=rounding, seed=seed)
    factor = (sc * a) * _f32(1.0 / (e4m3.max_value * fmax), a)
    deq = _untile(codes * factor, rows, cols).reshape(x.shape)
    return Cast(_untile(codes, rows, cols), sc[:, 0, :, 0], deq)
