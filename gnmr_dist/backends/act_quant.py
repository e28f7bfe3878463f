"""``act_quant``: projections save their input activation for backward at k bits.

A linear layer ``y = x W^T + b`` needs, for its backward, ``W`` (for ``dx = dy W``) and the
input ``x`` (for ``dW = dy^T x``). ``W`` is a parameter that exists anyway; ``x`` is an extra
``tokens x in_features`` tensor per projection kept alive from the forward to the backward, and at
long sequence lengths these saved activations dominate training memory. This backend computes
the forward in full precision, but stores ``x`` for the backward compressed to ``k`` bits:

    per group of ``group_size`` consecutive values along the feature dim:
        lo = min(x_g),  scale = (max(x_g) - lo) / (2^k - 1)
        code = round((x_g - lo) / scale)  in [0, 2^k - 1]        (round half to even)
    backward:  x_hat = lo + scale * code;   dW = dy^T x_hat;   dx = dy W   (exact)

Only the weight gradient sees the quantization error, bounded by ``scale / 2`` per element. Codes
are stored packed (two 4-bit or four 2-bit codes per byte) next to two fp32 numbers per group, so
at k = 4 and 128-element groups a saved activation takes 0.5625 bytes per element against 2 for
bf16: the saving is real memory, measured in ``benchmarks/act_memory.py``. The low-cost path is
4 bits (the seed's first experiment); recovery is 8 bits, 16 (bf16) or 32 (unchanged).

Projections that read the same input (q/k/v, gate/up) share one packed copy, as they share one
saved tensor without the backend. Coarser groups and fewer bits make the low-cost path worse:
``group_size`` and ``bits`` are the stress knobs of the activation-quantization experiment.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.base import LOW_COST, PrecisionBackend
from gnmr_dist.backends.options import parse_options

__all__ = ["ActQuantBackend", "ActQuantOptions", "PackedActivation", "pack", "unpack"]

_BITS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ActQuantOptions:
    """How one path stores a projection's input for backward."""

    bits: int = 4
    """Bits per saved value: 2, 4 or 8 (quantized), 16 (bf16) or 32 (unchanged)."""
    group_size: int = 128
    """Values sharing one (min, scale) pair, along the feature dim; must be a multiple of 8."""

    def __post_init__(self) -> None:
        if self.bits not in _BITS:
            raise ValueError(f"bits must be one of {list(_BITS)}, got {self.bits!r}")
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or gs < 8 or gs % 8:
            raise ValueError(f"group_size must be a multiple of 8 and >= 8, got {gs!r}")


@dataclass(frozen=True)
class PackedActivation:
    """A tensor stored at ``bits`` bits: packed codes plus per-group minimum and scale."""

    codes: torch.Tensor
    """uint8 [rows, groups, group_size * bits / 8] (or the raw tensor for 16/32 bits)."""
    lo: torch.Tensor | None
    """fp32 [rows, groups, 1]: minimum of each group."""
    scale: torch.Tensor | None
    """fp32 [rows, groups, 1]: step of each group."""
    shape: torch.Size
    """Shape of the original tensor."""
    dtype: torch.dtype
    """dtype of the original tensor (restored by :func:`unpack`)."""
    bits: int

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.lo, self.scale) if t is not None]


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, groups, group_size] view of ``x`` (last dim zero-padded to a whole group)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    pad = (-rows.shape[1]) % group_size
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, group_size)


def pack(x: torch.Tensor, bits: int, group_size: int) -> PackedActivation:
    """Compress ``x`` to ``bits`` bits per value with per-group min/scale (see module doc)."""
    if bits == 32:
        return PackedActivation(x, None, None, x.shape, x.dtype, bits)
    if bits == 16:
        return PackedActivation(x.to(torch.bfloat16), None, None, x.shape, x.dtype, bits)
    g = _grouped(x, group_size)
    lo = g.amin(dim=-1, keepdim=True)
    span = g.amax(dim=-1, keepdim=True) - lo
    levels = (1 << bits) - 1
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    codes = torch.round((g - lo) / scale).clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    packed = (codes << shifts).sum(dim=-1, dtype=torch.uint8)
    return PackedActivation(packed, lo, scale, x.shape, x.dtype, bits)


def unpack(p: PackedActivation) -> torch.Tensor:
    """The dequantized tensor ``lo + scale * code`` in the original shape and dtype."""
    if p.lo is None or p.scale is None:
        return p.codes.to(p.dtype)
    shifts = torch.arange(0, 8, p.bits, dtype=torch.uint8, device=p.codes.device)
    mask = (1 << p.bits) - 1
    codes = (p.codes.unsqueeze(-1) >> shifts) & mask
    g = p.lo + p.scale * codes.reshape(*p.codes.shape[:-1], -1).float()
    features = p.shape[-1]
    return g.reshape(g.shape[0], -1)[:, :features].reshape(p.shape).to(p.dtype)


class ActQuantLinearFn(torch.autograd.Function):
    """``F.linear`` whose input is saved for backward at k bits (weight gradient only)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: PackedActivation,
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, *packed.tensors())
        ctx.packed_meta = (packed.shape, packed.dtype, packed.bits, packed.lo is not None)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, *saved = ctx.saved_tensors
        shape, dtype, bits, quantized = ctx.packed_meta
        lo, scale = (saved[1], saved[2]) if quantized else (None, None)
        x_hat = unpack(PackedActivation(saved[0], lo, scale, shape, dtype, bits))
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy2.mm(weight.to(dy2.dtype)).reshape(*dy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(x_hat.reshape(-1, x_hat.shape[-1]).to(dy2.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0)
        return dx, dw, db, None


def act_quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    options: ActQuantOptions,
    packed: PackedActivation | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` saving ``x`` for backward as ``options`` says.

    ``packed`` is ``x`` already packed with ``options`` (projections that share an input).
    """
    if packed is None:
        packed = pack(x.detach(), options.bits, options.group_size)
    return ActQuantLinearFn.apply(x, weight, bias, packed)  # type: ignore[no-any-return]


class ActQuantBackend(PrecisionBackend):
    """4-bit saved activations on the low-cost path, 8 (or 16/32) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks with ``bits`` and ``group_size``
    (defaults ``{"bits": 4, "group_size": 128}`` and ``{"bits": 8, "group_size": 128}``).
    """

    name = "act_quant"

    def __init__(
        self, *, low_cost: dict[str, Any] | None = None, recovery: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.low_cost = parse_options(ActQuantOptions, low_cost, "gnmr.low_cost")
        rec = {"bits": 8, **(recovery or {})}
        self.recovery = parse_options(ActQuantOptions, rec, "gnmr.recovery")
        self._last_pack: tuple[Any, int, Any, Any] = (None, 0, None, None)

    def _gemm_fn(self, op: nn.Module, path: str) -> Any:
        options = self.low_cost if path == LOW_COST else self.recovery

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return act_quant_linear(x, weight, bias, options, self._shared_pack(x, options))

        return gemm

    def _shared_pack(self, x: torch.Tensor, options: ActQuantOptions) -> PackedActivation:
        """Pack ``x`` once for consecutive projections of the same input (q/k/v, gate/up).

        One slot, keyed on the tensor's identity (a weak reference, so a freed tensor whose
        memory is reused never matches) and its in-place version counter.
        """
        ref, version, opts, packed = self._last_pack
        if ref is not None and ref() is x and version == x._version and opts == options:
            return packed  # type: ignore[no-any-return]
        packed = pack(x.detach(), options.bits, options.group_size)
        self._last_pack = (weakref.ref(x), x._version, options, packed)
        return packed
