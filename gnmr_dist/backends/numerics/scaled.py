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
e2m1     2    1    1    6         OCP FP4 E2M1 (MX, NVFP4): 0, 0.5, 1, 1.5, 2, 3, 4, 6
======  ===  ===  ====  ========  ====================================================

``bf16``, ``fp16`` and ``fp32`` are passthrough formats: a dtype cast (``fp32`` is the identity).

Rounding (:func:`round_to_format`) is round-to-nearest, ties to the code with an even mantissa
LSB, with subnormals, and *saturating*: anything beyond ``max_value`` (``inf`` included) becomes
``+-max_value``, as the hardware's "satfinite" conversions do; NaN stays NaN. FP8 uses torch's
``float8_e4m3fn`` / ``float8_e5m2`` casts after a clamp (torch's e5m2 cast overflows to inf).
FP6 and FP4 have no torch dtype (torch's ``float4_e2m1fn_x2`` cannot be cast to on the CPU), so
they are done with quantum arithmetic: for ``|x|`` in binade
``[2^k, 2^(k+1))`` the spacing is ``q = 2^(max(k, 1 - b) - M)`` and ``round(x / q) * q`` with
``torch.round`` (half to even) is exact in fp32, because ``q`` is a power of two. Rounding half
to an even multiple of ``q`` is rounding to the even mantissa: within a binade the multiples of
``q`` are the codes, and a binade starts at an even code.

Stochastic rounding (``rounding="stochastic"``) rounds ``|x|`` up to the next code with
probability ``(|x| - lo) / q`` and down to ``lo`` otherwise, so ``E[Q(x)] = x`` for every ``x``
inside the range (saturation stays deterministic). The uniform draws come from a generator
seeded with the call's ``seed`` alone (:func:`sr_seed` mixes a step, a unit and a role into
one), never from torch's global generator: every rank that rounds the same values with the same
seed draws the same bits, a resumed run draws what the uninterrupted one drew, and the data
loader's random stream is never touched. Up-or-down is decided as ``u < frac`` on the exact
fraction ``frac = |x| / q - floor(|x| / q)``, so the only bias is the 2^-24 grid of ``u``.

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

FP4 block scales (``granularity="nvfp4"`` / ``"mxfp4"``, e2m1 elements)
----------------------------------------------------------------------
Four bits leave E2M1 a dynamic range of 12 (0.5 .. 6), so FP4 lives on small blocks and a
scale per block; the two formats of the field differ in the scale:

* **NVFP4** (NVIDIA, arXiv 2509.25149): blocks of 16 (1 x 16 along the reduction dimension for
  activations and gradients, 16 x 16 tiles for weights), each with an E4M3 scale, plus one fp32
  scale per tensor that brings the block scales into E4M3's range::

      s_enc = 448 * 6 / amax(x)                      (fp32; 1 when amax is 0 or not finite)
      sc_b  = e4m3(amax_b / 6 * s_enc)               (nearest even, saturating at 448)
      Q(x)  = e2m1(x * s_enc / sc_b) * sc_b / s_enc  (0 in a block whose sc_b rounds to 0)

  The block scale keeps 3 mantissa bits, so a block's largest value lands within 1/16 of 6.
* **MXFP4** (OCP Microscaling v1.0): blocks of 32 along the reduction dimension with a
  power-of-two (E8M0) scale ``2^(floor(log2 amax_b) - 2)`` (2 = E2M1's largest exponent; 1
  where ``amax_b`` is 0); a block's largest value lands in [4, 8) and saturates at 6 when it
  is above 6, which costs MXFP4 up to a quarter of its top values' magnitude.

Each is evaluated left to right in fp32 exactly as written, so an independent implementation
of the formulas reproduces every bit.

The random Hadamard transform
-----------------------------
A few large entries set a block's scale and push its other entries to 0 or 0.5. NVIDIA
therefore rotates both inputs of the weight-gradient GEMM along its reduction dimension (the
tokens) before quantizing them (:func:`hadamard_rotate`): in blocks of 16 rows,
``x -> H D x`` with ``H`` the 16 x 16 Sylvester-Hadamard matrix divided by 4 (orthonormal) and
``D`` a fixed diagonal of random signs. The rotation spreads an outlier over the block, and
since ``(H D)^T (H D) = I`` the GEMM of the rotated operands is the GEMM of the originals:
``(H D dy)^T (H D x) = dy^T x``. A ragged last block is zero-padded (the padded rows add
nothing to the product), so the rotated tensor is a multiple of 16 long.

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
    "BLOCK_SCALED",
    "FORMATS",
    "GRANULARITIES",
    "HADAMARD_SIZE",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "NVFP4_WEIGHT_BLOCK",
    "ROUNDINGS",
    "WEIGHT_BLOCK",
    "FloatFormat",
    "get_format",
    "hadamard_rotate",
    "quantize_dequantize",
    "quantize_dequantize_scaled",
    "round_to_format",
    "sqnr_db",
    "sr_seed",
]

GRANULARITIES = ("tensor", "row", "block", "none", "nvfp4", "mxfp4")
"""Scale groups: one per tensor, per row (slice along ``dim``), per tile, no scaling, or FP4's
two block-scaled layouts (NVFP4: E4M3 block scales under an fp32 tensor scale; MXFP4: E8M0)."""

BLOCK_SCALED = ("nvfp4", "mxfp4")
"""The FP4 granularities: e2m1 elements only, each with its own default block."""

ROUNDINGS = ("nearest", "stochastic")
"""Round to nearest (ties to even), or stochastically (unbiased; gradients)."""

NVFP4_BLOCK = (1, 16)
"""NVFP4's block of activations and gradients: 1 x 16 along the reduction dimension."""

