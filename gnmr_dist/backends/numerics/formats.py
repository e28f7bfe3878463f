"""The number formats: FP8, FP6 and FP4 elements, and the scale layouts of the GEMMs' inputs.

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

A narrow format is used with a scale per group of values (:mod:`~.scaled`): the whole tensor,
one row, a tile (DeepSeek-V3's 1 x 128 / 128 x 128), or FP4's small blocks (NVFP4: 16 values
under an E4M3 scale; MXFP4: 32 values under an E8M0 power of two). Their names and default
tiles are here; ``docs/backends.md#number-formats`` has the recipes. Importing this module
imports torch alone: no backend is registered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ACT_BLOCK",
    "BLOCK_SCALED",
    "FORMATS",
    "GRANULARITIES",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "NVFP4_WEIGHT_BLOCK",
    "WEIGHT_BLOCK",
    "FloatFormat",
    "get_format",
]

GRANULARITIES = ("tensor", "row", "block", "none", "nvfp4", "mxfp4")
"""Scale groups: one per tensor, per row (slice along ``dim``), per tile, no scaling, or FP4's
two block-scaled layouts (NVFP4: E4M3 block scales under an fp32 tensor scale; MXFP4: E8M0)."""

BLOCK_SCALED = ("nvfp4", "mxfp4")
"""The FP4 granularities: e2m1 elements only, each with its own default block."""

NVFP4_BLOCK = (1, 16)
"""NVFP4's block of activations and gradients: 1 x 16 along the reduction dimension."""

NVFP4_WEIGHT_BLOCK = (16, 16)
"""NVFP4's 2-D weight tile (the same tiles along either dimension)."""

MXFP4_BLOCK = (1, 32)
"""MXFP4's block: 1 x 32 along the reduction dimension."""

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
