"""The harness's own forwards of a backend's operators: function-preserving outliers
(:class:`benchmarks.harness.arms.Outlier`) and TE AutoswitchGemm's rule
(:mod:`benchmarks.harness.autoswitch`).

Both act through the backend's documented extension point, ``make_forward(op, path)`` (the
forward installed on each operator for each path, ``gnmr_dist.backends.base``), overridden on
the arm's backend instance before it wraps the model: the outlier moves a channel's scale from
``W`` to ``x`` on the GEMM's inputs, ``y = (x D)(W D^-1)^T + b``, and the GEMM (the path's own,
or the rule's) rounds what it is given. The trained parameter stays ``W``, so the backend takes
the error score of the GEMM on ``W``'s gradient (``scale_gradient_columns``): the outlier's
scale alone must not raise ``B(u)``, only the damage it does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from benchmarks.harness.arms import Outlier
from benchmarks.harness.autoswitch import GemmLedger, Switch
from gnmr_dist.backends.base import RECOVERY
from gnmr_dist.backends.emulated import EmulatedBackend
from gnmr_dist.backends.operators import Gemm
from gnmr_dist.distributed import UnitRegistry

__all__ = ["AutoswitchGemms", "install_forwards"]


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
            n = self.calls.get(id(op), 0)
            self.calls[id(op)] = n + 1
            key = (self.step, uid, index, n, 0)  # the backend's key; 0: not a measuring pass
            forced = path == RECOVERY
            sw = Switch(low, high, scales, self.ledger, uid, self.decide, forced, key)
            return sw(x, weight, bias)

        return gemm


def install_forwards(
    backend: Any,
    model: nn.Module,
    outliers: Sequence[Outlier],
    step: Callable[[], int],
    gemms: AutoswitchGemms | None = None,
) -> None:
    """Before ``backend.wrap``: every operator's forward runs ``gemms``' GEMM (default the
    backend's own) and, for a faulted operator while ``model.training`` and inside its window,
    on ``(x D, W D^-1)`` (:class:`Outlier`). Nothing is overridden when there is neither."""
    if not outliers and gemms is None:
        return
    if outliers and not isinstance(backend, EmulatedBackend):
        raise ValueError(
            f"outliers run on fp8_emulated, whose error score can be taken on the trained "
            f"weight's gradient (scale_gradient_columns); got {type(backend).__name__}"
        )
    modules = dict(model.named_modules())
    for o in outliers:
        if o.module not in modules:
            raise ValueError(f"outlier module {o.module!r} is not in the model")
    faulted = {id(modules[o.module]): o for o in outliers}

    def make_forward(op: nn.Module, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
        gemm = gemms.gemm(op, path) if gemms is not None else backend.make_gemm(op, path)
        linear, outlier = cast(nn.Linear, op), faulted.get(id(op))

        def forward(input: torch.Tensor) -> torch.Tensor:
            f = outlier.factor(step()) if outlier is not None and model.training else None
            if f is None:
                return gemm(input, linear.weight, linear.bias)
            d = _scale_vector(input.shape[-1], outlier.channel, f, input)  # type: ignore[union-attr]
            backend.scale_gradient_columns(op, d.reciprocal())  # B(u) of W's own gradient
            try:
                return gemm(input * d, linear.weight / d, linear.bias)
            finally:
                backend.scale_gradient_columns(op, None)

        return forward

    backend.make_forward = make_forward  # the instance's own, as the backend's docs allow


def _scale_vector(width: int, channel: int | None, f: float, like: torch.Tensor) -> torch.Tensor:
    """``D``'s diagonal: ``f`` at ``channel`` (every feature when ``None``), 1 elsewhere."""
    if channel is None:
        return torch.full((width,), f, dtype=like.dtype, device=like.device)
    d = torch.ones(width, dtype=like.dtype, device=like.device)
    d[channel] = f
    return d
