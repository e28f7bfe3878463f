"""The random Hadamard transform of the FP4 weight-gradient GEMM's inputs.

A few large entries set a block's scale and push its other entries to 0 or 0.5. NVIDIA
(arXiv 2509.25149) therefore rotates both inputs of the weight-gradient GEMM along its reduction
dimension (the tokens) before quantizing them (:func:`hadamard_rotate`): in blocks of 16 rows,
``x -> H D x`` with ``H`` the 16 x 16 Sylvester-Hadamard matrix divided by 4 (orthonormal) and
``D`` a fixed diagonal of random signs. The rotation spreads an outlier over the block, and
since ``(H D)^T (H D) = I`` the GEMM of the rotated operands is the GEMM of the originals:
``(H D dy)^T (H D x) = dy^T x``. A ragged last block is zero-padded (the padded rows add
nothing to the product), so the rotated tensor is a multiple of 16 long.
"""

from __future__ import annotations

import math

import torch

__all__ = ["HADAMARD_SIZE", "hadamard_rotate"]

HADAMARD_SIZE = 16
"""Rows per block of the random Hadamard transform."""

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
