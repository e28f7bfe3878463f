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

With docs/algorithm.md#damage-term's error term (``error_fn``, set by the runtime when
``gnmr.gamma`` is set) the local vector is ``[U + 1 sums of squares, U error sums B(u)]``: the
backend's partial bounds of the low-cost weight-gradient error, which add over ranks and
micro-batches like the gradients they bound. The same ONE all-reduce carries both (2U + 1 float64
values, no second collective). ``error_scale`` puts them in the units of the reduced gradient:
``1/dp`` where the framework averages gradients over ``dp`` data-parallel ranks and the group sums
the ranks' partials (DeepSpeed). Without ``error_fn`` the vector is exactly the U + 1 sums of
squares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gnmr_dist.distributed.comm import Group, all_reduce_sum_async
from gnmr_dist.distributed.units import UnitRegistry

__all__ = [
    "ErrorFn",
    "GradNormMonitor",
    "IndexCache",
    "UnitNorms",
    "default_grad",
    "index_tensor",
    "sum_of_squares_by_slot",
    "unit_norms_from_total",
]

GradFn = Callable[[nn.Parameter], torch.Tensor | None]
ErrorFn = Callable[[torch.device], torch.Tensor | None]
"""``device -> float64 [U]``: this rank's error sums ``B(u)`` (a backend's ``error_sums``)."""


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
    error_sums: torch.Tensor | None = None
    """float64 [U] on the host: the reduced error sums ``B(u)`` (docs/algorithm.md#damage-term),
    in the units of the reduced gradient; ``None`` when the monitor carries no error term."""

    def relative_errors(self) -> torch.Tensor | None:
        """float64 [U]: ``e_t(u) = B(u) / G_t``, the bound over the global gradient norm ``G_t``.

        ``B(u)`` bounds ``||g_low,u - g_high,u||``, so ``e_t(u)`` bounds the share of the whole
        gradient's norm that unit u's low-cost error can be (``sum_u e^2`` bounds the relative
        squared error of the step's gradient, to first order). Dividing by the *global* norm, not
        by the unit's own ``n_t(u)``, keeps the ranking of ``B``, which is what ranks the
        measured gradient gap (issue 13: precision@3 0.81 against 0.31 for ``B / n`` at 2-bit
        saved activations); a unit with a small gradient and a large error is not inflated.
        0 when ``B = 0 = G``, +inf when ``B > 0 = G`` or ``B`` is not finite; a non-finite
        ``G`` (one unit's NaN) is replaced by the norm of the finite parts. The
        dimensionless score the controller's ``errors=`` takes; ``None`` without error sums.
        """
        if self.error_sums is None:
            return None
        b = self.error_sums.to(torch.float64)
        g = torch.full_like(b, self._finite_global_norm())
        e = torch.where((b == 0) & (g == 0), torch.zeros_like(b), b / g)
        return torch.where(torch.isfinite(b), e, torch.full_like(b, math.inf))

    def _finite_global_norm(self) -> float:
        """``G``, or, when a norm is not finite, the norm of the finite parts only: one unit's
        NaN gradient must not turn every unit's ``e`` into NaN (the unit itself already scores
        +inf through its own norm)."""
        # the common case: G itself
        if math.isfinite(self.global_norm):
            return self.global_norm
        n = self.norms.to(torch.float64)
        finite = n[torch.isfinite(n)]
        rest = self.rest_norm if math.isfinite(self.rest_norm) else 0.0
        return math.sqrt(float(finite.square().sum()) + rest**2)


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 and fp16 norms are taken in fp32: their squares overflow or lose the
    # small units' share; float64 gradients keep float64
    return torch.float64 if dtype == torch.float64 else torch.float32


IndexCache = dict[tuple[int, ...], torch.Tensor]


def index_tensor(
    slots: Sequence[int], device: torch.device, cache: IndexCache | None
) -> torch.Tensor:
    """The slot ids as a device tensor, built once per distinct list (a host->device copy)."""
    key = tuple(slots)
    # the slot lists repeat every step: one host->device copy per distinct list
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
    # _foreach_norm takes one device and dtype per call: group by both
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for t, s in zip(tensors, slots, strict=True):
        ts, ss = groups.setdefault((t.device, t.dtype), ([], []))
        ts.append(t)
        ss.append(s)
    for (_, dtype), (ts, ss) in groups.items():
        norms = torch.stack(torch._foreach_norm(ts, 2, dtype=_norm_dtype(dtype)))
        index = index_tensor(ss, device, index_cache)
        # squared norms add over any split of a unit's elements, so shards and tensors of
        # one unit sum into its slot without a gather; float64 keeps the sum exact enough
        out.index_add_(0, index, norms.to(device=device, dtype=torch.float64).square())
    return out


