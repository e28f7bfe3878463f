"""The harness's own forwards of a backend's operators: function-preserving outliers
(:class:`benchmarks.harness.arms.Outlier`) and TE AutoswitchGemm's rule
(:mod:`benchmarks.harness.autoswitch`).

Both act through the backend's documented extension point, ``make_forward(op, path)`` (the
forward installed on each operator for each path, ``gnmr_dist.backends.base``), overridden on
the arm's backend instance before it wraps the model: the outlier moves a channel's scale from
``W`` to ``x`` on the GEMM's inputs, ``y = (x D)(W D^-1)^T + b``, and the GEMM (the path's own,
or the rule's) rounds what it is given. The trained parameter stays ``W``, so the backend takes
the error score of the GEMM on ``W``'s gradient (``scale_gradient_columns``, which
``fp8_emulated`` and ``torchao_fp8`` have): the outlier's scale alone must not raise ``B(u)``,
only the damage it does.
A gradient-visible outlier (:mod:`benchmarks.harness.fault_shapes`) hands ``W`` the gradient
of ``V = W D^-1`` instead, and the error score is taken on it as the GEMM computes it.

``gemm_dtype`` (:attr:`benchmarks.harness.arms.Arm.gemm_dtype`) runs every GEMM on operands cast
to that dtype and casts its output back, as a model whose linears compute in BF16 hands them
(FSDP2's ``param_dtype``): the ``torchao_fp8`` regimes' paths are then ``Float8Linear`` and
``nn.Linear`` of a BF16 model, so their recovery path is a real BF16 GEMM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from benchmarks.harness.arms import Outlier
from benchmarks.harness.autoswitch import GemmLedger, Switch
from benchmarks.harness.fault_shapes import PassGradient
from gnmr_dist.backends.base import RECOVERY
from gnmr_dist.backends.emulated import EmulatedBackend
from gnmr_dist.backends.operators import Gemm
from gnmr_dist.distributed import UnitRegistry

__all__ = ["GEMM_DTYPES", "AutoswitchGemms", "install_forwards"]


class AutoswitchGemms:
    """Makes each operator's GEMM run TE AutoswitchGemm's rule (:class:`Switch`) on the
    backend's two specs. ``decide``: the rule switches each GEMM itself (TE's form); else the
    plan does (a recovered unit runs all three GEMMs high) and the rule only scores."""

    def __init__(self, backend: EmulatedBackend, registry: UnitRegistry, decide: bool) -> None:
        self.backend, self.decide = backend, decide
        self.ledger = GemmLedger(registry.num_units)
        self.place = {
            id(m): (uid, i)
            for uid, unit in registry.local_modules.items()
            for i, m in enumerate(unit.modules())
        }
        """``id(module) -> (unit, index in the unit)``: the stochastic-rounding key's parts, the
        same in every process (no address enters a seed)."""
        self.calls: dict[int, int] = {}
        self.step = 0

    def new_step(self, step: int) -> None:
        """Reset the ledger and the call counts for optimizer step ``step``."""
        self.ledger.reset()
        self.calls, self.step = {}, step

    def gemm(self, op: nn.Module, path: str) -> Gemm:
        """``(x, W, b) -> y`` of ``op`` on ``path`` under the rule."""
        backend, (uid, index) = self.backend, self.place[id(op)]
        low, high = backend.specs["low_cost"], backend.specs[RECOVERY]
        scales = backend.delayed_scales(op)

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            # the call's number in the step: an operator run twice in one step (the probe's passes)
            # draws fresh rounding each time
            n = self.calls.get(id(op), 0)
            self.calls[id(op)] = n + 1
            key = (self.step, uid, index, n, 0)  # the backend's key; 0: not a measuring pass
            # a unit the plan put on recovery runs all three GEMMs high; the rule still scores them
            forced = path == RECOVERY
            sw = Switch(low, high, scales, self.ledger, uid, self.decide, forced, key)
            return sw(x, weight, bias)

        return gemm


GEMM_DTYPES = {"bf16": torch.bfloat16}
"""``Arm.gemm_dtype`` names -> the dtype a linear's GEMM operands are cast to."""


def install_forwards(
    backend: Any,
    model: nn.Module,
    outliers: Sequence[Outlier],
    step: Callable[[], int],
    gemms: AutoswitchGemms | None = None,
    gemm_dtype: str | None = None,
) -> None:
    """Before ``backend.wrap``: every operator's forward runs ``gemms``' GEMM (default the
    backend's own), on operands cast to ``gemm_dtype`` (output cast back) when given, and, for
    a faulted operator while ``model.training`` and inside its window, on ``(x D, W D^-1)``
    (:class:`Outlier`). Nothing is overridden when there is none of the three."""
    if not outliers and gemms is None and gemm_dtype is None:
        return
    if outliers and not hasattr(backend, "scale_gradient_columns"):
        raise ValueError(
            f"outliers run on a backend whose error score can be taken on the trained "
            f"weight's gradient (scale_gradient_columns: fp8_emulated, torchao_fp8); got "
            f"{type(backend).__name__}"
        )
    if gemm_dtype is not None and gemm_dtype not in GEMM_DTYPES:
        raise ValueError(f"gemm_dtype must be one of {sorted(GEMM_DTYPES)}, got {gemm_dtype!r}")
    dtype = GEMM_DTYPES[gemm_dtype] if gemm_dtype is not None else None
    modules = dict(model.named_modules())
    for o in outliers:
        if o.module not in modules:
            raise ValueError(f"outlier module {o.module!r} is not in the model")
    faulted = {id(modules[o.module]): o for o in outliers}

    def make_forward(op: nn.Module, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
        gemm = gemms.gemm(op, path) if gemms is not None else backend.make_gemm(op, path)
        linear, outlier = cast(nn.Linear, op), faulted.get(id(op))

        def forward(input: torch.Tensor) -> torch.Tensor:
            x, weight, bias = input, linear.weight, linear.bias
            if dtype is not None:  # the model's linears compute in dtype
                x, weight = x.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
            # training passes only: evaluations measure the weights, as with the injected faults
            f = outlier.factor(step()) if outlier is not None and model.training else None
            if f is None:
                y = gemm(x, weight, bias)
                return y if dtype is None else y.to(input.dtype)
            d = _scale_vector(x.shape[-1], outlier.channel, f, x)  # type: ignore[union-attr]
            if getattr(outlier, "visible", False):  # W.grad and B(u) are V = W D^-1's
                v = PassGradient.apply(weight, d)  # type: ignore[no-untyped-call]
                y = gemm(x * d, v, bias)
                return y if dtype is None else y.to(input.dtype)
            backend.scale_gradient_columns(op, d.reciprocal())  # B(u) of W's own gradient
            # reset even if the GEMM raises: a scale left set would skew the next call's error score
            try:
                y = gemm(x * d, weight / d, bias)
            finally:
                backend.scale_gradient_columns(op, None)
            return y if dtype is None else y.to(input.dtype)

        return forward

    backend.make_forward = make_forward  # the instance's own, as the backend's docs allow


def _scale_vector(width: int, channel: int | None, f: float, like: torch.Tensor) -> torch.Tensor:
    """``D``'s diagonal: ``f`` at ``channel`` (every feature when ``None``), 1 elsewhere."""
    if channel is None:
        return torch.full((width,), f, dtype=like.dtype, device=like.device)
    d = torch.ones(width, dtype=like.dtype, device=like.device)
    d[channel] = f
    return d
