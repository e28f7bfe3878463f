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

from gnmr_dist.distributed.comm import Group, all_reduce_sum, all_reduce_sum_async
from gnmr_dist.distributed.units import UnitRegistry

__all__ = [
    "GradNormMonitor", "IndexCache", "UnitNorms", "default_grad", "index_tensor",
    "sum_of_squares_by_slot",
]  # fmt: skip

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


IndexCache = dict[tuple[int, ...], torch.Tensor]


def index_tensor(
    slots: Sequence[int], device: torch.device, cache: IndexCache | None
) -> torch.Tensor:
    """The slot ids as a device tensor, built once per distinct list (a host->device copy)."""
    key = tuple(slots)
    if cache is not None and key in cache:
        return cache[key]
    index = torch.tensor(slots, dtype=torch.int64, device=device)
    if cache is not None:
        cache[key] = index
    return index


def sum_of_squares_by_slot(
    tensors: Sequence[torch.Tensor],
    slots: Sequence[int],
    num_slots: int,
    device: torch.device,
    index_cache: IndexCache | None = None,
) -> torch.Tensor:
    """float64 [num_slots]: sum of ``||t||^2`` of the tensors that map to each slot.

    One ``_foreach_norm`` per (device, dtype) group and one ``index_add_``: no Python loop over
    elements and no host sync (the slot index tensors are cached in ``index_cache``).
    """
    out = torch.zeros(num_slots, dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for t, s in zip(tensors, slots, strict=True):
        ts, ss = groups.setdefault((t.device, t.dtype), ([], []))
        ts.append(t)
        ss.append(s)
    for (_, dtype), (ts, ss) in groups.items():
        norms = torch.stack(torch._foreach_norm(ts, 2, dtype=_norm_dtype(dtype)))
        index = index_tensor(ss, device, index_cache)
        out.index_add_(0, index, norms.to(device=device, dtype=torch.float64).square())
    return out


class GradNormMonitor:
    """Computes :class:`UnitNorms` from this rank's gradients with one all-reduce over ``group``.

    Args:
        registry: the units and this rank's counted parameters.
        group: the ranks across which the gradients are split: the model-parallel group
            (tensor x pipeline) for megatron-core with its plain optimizer; DeepSpeed's
            data-parallel group with the ZeRO pieces of
            :mod:`gnmr_dist.integrations.deepspeed_grads` (``grad_fn`` then returns each rank's
            own piece). ``None``: no communication.
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
        self._index_cache: IndexCache = {}

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
        u = self.registry.num_units + 1
        return sum_of_squares_by_slot(grads, slots, u, self._device, self._index_cache)

    def start(self, grad_scale: float = 1.0) -> Callable[[], UnitNorms]:
        """Compute the local sums and start their all-reduce; the returned call finishes it.

        ``grad_scale``: the factor the gradients currently carry (an fp16 loss scale not yet
        divided out); the squared sums are divided by its square before the reduction. Starting
        before and finishing after the optimizer step overlaps the collective with the step.
        """
        local = self.local_sum_of_squares()
        if grad_scale != 1.0:
            local.div_(float(grad_scale) ** 2)
        wait = all_reduce_sum_async(local, self.group)
        return lambda: unit_norms_from_total(wait())

    def compute(self) -> UnitNorms:
        """Per-unit and global norms, identical on every rank of ``group`` (one all-reduce)."""
        return self.start()()


def unit_norms_from_total(total: torch.Tensor) -> UnitNorms:
    """Square roots of a reduced [U + 1] vector of sums of squares (copied to the host once)."""
    total = total.cpu()
    norms = total.sqrt()
    return UnitNorms(
        norms=norms[:-1], rest_norm=float(norms[-1]), global_norm=math.sqrt(float(total.sum()))
    )


def reduce_unit_norms(local: torch.Tensor, group: Group | None) -> UnitNorms:
    """All-reduce a [U + 1] vector of partial sums of squares and take square roots."""
    return unit_norms_from_total(all_reduce_sum(local, group))
