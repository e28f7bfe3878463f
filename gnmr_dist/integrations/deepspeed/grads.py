"""Where each DeepSpeed ZeRO stage keeps the reduced gradient, as per-parameter local pieces.

At the gradient-accumulation boundary, after DeepSpeed has reduced (data-parallel averaged) the
gradients and before the optimizer consumes them, every rank holds a disjoint piece of each
parameter's gradient, or all of it:

* stage 0 (torch optimizer, or ``FP16_UnfusedOptimizer`` for bf16): the full averaged
  ``param.grad`` on every rank. Each rank reads an equal 1/W slice of it, so the per-rank cost
  falls with the world size and every element still counts exactly once;
* stages 1 and 2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: the rank's flat fp32
  partition (with ``offload_optimizer: cpu``, the CPU copy DeepSpeed makes of it: the
  mapping's ``offload_gradient_dict``), mapped to parameters by ``param._hp_mapping``
  (``lp_fragment_address`` gives the slice of the flattened parameter this rank owns;
  ``BF16_Optimizer`` keeps the full gradient per parameter, narrowed here to the rank's own
  slice);
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): the rank's partition of each parameter,
  ``partition_numel()`` elements starting at ``rank * partition_numel()``, clipped to the
  parameter's real size (the last partition is padded).

All pieces are views: nothing is copied and nothing is gathered. Summing their squared norms over
the data-parallel group (one all-reduce of the per-unit vector) gives the squared norm of the
full averaged gradient of every unit. Names are those of DeepSpeed 0.19.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["grad_piece_fn"]

GradPiece = Callable[[nn.Parameter], torch.Tensor | None]


def _stage0(rank: int, world: int) -> GradPiece:
    def piece(p: nn.Parameter) -> torch.Tensor | None:
        if p.grad is None:
            return None
        part = p.grad.view(-1).tensor_split(world)[rank]
        return part if part.numel() else None

    return piece


def _hp_mapping(p: nn.Parameter) -> torch.Tensor | None:
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    grad = mapping.get_lp_grad_fragment(p._index_in_param_group)  # type: ignore[attr-defined]
    address = mapping.lp_fragment_address
    if grad.numel() != address.numel:  # BF16_Optimizer: the full gradient of the parameter
        grad = grad.reshape(-1).narrow(0, address.start, address.numel)
    return grad  # type: ignore[no-any-return]


def _stage3(optimizer: Any) -> GradPiece:
    partitions = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition

    def piece(p: nn.Parameter) -> torch.Tensor | None:
        grad = partitions.get(p.ds_id)  # type: ignore[attr-defined]
        if grad is None:
            return None
        size = p.partition_numel()  # type: ignore[attr-defined]
        start = optimizer._get_param_partition_rank(p) * size
        n = max(0, min(size, p.ds_numel - start))  # type: ignore[attr-defined]
        return grad.narrow(0, 0, n) if n > 0 else None

    return piece


def grad_piece_fn(engine: Any) -> GradPiece:
    """``param -> this rank's piece of its reduced gradient`` (pieces partition it over DP).

    Raises ``NotImplementedError`` for optimizer set-ups whose gradients live elsewhere
    (CPU/NVMe offload), naming the optimizer class.
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and optimizer.offload_optimizer:
        raise NotImplementedError(
            "gnmr: ZeRO-3 optimizer offload keeps gradients in offload buffers, which the "
            "monitor does not read yet; disable offload_optimizer or use ZeRO stage 1-2"
        )
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return _stage3(optimizer)
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        return _hp_mapping
    group = engine.data_parallel_group
    rank = torch.distributed.get_rank(group)
    world = torch.distributed.get_world_size(group)
    return _stage0(rank, world)
