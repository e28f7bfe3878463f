"""What ``torchao_fp8`` takes from torchao: its configs, its FP8 linear, its casts.

Imported by :class:`~gnmr_dist.backends.torchao_fp8.TorchaoFp8Backend` when it is built, never
when the backend is registered, so a host without torchao registers the backend and refuses it
only when a block names it (:func:`load_torchao`).

A linear layer ``y = x W^T + b`` runs three GEMMs, and torchao's ``Float8LinearConfig`` gives
each of its operands a cast of its own (``CastConfig``: dynamic or disabled, tensorwise or
axiswise, the FP8 dtype)::

    fprop  y = x W^T    cast_config_input                  cast_config_weight
    dgrad  dx = dy W    cast_config_grad_output            cast_config_weight_for_grad_input
    wgrad  dW = dy^T x  cast_config_input_for_grad_weight  cast_config_grad_output_for_grad_weight

A disabled pair runs that GEMM in the operands' own precision (``torch.mm``). That is torchao's
per-GEMM configuration, and ``gnmr.gemms`` is built from it (:func:`mixed_config`): the GEMMs a
recovered unit recovers take the recovery path's pair of casts, the others the low-cost path's.

The low-cost GEMM is torchao's own autograd function ``matmul_with_hp_or_float8_args``, called
as ``Float8Linear.forward`` calls it (:func:`float8_linear`): bit for bit a ``Float8Linear``.
The damage term's norms (:func:`wgrad_cast`) come from torchao's own cast,
``hp_tensor_to_float8_dynamic``, with the arguments the wgrad GEMM passes it: the FP8 tensor it
returns is the one the wgrad GEMM multiplies (``tests/backends/test_torchao_fp8.py`` compares
them with the operands the GEMM received).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from gnmr_dist.backends.torchao_options import TorchaoLowCost

__all__ = [
    "CAST_FIELDS",
    "disabled",
    "float8_linear",
    "hp_weight",
    "linear_mm_config",
    "low_cost_config",
    "mixed_config",
    "recipe_config",
    "wgrad_cast",
    "with_float8_all_gather",
]

CAST_FIELDS = {
    "fprop": ("cast_config_input", "cast_config_weight"),
    "dgrad": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
    "wgrad": ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight"),
}
"""GEMM -> the two ``Float8LinearConfig`` casts of its operands."""

GEMM_FIELDS = {
    "fprop": "gemm_config_output",
    "dgrad": "gemm_config_grad_input",
    "wgrad": "gemm_config_grad_weight",
}
"""GEMM -> its ``Float8GemmConfig`` field (fast accumulation)."""


def recipe_config(recipe: str, low: TorchaoLowCost) -> Any:
    """torchao's ``Float8LinearConfig.from_recipe_name(recipe)`` with the block's per-linear
    switches (``pad_inner_dim``, ``emulate``, ``enable_fsdp_float8_all_gather``)."""
    base = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        base,
        pad_inner_dim=low.pad_inner_dim,
        emulate=low.emulate,
        enable_fsdp_float8_all_gather=low.fsdp_float8_all_gather and recipe == "tensorwise",
    )


def low_cost_config(low: TorchaoLowCost) -> Any:
    """The low-cost path's ``Float8LinearConfig``."""
    return recipe_config(low.recipe, low)


def disabled(config: Any) -> Any:
    """``config`` with every cast disabled (each keeps its dtype, which torchao checks across the
    two GEMMs of an operand): torchao's high-precision route, the ``"bf16"`` recovery of a
    GEMM inside a mixed call."""
    off = {
        name: CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=c.target_dtype)
        for name in (f for pair in CAST_FIELDS.values() for f in pair)
        for c in (getattr(config, name),)
    }
    return dataclasses.replace(config, **off)


