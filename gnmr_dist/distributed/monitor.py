r"""Per-unit global gradient norms from sharded gradients, with one small all-reduce.

A unit's gradient may be split over tensor-parallel shards, pipeline stages and (with ZeRO >= 2
or a distributed optimizer) data-parallel partitions. Its global L2 norm still needs no gather,
because squared norms add over any partition of the elements:

    ||g_u||^2 = sum over ranks r of  sum over shards s of u held by r  ||s||^2

So each rank computes the squared norm of every gradient shard it holds in one fused pass
(``torch._foreach_norm``, one kernel per dtype), adds them into a vector of U + 1 slots (slot U is
the "rest" bucket of parameters outside every unit) with one ``index_add_``, and the vector is
summed over the group across which the gradients are split with ONE all-reduce of U + 1 float64
values. Every rank then holds identical per-unit norms, and ``sqrt(sum)`` of the same vector is the
global gradient norm: the number gradient clipping needs, for free.

Replicated parameters must be counted once (the registry drops them on TP ranks > 0), and the
vector is accumulated in float64 so that adding ten thousand squared shard norms loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gnmr_dist.distributed.comm import Group, all_reduce_sum
from gnmr_dist.distributed.units import UnitRegistry

__all__ = ["GradNormMonitor", "UnitNorms", "default_grad", "sum_of_squares_by_slot"]

GradFn = Callable[[nn.Parameter], torch.Tensor | None]


def default_grad(param: nn.Parameter) -> torch.Tensor | None:
    """megatron-core's fp32 ``main_grad`` buffer when the parameter has one, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


@dataclass(frozen=True)
class UnitNorms:
    """Global per-unit gradient norms, identical on every rank of the reducing group."""

    norms: torch.Tensor
    """float64 [U] on the host: L2 norm of each unit's full gradient."""
    rest_norm: float
    """L2 norm of every parameter outside all units."""
    global_norm: float
    """L2 norm of the whole (de-duplicated) gradient."""


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sum_of_squares_by_slot(
    tensors: Sequence[torch.Tensor], slots: Sequence[int], num_slots: int, device: torch.device
) -> torch.Tensor:
    """float64 [num_slots]: sum of ``||t||^2`` of the tensors that map to each slot.

    One ``_foreach_norm`` per (device, dtype) group and one ``index_add_``: no Python loop over
    elements and no host sync.
    """
    out = torch.zeros(num_slots, dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for t, s in zip(tensors, slots, strict=True):
        ts, ss = groups.setdefault((t.device, t.dtype), ([], []))
        ts.append(t)
        ss.append(s)
    for (_, dtype), (ts, ss) in groups.items():
        norms = torch.stack(torch._foreach_norm(ts, 2, dtype=_norm_dtype(dtype)))
        index = torch.tensor(ss, dtype=torch.int64, device=device)
        out.index_add_(0, index, norms.to(device=device, dtype=torch.float64).square())
    return out


class GradNormMonitor:
    """Computes :class:`UnitNorms` from this rank's gradients with one all-reduce over ``group``.

    Args:
        registry: the units and this rank's counted parameters.
        group: the ranks across which the gradients are split: the model-parallel group
            (tensor x pipeline) for megatron-core; add data parallel only when gradients are
            partitioned (ZeRO >= 2, distributed optimizer). ``None``: no communication.
        grad_fn: returns the gradient (or gradient shard) of a parameter; default
            :func:`default_grad`.
    """

    def __init__(
        self,
        registry: UnitRegistry,
        *,
        group: Group | None = None,
        grad_fn: GradFn | None = None,
    ) -> None:
        self.registry = registry
        self.group = group
        self.grad_fn = grad_fn or default_grad
        self._slots = registry.param_slots.tolist()
        self._device = self._pick_device()

    def _pick_device(self) -> torch.device:
        params = self.registry.params
        return params[0].device if params else torch.device("cpu")

    def local_sum_of_squares(self) -> torch.Tensor:
        """float64 [U + 1]: this rank's partial sums of squares (before the all-reduce)."""
        grads, slots = [], []
        for param, slot in zip(self.registry.params, self._slots, strict=True):
            grad = self.grad_fn(param)
            if grad is not None:
                grads.append(grad)
                slots.append(slot)
        return sum_of_squares_by_slot(grads, slots, self.registry.num_units + 1, self._device)

    def compute(self) -> UnitNorms:
        """Per-unit and global norms, identical on every rank of ``group`` (one all-reduce)."""
        return reduce_unit_norms(self.local_sum_of_squares(), self.group)


def reduce_unit_norms(local: torch.Tensor, group: Group | None) -> UnitNorms:
    """All-reduce a [U + 1] vector of partial sums of squares and take square roots."""
    total = all_reduce_sum(local, group).cpu()
    norms = total.sqrt()
    return UnitNorms(
        norms=norms[:-1], rest_norm=float(norms[-1]), global_norm=math.sqrt(float(total.sum()))
    )
