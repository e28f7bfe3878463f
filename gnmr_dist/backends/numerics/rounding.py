"""Rounding to a format: to nearest (ties to even) or stochastically, saturating.

:func:`round_to_format` rounds to nearest, ties to the code with an even mantissa LSB, with
subnormals, and *saturating*: anything beyond ``max_value`` (``inf`` included) becomes
``+-max_value``, as the hardware's "satfinite" conversions do; NaN stays NaN. FP8 uses torch's
``float8_e4m3fn`` / ``float8_e5m2`` casts after a clamp (torch's e5m2 cast overflows to inf).
FP6 and FP4 have no torch dtype, so they are done with quantum arithmetic: for ``|x|`` in binade
``[2^k, 2^(k+1))`` the spacing is ``q = 2^(max(k, 1 - b) - M)`` and ``round(x / q) * q`` with
``torch.round`` (half to even) is exact in fp32, because ``q`` is a power of two; within a
binade the multiples of ``q`` are the codes, and a binade starts at an even code.

Stochastic rounding (``rounding="stochastic"``) rounds ``|x|`` up to the next code with
probability ``(|x| - lo) / q`` and down to ``lo`` otherwise, so ``E[Q(x)] = x`` inside the range
(saturation stays deterministic). The uniforms come from a generator seeded with the call's
``seed`` alone (:func:`sr_seed` mixes a step, a unit and a role into one), never from torch's
global generator: every rank that rounds the same values with the same seed draws the same bits,
a resumed run draws what the uninterrupted one drew, and the data loader's random stream is
never touched. Up-or-down is decided as ``u < frac`` on the exact fraction, so the only bias is
the 2^-24 grid of ``u`` (``docs/backends.md#number-formats``).
"""

from __future__ import annotations

import math

import torch

from gnmr_dist.backends.numerics.formats import FloatFormat, get_format

__all__ = ["ROUNDINGS", "is_stochastic", "round_to_format", "sr_seed"]

ROUNDINGS = ("nearest", "stochastic")
"""Round to nearest (ties to even), or stochastically (unbiased; gradients)."""


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


def is_stochastic(rounding: str, seed: int | None, fmt: FloatFormat) -> bool:
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
    stochastic = is_stochastic(rounding, seed, fmt)
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
