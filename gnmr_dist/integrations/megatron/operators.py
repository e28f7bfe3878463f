"""megatron-core's operators, as the backends see them (:mod:`gnmr_dist.backends.operators`).

Two families of projection in megatron-core 0.16-0.19:

* its own tensor-parallel linears, ``ColumnParallelLinear`` and ``RowParallelLinear``
  (``tensor_parallel/layers.py``), which call ``self._forward_impl(input, weight, bias,
  gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, tp_group, ...)`` around the
  local GEMM. A GEMM backend that opts in (``adapted_gemms``) runs in place of that method,
  through :data:`TP_LINEAR` (:func:`tp_forward_impl` says how the data moves);
* its Transformer Engine wrappers (``TELinear`` & co., :mod:`~gnmr_dist.integrations.megatron.te`),
  which only ``te_fp8`` runs, through their own ``te_quant_params`` switch.

:data:`MEGATRON_OPERATORS` is what the megatron integration builds its backend with, and the
operator class names its unit registry finds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.base import Operators
from gnmr_dist.backends.operators import Gemm, GemmAdapter
from gnmr_dist.distributed.units import ModelMarks
from gnmr_dist.integrations.megatron.te import MEGATRON_TE_LINEARS, te_quant_params_switcher

__all__ = [
    "MEGATRON_LINEARS",
    "MEGATRON_MARKS",
    "MEGATRON_OPERATORS",
    "TP_LINEAR",
    "tp_forward_impl",
]

MEGATRON_LINEARS = frozenset({"ColumnParallelLinear", "RowParallelLinear"})
"""megatron-core's own (non-TE) tensor-parallel linears, switched through ``_forward_impl``."""


def tp_forward_impl(gemm: Gemm, backend: str) -> Callable[..., torch.Tensor]:
    """megatron-core's ``_forward_impl`` of a Column/RowParallelLinear on top of ``gemm``.

    Megatron hands the local GEMM its shard of the weight plus flags, and two of them move
    data across the tensor-parallel group around the GEMM:

    * ``allreduce_dgrad`` (column-parallel without sequence parallelism): the input gradient
      is all-reduced in backward, which ``copy_to_tensor_model_parallel_region`` does.
    * ``sequence_parallel`` (column-parallel with sequence parallelism; megatron passes
      ``False`` for row-parallel, whose reduce-scatter happens outside ``_forward_impl``):
      the input arrives split along the sequence and is all-gathered in forward, its gradient
      reduce-scattered in backward: ``gather_from_sequence_parallel_region`` does both, as
      megatron's own frozen-weight path does. The GEMM then sees the full sequence, exactly
      as megatron's, and saves the gathered input (megatron saves its shard and gathers it
      again in backward: more activation memory here, same numbers).

    Gradient-accumulation fusion (a fused wgrad kernel writing into ``main_grad``) has no
    counterpart in a GEMM with its own autograd and is refused. The group is the one megatron
    passes (``tp_group``): nothing is looked up here.
    """

    def forward_impl(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        tp_group: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        if gradient_accumulation_fusion:
            raise NotImplementedError(
                f"the {backend} backend runs megatron linears without gradient-accumulation "
                "fusion; set gradient_accumulation_fusion=False or use te_fp8"
            )
        if sequence_parallel or allreduce_dgrad:  # (imported only when TP moves data)
            from megatron.core.tensor_parallel import mappings

            input = (
                mappings.gather_from_sequence_parallel_region(
                    input, tensor_parallel_output_grad=True, group=tp_group
                )
                if sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(input, group=tp_group)
            )
        return gemm(input, weight, bias)

    return forward_impl


def _input_widths(module: nn.Module) -> tuple[int, int] | None:
    """``RowParallelLinear``: its GEMM sees ``input_size_per_partition`` of ``input_size``."""
    local = getattr(module, "input_size_per_partition", None)
    full = getattr(module, "input_size", None)
    return None if local is None or full is None else (int(full), int(local))


TP_LINEAR = GemmAdapter(MEGATRON_LINEARS, "_forward_impl", tp_forward_impl, _input_widths)
"""How a GEMM backend runs megatron-core's own tensor-parallel linears."""

MEGATRON_OPERATORS = Operators(
    types=MEGATRON_TE_LINEARS, adapters=(TP_LINEAR,), switcher=te_quant_params_switcher
)
"""megatron-core's operators (module docstring)."""

MEGATRON_MARKS = ModelMarks(
    layer_number="layer_number", sharded=("tensor_model_parallel",), shared=("shared",)
)
"""megatron-core's marks: a ``TransformerLayer`` carries its global 1-based ``layer_number``; a
tensor-parallel shard has ``tensor_model_parallel=True``; the output layer's tied copy of the
word embedding on the last pipeline stage has ``shared=True`` (counted on the first stage)."""