def mixed_config(low: Any, recovery: Any, gemms: Iterable[str]) -> Any:
    """One ``Float8LinearConfig`` whose GEMMs in ``gemms`` take ``recovery``'s casts and fast
    accumulation and the others ``low``'s. ``ValueError`` when torchao refuses the mix (an
    operand cast to two dtypes, or two scale-rounding rules), with torchao's reason."""
    chosen = set(gemms)
    fields: dict[str, Any] = {}
    for gemm, names in CAST_FIELDS.items():
        source = recovery if gemm in chosen else low
        fields.update({n: getattr(source, n) for n in names})
        fields[GEMM_FIELDS[gemm]] = getattr(source, GEMM_FIELDS[gemm])
    rounds = {
        c.round_scales_to_power_of_2
        for g, c in ((g, recovery if g in chosen else low) for g in CAST_FIELDS)
        if any(getattr(c, n).scaling_type is ScalingType.DYNAMIC for n in CAST_FIELDS[g])
    }
    if len(rounds) > 1:
        raise ValueError(
            "torchao's Float8LinearConfig rounds every scale of a linear one way "
            "(round_scales_to_power_of_2), and the two recipes round them differently"
        )
    fields["round_scales_to_power_of_2"] = (
        rounds.pop() if rounds else low.round_scales_to_power_of_2
    )
    try:
        return dataclasses.replace(low, **fields)
    except AssertionError as err:  # torchao checks its configs with asserts
        raise ValueError(f"torchao's Float8LinearConfig refuses the mix: {err}") from err


def linear_mm_config(config: Any) -> Any:
    """The ``LinearMMConfig`` ``Float8Linear.__init__`` builds from ``config``."""
    return LinearMMConfig(
        *(
            ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
            for gemm in (
                config.gemm_config_output,
                config.gemm_config_grad_input,
                config.gemm_config_grad_weight,
            )
        )
    )


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Any,
    mm_config: Any,
) -> torch.Tensor:
    """``Float8Linear.forward`` (torchao 0.18) on ``weight`` and ``bias``: torchao's autograd
    function of the three GEMMs, then the bias in the output's dtype."""
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())  # what Float8Linear does under autocast
    y: torch.Tensor = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def hp_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in high precision: a weight FSDP2 all-gathered in FP8 (torchao's
    ``Float8TrainingTensor``) dequantized, differentiably; any other weight as it is."""
    if tensor_already_casted_to_fp8(weight):
        return weight.to_original_precision()  # type: ignore[attr-defined, no-any-return]
    return weight


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``"bf16"`` recovery GEMM: the module's own ``F.linear`` (on the dequantized weight
    when FSDP2 gathered it in FP8)."""
    return F.linear(x, hp_weight(weight), bias)


def wgrad_cast(
    t: torch.Tensor, cast: Any, config: Any, mm_config: Any, role: str
) -> torch.Tensor | None:
    """``Q(t)`` dequantized in fp32: torchao's cast of the flat ``[M, features]`` operand ``t``
    for the wgrad GEMM (``role``: ``"input"`` or ``"grad_output"``), with the arguments
    ``matmul_with_hp_or_float8_args.backward`` passes it; ``None`` when the cast is disabled."""
    if cast.scaling_type is ScalingType.DISABLED:
        return None
    q = hp_tensor_to_float8_dynamic(
        t,
        cast.target_dtype,
        mm_config,
        gemm_input_role=GemmInputRole.INPUT if role == "input" else GemmInputRole.GRAD_OUTPUT,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )
    return q._data.to(torch.float32) / q._scale  # type: ignore[no-any-return]


def with_float8_all_gather(weight: torch.nn.Parameter, mm_config: Any, config: Any) -> Any:
    """``weight`` wrapped as ``Float8Linear.from_float`` wraps it for FSDP2's FP8 all-gather."""
    return torch.nn.Parameter(
        WeightWithDynamicFloat8CastTensor(
            weight, mm_config, config.cast_config_weight.target_dtype
        ),
        requires_grad=weight.requires_grad,
    )
