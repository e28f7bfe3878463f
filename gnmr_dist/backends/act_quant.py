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
bf16 (``python -m benchmarks.overhead.act_memory`` measures it). The low-cost path is 4 bits (the
paper's first experiment); recovery is 8 bits, 16 (bf16) or 32 (unchanged). Projections that read
the same input (q/k/v, gate/up) share one packed copy, as they share one saved tensor without
the backend. ``group_size`` and ``bits`` are the stress knobs of the activation experiment.

Error score (``gnmr.gamma``, docs/algorithm.md#damage-term; after ``track_errors``): only the
saved ``x`` is rounded, so per GEMM the backend reports ``||dy||_F ||x - x_hat||_F`` (``x_hat =
unpack(pack(x))`` at the *low-cost* bits), summed into ``B(u)``. ``||x - x_hat||`` is taken in
the forward from the pack's own codes (shared by projections of one input), ``||dy||`` in the
backward. A unit on the recovery path re-quantizes its ``x`` at the low-cost bits once more, only
to measure it (the shadow). No GEMM, no host sync; with tracking off nothing of this runs.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.base import LOW_COST, PrecisionBackend
from gnmr_dist.backends.error_sums import GemmProbe, frobenius
from gnmr_dist.backends.gemms import subset_error
from gnmr_dist.backends.operators import operators_of
from gnmr_dist.backends.registry import register_backend

__all__ = [
    "ActQuantBackend",
    "ActQuantOptions",
    "PackedActivation",
    "pack",
    "quantization_error",
    "unpack",
]

_BITS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ActQuantOptions:
    """How one path stores a projection's input for backward."""

    bits: int = 4
    """Bits per saved value: 2, 4 or 8 (quantized), 16 (bf16) or 32 (unchanged)."""
    group_size: int = 128
    """Values sharing one (min, scale) pair, along the feature dim; must be a multiple of 8."""

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in _BITS:
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
    error: torch.Tensor | None = None
    """0-dim ``||x - unpack(self)||_F`` when packed with ``with_error=True``, else ``None``."""

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.lo, self.scale) if t is not None]


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, groups, group_size] view of ``x`` (last dim zero-padded to a whole group)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    pad = (-rows.shape[1]) % group_size
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, group_size)


def _quantize_groups(
    x: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lo, scale, steps, codes)`` of ``x`` at ``bits`` bits: ``steps = (x_g - lo) / scale``
    and ``codes = round(steps)`` (fp32 integers), both ``[rows, groups, group_size]``."""
    g = _grouped(x, group_size)
    lo = g.amin(dim=-1, keepdim=True)
    span = g.amax(dim=-1, keepdim=True) - lo
    levels = (1 << bits) - 1
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    steps = (g - lo) / scale
    return lo, scale, steps, torch.round(steps).clamp_(0, levels)


def _group_error(
    features: int, scale: torch.Tensor, steps: torch.Tensor, codes: torch.Tensor
) -> torch.Tensor:
    """``||x - (lo + scale * codes)||_F`` as ``||scale_g * ||steps_g - codes_g|| ||`` over groups.

    Two passes over ``x`` (a subtraction, in place on ``steps``, and per-group norms) instead of
    rebuilding ``x_hat``; the zero padding of the last group is left out.
    """
    d = steps.sub_(codes)
    pad = d.shape[1] * d.shape[2] - features
    if pad:
        d[:, -1, d.shape[2] - pad :] = 0
    per_group = torch.linalg.vector_norm(d, dim=-1)
    return frobenius(per_group * scale.squeeze(-1))


def _cast_error(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """``||x - x_hat||_F`` with ``x_hat`` cast back to ``x``'s dtype, as :func:`unpack` does."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return frobenius(x.to(wide) - x_hat.to(x.dtype).to(wide))


