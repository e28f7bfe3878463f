"""``int8``: a W8A8 integer path for frozen base weights (the LoRA fine-tuning experiment).

In LoRA fine-tuning the base weights ``W`` are frozen: only the small adapters ``A`` and ``B`` of
``y = x W^T + b + s * (x A^T) B^T`` train. A frozen ``W`` can be quantized once and reused for
every step, which makes an integer GEMM the natural low-cost path for the base product, while
the adapters (peft's own forward) stay in high precision on both paths.

Symmetric int8, the two operands of ``x W^T`` (``x``: tokens x K, ``W``: N x K)::

    s_w[n] = max_k |W[n, k]| / 127        W_q = clamp(round(W / s_w), -127, 127)   (per row)
    s_x[m] = max_k |x[m, k]| / 127        x_q = clamp(round(x / s_x), -127, 127)   (per token)
    acc    = x_q @ W_q^T                  int32, exact
    y      = acc * (s_x s_w^T) + b        the outer product of the scales, in fp32

Scales follow the reduction axis, so each factors out of the integer sum; ``|acc| <= K * 127^2``
fits int32 up to K = 133,144. The integer GEMM is ``torch._int_mm`` where it applies and is
exact (a CPU's is checked once per process: :func:`int_mm_is_exact_on_cpu`), else an exact
float64 emulation of the integer product.

Backward (:class:`W8A8LinearFn`): ``dx = dy @ dequant(W_q)`` in fp32 (straight-through); a
trainable weight gets ``dW = dy^T x`` in high precision. Recovery runs the module in BF16
(``{"dtype": "bf16"}``) or its own ``F.linear`` (``{"dtype": "fp32"}``, bit-identical to the
unwrapped module). The int8 weight is cached per module and re-quantized when the weight's
identity changes (``data_ptr``, version counter, dtype, shape); writes through ``.data`` are not
seen: call :meth:`Int8Backend.invalidate`. The error score is ``||dy||_F ||x - dequant(x_q)||_F``
per GEMM, measured in shadow on the recovery path. Why each choice, the CPU check and the costs:
``docs/backends.md#inside-int8``.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.base import RECOVERY, PrecisionBackend
from gnmr_dist.backends.error_sums import GemmProbe, frobenius
from gnmr_dist.backends.gemms import ALL_GEMMS, subset_error
from gnmr_dist.backends.registry import register_backend
from gnmr_dist.core.validation import check_choice

__all__ = [
    "Int8Backend",
    "Int8LowCost",
    "Int8Recovery",
    "W8A8LinearFn",
    "dequantize",
    "int8_gemm",
    "int_mm_is_exact_on_cpu",
    "quantize_symmetric",
]

logger = logging.getLogger(__name__)

QMAX = 127
"""Largest int8 code; the grid is symmetric, [-127, 127]."""
INT32_SAFE_K = (2**31 - 1) // (QMAX * QMAX)
"""Largest reduction length whose int8 x int8 sum cannot overflow int32 (133,144)."""

_PER_ROW = ("row", "token")
_WEIGHT_GRANULARITIES = ("row", "tensor")
_ACT_GRANULARITIES = ("token", "tensor")
_RECOVERY_DTYPES = ("bf16", "fp32")

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Int8LowCost:
    """Options of the low-cost (W8A8) path."""

    weight_granularity: str = "row"
    """Weight scales: ``"row"`` (one per output feature) or ``"tensor"`` (one per matrix)."""
    act_granularity: str = "token"
    """Activation scales: ``"token"`` (one per row of the flattened input) or ``"tensor"``."""

    def __post_init__(self) -> None:
        check_choice(self.weight_granularity, _WEIGHT_GRANULARITIES, "weight_granularity")
        check_choice(self.act_granularity, _ACT_GRANULARITIES, "act_granularity")


@dataclass(frozen=True)
class Int8Recovery:
    """Options of the recovery path."""

    dtype: str = "bf16"
    """``"bf16"``: the module computed in BF16; ``"fp32"``: the module's own forward."""

    def __post_init__(self) -> None:
        check_choice(self.dtype, _RECOVERY_DTYPES, "dtype")