class GradNormMonitor:
    """Computes :class:`UnitNorms` from this rank's gradients with one all-reduce over ``group``.

    Args:
        registry: the units and this rank's counted parameters.
        group: the ranks across which the gradients are split: the model-parallel group
            (tensor x pipeline) for megatron-core with its plain optimizer; DeepSpeed's
            data-parallel group with the ZeRO pieces of
            :mod:`gnmr_dist.integrations.deepspeed.grads` (``grad_fn`` then returns each rank's
            own piece). ``None``: no communication.
        grad_fn: returns the gradient (or gradient shard) of a parameter; default
            :func:`default_grad`.
        error_fn: this rank's damage-term error sums (``backend.error_sums``); ``None``: the
            vector carries norms only.
        error_scale: factor applied to the local error sums before the reduction (``1/dp``
            under data-parallel gradient averaging whose partials the group sums).
    """

    def __init__(
        self,
        registry: UnitRegistry,
        *,
        group: Group | None = None,
        grad_fn: GradFn | None = None,
        error_fn: ErrorFn | None = None,
        error_scale: float = 1.0,
    ) -> None:
        if not (math.isfinite(error_scale) and error_scale > 0):
            raise ValueError(f"error_scale must be a finite number > 0, got {error_scale!r}")
        self.registry = registry
        self.group = group
        self.grad_fn = grad_fn or default_grad
        self.error_fn = error_fn
        self.error_scale = float(error_scale)
        # a Python list once: the per-step loop reads it, not the tensor
        self._slots = registry.param_slots.tolist()
        self._device = self._pick_device()
        self._index_cache: IndexCache = {}

    @property
    def device(self) -> torch.device:
        """Where the local vector is built (the device of the registry's parameters)."""
        return self._device

    def _pick_device(self) -> torch.device:
        params = self.registry.params
        return params[0].device if params else torch.device("cpu")

    def local_sum_of_squares(self) -> torch.Tensor:
        """float64 [U + 1]: this rank's partial sums of squares (before the all-reduce)."""
        grads, slots = [], []
        for param, slot in zip(self.registry.params, self._slots, strict=True):
            # DeepSpeed's ZeRO pieces come from grad_fn; a parameter with no gradient
            # here (frozen, or its shard on another rank) adds nothing
            grad = self.grad_fn(param)
            if grad is not None:
                grads.append(grad)
                slots.append(slot)
        u = self.registry.num_units + 1
        return sum_of_squares_by_slot(grads, slots, u, self._device, self._index_cache)

    def local_error_sums(self) -> torch.Tensor:
        """float64 [U]: this rank's error sums times ``error_scale`` (before the all-reduce)."""
        if self.error_fn is None:
            raise RuntimeError("this monitor has no error_fn (the damage term, gnmr.gamma, is off)")
        sums = self.error_fn(self._device)
        u = self.registry.num_units
        if sums is None or tuple(sums.shape) != (u,):
            got = None if sums is None else list(sums.shape)
            raise ValueError(
                f"gnmr.gamma: error_fn must return the float64 [{u}] error sums of this rank's "
                f"units (the backend's error_sums), got {got}; a backend that reports no error "
                "returns None: leave gnmr.gamma unset with it"
            )
        return sums.to(device=self._device, dtype=torch.float64) * self.error_scale

    def start(
        self, grad_scale: float = 1.0, *, with_errors: bool | None = None
    ) -> Callable[[], UnitNorms]:
        """Compute the local sums and start their all-reduce; the returned call finishes it.

        ``grad_scale``: the factor the gradients currently carry (an fp16 loss scale not yet
        divided out); the squared sums are divided by its square before the reduction, the error
        sums (linear in the output gradients) by it. Starting before and finishing after the
        optimizer step overlaps the collective with the step. With ``error_fn`` the one
        all-reduce carries ``[U + 1 sums of squares, U error sums]``; ``with_errors=False``
        leaves the error sums out this step (``gnmr.error_every``: a step the backend did not
        measure; the step's :attr:`Plan.measure_errors` says which), ``None`` includes them whenever
        there is an ``error_fn``.
        """
        local = self.local_sum_of_squares()
        if grad_scale != 1.0:
            # an fp16 loss scale s multiplies every gradient: its squares carry s^2
            local.div_(float(grad_scale) ** 2)
        u = None
        if self.error_fn is not None and with_errors is not False:
            errors = self.local_error_sums()
            if grad_scale != 1.0:
                # B(u) is linear in the output gradients, so it carries s once
                errors.div_(float(grad_scale))
            # one vector, one all-reduce: the error term adds U numbers, not a collective
            local, u = torch.cat([local, errors]), self.registry.num_units
        # started before the optimizer step and waited after it: the collective overlaps
        wait = all_reduce_sum_async(local, self.group)
        return lambda: unit_norms_from_total(wait(), u)

    def compute(self, *, with_errors: bool | None = None) -> UnitNorms:
        """Per-unit and global norms, identical on every rank of ``group`` (one all-reduce)."""
        return self.start(with_errors=with_errors)()


def unit_norms_from_total(total: torch.Tensor, num_units: int | None = None) -> UnitNorms:
    """:class:`UnitNorms` of a reduced vector (copied to the host once).

    ``num_units=None``: ``total`` is the [U + 1] sums of squares. ``num_units=U``: it is
    ``[U + 1 sums of squares, U error sums]`` (the monitor's vector with the error term).
    """
    total = total.cpu()
    errors = None
    if num_units is not None:
        if total.numel() != 2 * num_units + 1:
            raise ValueError(
                f"expected 2U + 1 = {2 * num_units + 1} values (U={num_units}), got {total.numel()}"
            )
        total, errors = total[: num_units + 1], total[num_units + 1 :]
    norms = total.sqrt()
    return UnitNorms(
        norms=norms[:-1],
        rest_norm=float(norms[-1]),
        global_norm=math.sqrt(float(total.sum())),
        error_sums=errors,
    )