def quantization_error(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """0-dim ``||x - unpack(pack(x, bits, group_size))||_F``, without packing anything.

    Exact for fp32 ``x``; below 16 bits the final cast of ``x_hat`` to a narrower ``x`` dtype
    (bf16) is not included.
    """
    if bits == 32:
        return torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    if bits == 16:
        return _cast_error(x, x.to(torch.bfloat16))
    _, scale, steps, codes = _quantize_groups(x, bits, group_size)
    return _group_error(x.shape[-1], scale, steps, codes)


def pack(
    x: torch.Tensor, bits: int, group_size: int, *, with_error: bool = False
) -> PackedActivation:
    """Compress ``x`` to ``bits`` bits per value with per-group min/scale (see module doc).

    ``with_error``: also measure ``||x - unpack(result)||_F`` from the codes (``.error``).
    """
    if bits >= 16:
        error = quantization_error(x, bits, group_size) if with_error else None
        codes = x if bits == 32 else x.to(torch.bfloat16)
        return PackedActivation(codes, None, None, x.shape, x.dtype, bits, error)
    lo, scale, steps, codes_f = _quantize_groups(x, bits, group_size)
    error = _group_error(x.shape[-1], scale, steps, codes_f) if with_error else None
    codes = codes_f.to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    packed = (codes << shifts).sum(dim=-1, dtype=torch.uint8)
    return PackedActivation(packed, lo, scale, x.shape, x.dtype, bits, error)


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
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: PackedActivation,
        probe: GemmProbe | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, *packed.tensors())
        ctx.packed_meta = (packed.shape, packed.dtype, packed.bits, packed.lo is not None)
        ctx.has_bias = bias is not None
        ctx.probe = probe
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
            if ctx.probe is not None:
                ctx.probe.record(frobenius(dy2))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0)
        return dx, dw, db, None, None


