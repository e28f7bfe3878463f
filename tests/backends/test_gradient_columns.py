"""``scale_gradient_columns``: a GEMM on a reparametrized weight ``W D^-1`` (its input ``x D``)
has its error score taken on the trained weight's gradient, so a per-channel scale moved from
the weight to the input raises ``B(u)`` only by the rounding damage it does, not by its size."""

from __future__ import annotations

import torch
from torch import nn

from gnmr_dist.backends import PrecisionBackend, get_backend

TENSOR_E4M3 = {"format": "e4m3", "granularity": "tensor"}


def scaled_step(
    backend: PrecisionBackend, f: float, columns: bool, recovered: bool = False
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of a 64 -> 32 linear under ``backend`` whose input channel 5 is scaled by ``f``
    and its weight column 5 by ``1 / f`` inside the GEMM (with the backend told, or not):
    ``(B(u), x, D, dy)``, the score, the input before scaling, the scale and the output's
    gradient."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    backend.wrap({0: lin})
    backend.track_errors(1)
    backend.apply([0] if recovered else [], 1)
    gemm = backend.make_gemm(lin, "recovery" if recovered else "low_cost")
    x = torch.randn(256, 64) * 0.3
    d = torch.ones(64)
    d[5] = f
    if columns:
        backend.scale_gradient_columns(lin, d.reciprocal())
    backend._unit = 0  # as the switched forward sets it for the unit it runs
    y = gemm(x * d, lin.weight / d, None)
    backend._unit = None
    backend.scale_gradient_columns(lin, None)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    sums = backend.error_sums(torch.device("cpu"))
    assert sums is not None
    return float(sums[0]), x, d, dy


def _bound(f: float, columns: bool, recovered: bool = False) -> float:
    """``B(u)`` of :func:`scaled_step` under the emulated backend (E4M3, tensorwise)."""
    backend = get_backend("fp8_emulated", low_cost=TENSOR_E4M3, recovery={"format": "bf16"})
    return scaled_step(backend, f, columns, recovered)[0]


def test_the_bound_is_taken_on_the_trained_weights_gradient():
    base = _bound(1.0, columns=False)
    assert _bound(1.0, columns=True) == base  # D = 1: nothing moves
    told, untold = _bound(2.0**6, columns=True), _bound(2.0**6, columns=False)
    assert abs(told / base - 1) < 0.1 < untold / base - 1  # the scale alone does not count
    assert _bound(2.0**20, columns=True) > 5 * base  # past e4m3's range: real damage counts


def test_a_recovered_unit_is_scored_in_shadow_on_the_same_gradient():
    assert _bound(2.0**6, columns=True, recovered=True) < 1.1 * _bound(1.0, columns=False)