NVFP4_WEIGHT_BLOCK = (16, 16)
"""NVFP4's 2-D weight tile (the same tiles along either dimension)."""

MXFP4_BLOCK = (1, 32)
"""MXFP4's block: 1 x 32 along the reduction dimension."""

HADAMARD_SIZE = 16
"""Rows per block of the random Hadamard transform."""

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
        FloatFormat("e2m1", 2, 1, 1, 6.0),
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


def _quantum(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The spacing of ``fmt``'s codes around fp32 ``x`` (already clamped to +-max).

    The binade ``floor(log2|x|)`` is read from the fp32 exponent field (cheaper than
    ``frexp``); below the smallest normal of ``fmt`` the spacing stays at the subnormal quantum.
    """
    top = math.floor(math.log2(fmt.max_value))
    binade = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    return _pow2(binade.clamp_(1 - fmt.bias, top) - fmt.man_bits)


def _round_by_quantum(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round fp32 ``x`` (clamped) to ``fmt``: nearest multiple of the quantum, ties to even."""
    quantum = _quantum(x, fmt)
    return torch.round(x / quantum) * quantum


def _round_stochastic(x: torch.Tensor, fmt: FloatFormat, u: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` (clamped) to ``fmt`` up with probability ``frac``, given uniforms ``u``.

    ``|x| / q`` and its fraction are exact in fp32 (``q`` is a power of two, and ``a - floor(a)``
    is exact by Sterbenz's lemma); NaN stays NaN (``u < NaN`` is false, ``NaN * q`` is NaN).
    """
    quantum = _quantum(x, fmt)
    a = x.abs() / quantum
    lo = torch.floor(a)
    return torch.copysign((lo + (u < a - lo)) * quantum, x)


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One step of SplitMix64 (Steele et al.): a bijective 64-bit mix."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sr_seed(*parts: int) -> int:
    """A 63-bit seed for stochastic rounding mixed from integers (step, unit, role, ...).

    The same parts give the same seed in every process and after a restart (no Python ``hash``
    salt, no global state); parts that differ in any bit give unrelated seeds.
    """
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h >> 1


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _uniform(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """Uniform fp32 draws in [0, 1) from a generator seeded with ``seed`` alone (one generator
    per device, re-seeded on every call: torch's global generator is never drawn from)."""
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device)


def _stochastic(rounding: str, seed: int | None, fmt: FloatFormat) -> bool:
    """Check ``rounding`` (and its ``seed``) for ``fmt``; whether it is stochastic."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    if rounding == "nearest":
        return False
    if not fmt.scaled:
        raise ValueError(
            f"stochastic rounding applies to the narrow formats (FP8/FP6/FP4), not {fmt.name!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"stochastic rounding needs an integer seed (sr_seed(step, unit, ...)), got {seed!r}"
        )
    return True


def round_to_format(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    *,
    rounding: str = "nearest",
    seed: int | None = None,
) -> torch.Tensor:
    """``x`` rounded to ``fmt`` (saturating, NaN kept), as fp32.

    ``rounding="nearest"``: ties to the even mantissa. ``"stochastic"`` (narrow formats only):
    unbiased, with the uniforms of a generator seeded by ``seed`` (module docstring). Input of
    any float dtype is first converted to fp32 (for float64 input this rounds twice; the second
    rounding can differ from a direct one only on exact midpoints of ``fmt``). ``bf16`` and
    ``fp16`` saturate too (a plain cast would overflow to inf); ``fp32`` is the identity and
    keeps inf.
    """
    fmt = get_format(fmt)
    stochastic = _stochastic(rounding, seed, fmt)
    x = x.float()
    if fmt.is_identity:
        return x
    x = x.clamp(-fmt.max_value, fmt.max_value)  # saturate; clamp keeps NaN
    if stochastic:
        assert seed is not None
        return _round_stochastic(x, fmt, _uniform(x.shape, seed, x.device))
    if fmt.dtype is not None:
        return x.to(fmt.dtype).float()
    return _round_by_quantum(x, fmt)


# ---------------------------------------------------------------------- scaled quantization


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
    _stochastic(rounding, seed, fmt)
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


# ------------------------------------------------------------------ random Hadamard transform

_RHT_SIGN_SEED = 0x5EED_F4
"""Seed of the fixed random signs ``D`` (the same on every rank and in every run)."""

_RHT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _sylvester(n: int) -> torch.Tensor:
    """The n x n Sylvester-Hadamard matrix (entries +-1; n a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _rht_matrix(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``H D / 4``: orthonormal, cached per device and dtype."""
    key = (device, dtype)
    if key not in _RHT:
        gen = torch.Generator().manual_seed(_RHT_SIGN_SEED)
        signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=gen).double() * 2 - 1
        m = _sylvester(HADAMARD_SIZE) * signs / math.sqrt(HADAMARD_SIZE)
        _RHT[key] = m.to(device=device, dtype=dtype)
    return _RHT[key]


def hadamard_rotate(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``H D`` applied to ``x`` along ``dim`` in blocks of 16 (module docstring), fp32.

    A length along ``dim`` that is not a multiple of 16 is zero-padded first, so the result is
    longer than ``x`` there; two operands rotated alike along their common reduction dimension
    have the same product as the originals. float64 input stays float64.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    moved = x.movedim(dim, 0)
    n, rest = moved.shape[0], moved.shape[1:]
    pad = (-n) % HADAMARD_SIZE
    if pad:
        moved = torch.cat([moved, moved.new_zeros(pad, *rest)])
    blocks = moved.reshape(-1, HADAMARD_SIZE, math.prod(rest))
    out = torch.matmul(_rht_matrix(x.device, x.dtype), blocks)
    return out.reshape(n + pad, *rest).movedim(0, dim)


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