# ---------------------------------------------------------------------------- int8 maths


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: scales and dequantized values never lose precision."""
    return torch.promote_types(dtype, torch.float32)


def quantize_symmetric(t: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of a 2-D tensor and their scales: ``t ~= q * scale``.

    ``granularity``: ``"row"``/``"token"`` gives one scale per row (shape ``[rows, 1]``),
    ``"tensor"`` one scale (``[1, 1]``). ``scale = amax / 127`` in fp32 (fp64 for fp64 input);
    an all-zero row gets scale 1 and codes 0. ``|t - q * scale| <= scale / 2`` elementwise.
    """
    t = t.to(_compute_dtype(t.dtype))
    mag = t.abs()
    amax = mag.amax(dim=1, keepdim=True) if granularity in _PER_ROW else mag.amax().reshape(1, 1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(t / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in the scale's dtype."""
    return q.to(scale.dtype) * scale


def _int_mm_fits(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether ``torch._int_mm`` computes an (m x k) @ (k x n) product exactly on ``device``."""
    if k > INT32_SAFE_K:
        return False
    if device.type == "cpu":
        return int_mm_is_exact_on_cpu()
    return device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0


@functools.cache
def int_mm_is_exact_on_cpu() -> bool:
    """Whether this CPU's ``torch._int_mm`` returns the exact integer product (once a process).

    The check multiplies codes of magnitude up to 127 with mixed signs, which a kernel that
    saturates its int16 pair sums gets wrong (module docstring); a CPU that fails it runs the
    exact emulation, and the first such GEMM logs why, once.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-QMAX, QMAX + 1, (17, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-QMAX, QMAX + 1, (24, 64), dtype=torch.int8, generator=gen)
    a[0], b[0] = QMAX, QMAX  # the largest pair sums
    exact = torch.equal(torch._int_mm(a, b.t()), _emulated_gemm(a, b))
    if not exact:
        logger.warning(
            "int8: torch._int_mm is not exact on this CPU (oneDNN's int8 GEMM without VNNI "
            "saturates its int16 pair sums); the integer GEMM runs as an exact float64 emulation"
        )
    return exact


def _emulated_gemm(a_q: torch.Tensor, b_q: torch.Tensor) -> torch.Tensor:
    """``a_q @ b_q^T`` through float64, exact (see the module docstring); int32 when it fits."""
    exact = a_q.to(torch.float64) @ b_q.to(torch.float64).t()
    return exact.to(torch.int32 if a_q.shape[1] <= INT32_SAFE_K else torch.int64)


def int8_gemm(a_q: torch.Tensor, b_q: torch.Tensor) -> torch.Tensor:
    """Exact integer product ``a_q @ b_q^T`` of int8 ``[M, K]`` and ``[N, K]`` matrices."""
    (m, k), n = a_q.shape, b_q.shape[0]
    if _int_mm_fits(a_q.device, m, k, n):
        return torch._int_mm(a_q, b_q.t())
    return _emulated_gemm(a_q, b_q)


class W8A8LinearFn(torch.autograd.Function):
    """``y = dequant(quantize(x) @ W_q^T) + b`` with a high-precision backward.

    ``w_q, w_scale`` are the weight's codes and scales (``[N, K]``, ``[N, 1]`` or ``[1, 1]``);
    ``quantize`` maps the flattened input to ``(codes, scales)`` and ``gemm`` multiplies codes
    (:func:`quantize_symmetric`, :func:`int8_gemm`; identity functions turn the quantization off,
    which is how the calculus is checked with ``gradcheck``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        w_q: torch.Tensor,
        w_scale: torch.Tensor,
        quantize: Quantizer,
        gemm: Gemm,
        probe: GemmProbe | None = None,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_q, x_scale = quantize(x2)
        if probe is not None:
            probe.x_err = frobenius(x2.to(x_scale.dtype) - dequantize(x_q, x_scale))
        ctx.probe = probe
        y = gemm(x_q, w_q).to(x_scale.dtype) * (x_scale * w_scale.t())
        if bias is not None:
            y = y + bias.to(y.dtype)
        keep_x = x if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(w_q, w_scale, keep_x)
        ctx.meta = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], w_q.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w_q, w_scale, x = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        dy2 = dy.reshape(-1, dy.shape[-1]).to(w_scale.dtype)
        if ctx.probe is not None:
            ctx.probe.record(frobenius(dy2))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ dequantize(w_q, w_scale)).reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy2.dtype)).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


# ---------------------------------------------------------------------------- modules


def _is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: peft's ``LoraLayer`` if peft is loaded, else ``base_layer`` + ``lora_A``.

    peft is never imported here: a model holding peft layers has loaded it already.
    """
    lora = sys.modules.get("peft.tuners.lora")
    if lora is not None and hasattr(lora, "LoraLayer"):
        return isinstance(module, lora.LoraLayer)
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _as_linear(module: nn.Module) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"int8 switches nn.Linear forwards only, got {type(module).__name__}")
    return module


def _base_of(module: nn.Module) -> nn.Module:
    """The module a LoRA layer wraps, or ``module`` itself."""
    base = module.base_layer if _is_lora_layer(module) else module
    return base if isinstance(base, nn.Module) else module


class _WeightCache:
    """The int8 codes of ``module.weight``, re-quantized only when the weight changes.

    The weight is recognised by identity (a weak reference: a freed tensor never matches),
    storage address, device and in-place version counter.
    """

    def __init__(self, module: nn.Linear, granularity: str) -> None:
        self._module = module
        self._granularity = granularity
        self._ref: Callable[[], torch.Tensor | None] = lambda: None
        self._key: tuple[Any, ...] = ()
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)`` of the weight as it is now."""
        w = self._module.weight
        key = (w.data_ptr(), w.device, w._version)
        if self._value is None or self._ref() is not w or key != self._key:
            with torch.no_grad():
                self._value = quantize_symmetric(w.detach(), self._granularity)
            self._ref, self._key = weakref.ref(w), key
            logger.debug("int8: quantized a %s weight", tuple(w.shape))
        return self._value

    def clear(self) -> None:
        """Forget the codes; the next :meth:`get` re-quantizes."""
        self._value = None


def _bf16_linear(op: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``op`` computed in BF16: inputs, weight and bias cast to bf16, output to ``x.dtype``."""
    bias = None if op.bias is None else op.bias.to(torch.bfloat16)
    y = F.linear(x.to(torch.bfloat16), op.weight.to(torch.bfloat16), bias)
    return y.to(x.dtype)


@register_backend("int8")
class Int8Backend(PrecisionBackend):
    """W8A8 int8 base projections on the low-cost path, BF16 (or the module's own) on recovery.

    Wraps ``nn.Linear`` operators and peft LoRA ``Linear`` layers; of the latter only the frozen
    ``base_layer`` is switched, the adapters run peft's own high-precision forward. Options:
    ``low_cost={"weight_granularity": "row"|"tensor", "act_granularity": "token"|"tensor"}``,
    ``recovery={"dtype": "bf16"|"fp32"}``.

    ``"gnmr"``::

        {"backend": "int8", "low_cost": {"act_granularity": "token"}, "recovery": {"dtype": "bf16"}}
    """

    reports_errors = True
    LowCost = Int8LowCost
    Recovery = Int8Recovery
    low_cost: Int8LowCost
    recovery: Int8Recovery

    def __init__(self, **blocks: Any) -> None:
        super().__init__(**blocks)
        self._caches: list[_WeightCache] = []
        logger.info("int8 backend: low_cost=%s recovery=%s", self.low_cost, self.recovery)

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """All three GEMMs only: the low-cost path is one W8A8 function whose dgrad reuses its
        forward's int8 weight, the recovery path the module's own BF16 (or fp32) forward."""
        if gemms != ALL_GEMMS:
            raise subset_error(
                self.name,
                gemms,
                "its low-cost path is one W8A8 autograd function (fprop on int8 codes, dgrad on "
                "the forward's int8 weight, wgrad in high precision) and its recovery path the "
                "module's own BF16 or fp32 forward, so its GEMMs do not switch one at a time",
            )

    def supports(self, module: nn.Module) -> bool:
        """``nn.Linear`` with a floating weight, or a peft LoRA layer around one."""
        base = _base_of(module)
        return isinstance(base, nn.Linear) and base.weight.is_floating_point()

    def targets(self, op: nn.Module) -> list[nn.Module]:
        """``[op.base_layer]`` for a LoRA layer (its frozen base only), else ``[op]``."""
        return [_base_of(op)]

    def invalidate(self) -> None:
        """Drop every cached int8 weight (after writing weights through ``.data``)."""
        for cache in self._caches:
            cache.clear()

    def unwrap(self) -> None:
        """Remove the installed forwards and the cached int8 weights."""
        super().unwrap()
        self._caches.clear()

    def make_forward(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        lin = _as_linear(op)
        if path == RECOVERY:
            return self._recovery_forward(lin)
        cache = _WeightCache(lin, self.low_cost.weight_granularity)
        self._caches.append(cache)
        act = self.low_cost.act_granularity

        def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_symmetric(t, act)

        def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature
            w_q, w_scale = cache.get()
            probe = None
            if input.requires_grad or lin.weight.requires_grad:
                probe = self._error_probe()
            args = (input, lin.weight, lin.bias, w_q, w_scale, quantize, int8_gemm, probe)
            return W8A8LinearFn.apply(*args)  # type: ignore[no-untyped-call, no-any-return]

        return forward

    def _recovery_forward(self, lin: nn.Linear) -> Callable[..., torch.Tensor]:
        """BF16 (or the module's own) forward, measuring the low-cost error in shadow."""
        act = self.low_cost.act_granularity

        def forward(input: torch.Tensor) -> torch.Tensor:
            if self.recovery.dtype == "bf16":
                y = _bf16_linear(lin, input)
            else:
                y = F.linear(input, lin.weight, lin.bias)
            probe = self._error_probe() if y.requires_grad else None
            if probe is not None:
                x2 = input.detach().reshape(-1, input.shape[-1])
                x_q, x_scale = quantize_symmetric(x2, act)
                probe.x_err = frobenius(x2.to(x_scale.dtype) - dequantize(x_q, x_scale))
                probe.record_output_grad(y)
            return y

        return forward