def act_quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    options: ActQuantOptions,
    packed: PackedActivation | None = None,
    probe: GemmProbe | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` saving ``x`` for backward as ``options`` says.

    ``packed`` is ``x`` already packed with ``options`` (projections that share an input);
    ``probe`` (its ``x_err`` filled in) receives ``||dy||`` in the weight-gradient backward.
    """
    if packed is None:
        packed = pack(x.detach(), options.bits, options.group_size)
    out: torch.Tensor = ActQuantLinearFn.apply(x, weight, bias, packed, probe)  # type: ignore[no-untyped-call]
    return out


def check_shard_widths(
    options: ActQuantOptions, path: str, widths: Iterable[tuple[int, str, int, int]]
) -> None:
    """Refuse a ``group_size`` that does not divide a tensor-parallel input shard.

    ``widths``: ``(unit, operator type, full input width, this rank's shard width)`` of every
    operator whose input is split over tensor-parallel ranks (megatron's ``RowParallelLinear``).
    Groups run along the feature dim of the tensor the GEMM sees, so in a shard whose width is
    not a multiple of ``group_size`` the last group is padded inside the shard, where at
    tensor-parallel size 1 it would hold the next shard's first features: the saved values,
    and every gradient after them, would depend on the layout. When every shard width is a
    multiple, the shards' groups are exactly the unsharded tensor's, and every layout
    quantizes identically. (Making straddling groups agree would take a collective per GEMM,
    which GNMR does not add; so the layout is refused before anything is wrapped.)
    """
    if options.bits > 8:
        return  # 16 / 32 bits: no groups
    gs = options.group_size
    sharded = [(w, full, uid, kind) for uid, kind, full, w in widths if w < full]
    bad = sorted(x for x in sharded if x[0] % gs)
    if not bad:
        return
    common = math.gcd(*(width for width, *_ in sharded))  # the suggestion must fit them all
    fits = [g for g in range(gs, 7, -8) if common % g == 0]
    fix = f"e.g. {path}.group_size={fits[0]}" if fits else f"{path}.bits=16 (no groups)"
    w, full, uid, kind = bad[0]
    raise ValueError(
        f"{path}.group_size={gs} does not divide the input shard width {w} of unit {uid} "
        f"({kind}: {full} input features over tensor-parallel size {full // w}; "
        f"{len(bad)} operator(s) like it): a group would be padded inside the shard, so the "
        "saved activations and every gradient would differ from the same run at another "
        f"tensor-parallel size. Use a group_size that divides every shard width: {fix}"
    )


@register_backend("act_quant")
class ActQuantBackend(PrecisionBackend):
    """4-bit saved activations on the low-cost path, 8 (or 16/32) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks with ``bits`` and ``group_size``
    (defaults ``{"bits": 4, "group_size": 128}`` and ``{"bits": 8, "group_size": 128}``).

    ``"gnmr"``::

        {"backend": "act_quant", "low_cost": {"bits": 4, "group_size": 128},
         "recovery": {"bits": 8, "group_size": 128}, "max_active": 4}
    """

    reports_errors = True
    adapted_gemms = True
    LowCost = ActQuantOptions
    Recovery = ActQuantOptions
    recovery_defaults: ClassVar[Mapping[str, Any]] = {"bits": 8}
    low_cost: ActQuantOptions
    recovery: ActQuantOptions

    def __init__(self, **blocks: Any) -> None:
        super().__init__(**blocks)
        self._last_pack: tuple[Any, int, Any, Any] = (None, 0, None, None)
        self._last_shadow: tuple[Any, int, Any] = (None, 0, None)

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """A subset holding ``wgrad`` runs exactly what all three do: the paths differ only in
        the saved ``x``, which only wgrad reads (``dW = dy^T x_hat``; fprop and dgrad are exact
        on both). A subset without it would leave the recovered unit on the low-cost path."""
        if "wgrad" not in gemms:
            raise subset_error(
                self.name,
                gemms,
                "its two paths differ only in the x saved for backward, which only the wgrad "
                "GEMM reads (fprop and dgrad are exact on both), so without 'wgrad' a recovered "
                "unit would run exactly the low-cost path",
                "add 'wgrad' (every subset with it recovers what all three do)",
            )

    def wrap(self, units: Mapping[int, nn.Module]) -> None:
        """:meth:`PrecisionBackend.wrap`, after refusing a layout whose groups would depend on
        the tensor-parallel size (:func:`check_shard_widths`)."""
        widths = {  # an adapted operator whose GEMM sees a shard of its input features
            (uid, type(op).__name__, *shard)
            for uid, unit in units.items()
            for _, op in operators_of(unit, self.operator_names())
            if self.supports(op) and (shard := self._input_shard(op)) is not None
        }
        for path, options in (("gnmr.low_cost", self.low_cost), ("gnmr.recovery", self.recovery)):
            check_shard_widths(options, path, widths)
        super().wrap(units)

    def _input_shard(self, op: nn.Module) -> tuple[int, int] | None:
        adapter = self.operators.adapter_of(op)
        return None if adapter is None else adapter.input_widths(op)

    def make_gemm(self, op: nn.Module, path: str) -> Any:
        options = self.low_cost if path == LOW_COST else self.recovery

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            probe = self._error_probe() if weight.requires_grad else None
            packed = self._shared_pack(
                x, options, with_error=probe is not None and path == LOW_COST
            )
            if probe is not None:
                probe.x_err = packed.error if path == LOW_COST else self._shadow_error(x)
            return act_quant_linear(x, weight, bias, options, packed, probe)

        return gemm

    @staticmethod
    def _same(ref: Any, version: int, x: torch.Tensor) -> bool:
        return ref is not None and ref() is x and version == x._version

    def _shared_pack(
        self, x: torch.Tensor, options: ActQuantOptions, with_error: bool = False
    ) -> PackedActivation:
        """Pack ``x`` once for consecutive projections of the same input (q/k/v, gate/up).

        One slot, keyed on the tensor's identity (a weak reference, so a freed tensor whose
        memory is reused never matches) and its in-place version counter; a pack measured
        ``with_error`` serves requests without too.
        """
        ref, version, opts, packed = self._last_pack
        measured = packed is not None and packed.error is not None
        if self._same(ref, version, x) and opts == options and (measured or not with_error):
            return packed  # type: ignore[no-any-return]
        packed = pack(x.detach(), options.bits, options.group_size, with_error=with_error)
        self._last_pack = (weakref.ref(x), x._version, options, packed)
        return packed

    def _shadow_error(self, x: torch.Tensor) -> torch.Tensor:
        """``||x - Q_low(x)||_F`` for a unit on the recovery path, once per shared input."""
        low = self.low_cost
        ref, version, opts, packed = self._last_pack
        if self._same(ref, version, x) and opts == low and packed.error is not None:
            return packed.error  # type: ignore[no-any-return]
        ref, version, error = self._last_shadow
        if self._same(ref, version, x):
            return error  # type: ignore[no-any-return]
        error = quantization_error(x.detach(), low.bits, low.group_size)
        self._last_shadow = (weakref.ref(x), x._version, error)
        return error
