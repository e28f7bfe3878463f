"""A precision backend written outside ``gnmr_dist``, through the public API only.

It stands for a user's package: importing this module registers ``test_rounded`` (the
training script imports it before the engine is built), and nothing inside ``gnmr_dist`` names it.
The low-cost path rounds the weight and the input of each GEMM to ``mantissa_bits`` bits of
mantissa (a straight-through estimator: the backward sees the rounded operands' GEMM as
identity-rounded); the recovery path is the module's own precision. Every call is counted per path,
so the tests see that this class, and not a built-in, ran each forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import LOW_COST, Gemm, PrecisionBackend, register_backend

CALLS: Counter[str] = Counter()
"""``path -> GEMM calls`` in this process, over every instance."""


@dataclass(frozen=True)
class Rounding:
    """``gnmr.low_cost`` of ``test_rounded``."""

    mantissa_bits: int = 3
    """Bits of mantissa kept (fp32 keeps 23)."""

    def __post_init__(self) -> None:
        if not 0 < self.mantissa_bits < 23:
            raise ValueError(f"mantissa_bits must be in 1..22, got {self.mantissa_bits!r}")


@dataclass(frozen=True)
class Exact:
    """``gnmr.recovery`` of ``test_rounded``: no options."""


def round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` rounded to ``bits`` mantissa bits (round half away from zero), value-identical
    gradient (straight-through)."""
    mantissa, exponent = torch.frexp(t.detach().float())
    scale = 2.0**bits
    rounded = torch.ldexp(torch.round(mantissa * scale) / scale, exponent).to(t.dtype)
    return t + (rounded - t).detach()


@register_backend("test_rounded")
class RoundedBackend(PrecisionBackend):
    """Mantissa-rounded GEMM operands on the low-cost path, exact on recovery.

    ``"gnmr"``::

        {"backend": "test_rounded", "low_cost": {"mantissa_bits": 3}}
    """

    LowCost = Rounding
    Recovery = Exact
    adapted_gemms = True  # the GEMM is right on a tensor-parallel shard: it is elementwise

    def make_gemm(self, op: nn.Module, path: str) -> Gemm:
        bits = self.low_cost.mantissa_bits if path == LOW_COST else None

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            CALLS[path] += 1
            if bits is None:
                return F.linear(x, weight, bias)
            return F.linear(round_mantissa(x, bits), round_mantissa(weight, bits), bias)

        return gemm
