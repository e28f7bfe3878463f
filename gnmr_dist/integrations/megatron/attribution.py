"""Which unit each gradient of megatron's clip norm belongs to, and the guard on the result.

megatron's clip norm reads the ``.grad`` of its *main* parameters (fp32 copies, or this DP
rank's shards under the distributed optimizer), never the model parameters GNMR's units are
made of. :func:`main_to_model` pairs each main parameter with its model parameter through the
optimizer's own parallel group lists, :class:`GradAttribution` turns one norm call's gradient
list into unit slots, and :func:`guard_violation` names why reduced sums cannot be trusted
(the full account: :mod:`gnmr_dist.integrations.megatron.gnmr`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["GradAttribution", "guard_violation", "leaf_optimizers", "main_to_model"]


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizers that own main parameters (a ``ChainedOptimizer`` recursively)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
        return
    for sub in chained:
        yield from leaf_optimizers(sub)


_PAIRED_GROUPS = (
    # DistributedOptimizer: model params <-> this rank's main shards
    ("model_float16_groups", "shard_fp32_from_float16_groups"),
    ("model_float16_groups", "shard_float16_groups"),  # precision-aware optimizer
    ("model_fp32_groups", "shard_fp32_groups"),
    # Float16OptimizerWithFloat16Params: model params <-> fp32 main copies
    ("float16_groups", "fp32_from_float16_groups"),
    ("fp32_from_fp32_groups", "fp32_from_fp32_groups"),
)


def main_to_model(optimizer: Any) -> dict[int, nn.Parameter]:
    """``id(main parameter) -> model parameter`` from one leaf optimizer's own structures.

    An optimizer without paired groups (megatron's ``FP32Optimizer``) steps the model
    parameters themselves.
    """
    pairs: dict[int, nn.Parameter] = {}
    found = False
    for model_attr, main_attr in _PAIRED_GROUPS:
        model_groups, main_groups = (
            getattr(optimizer, model_attr, None),
            getattr(optimizer, main_attr, None),
        )
        if model_groups is None or main_groups is None:
            continue
        found = True
        for model_group, main_group in zip(model_groups, main_groups, strict=True):
            pairs.update({id(m): p for p, m in zip(model_group, main_group, strict=True)})
    if not found:
        pairs = {id(p): p for p in optimizer.get_parameters()}
    return pairs


class GradAttribution:
    """Maps the gradients of megatron's clip-norm list to unit slots.

    Slots ``0..U-1`` are units, ``U`` the rest (parameters outside every unit), ``U + 1`` the
    unattributed bucket: a gradient that is no main parameter's, or a main parameter the
    optimizer structures do not pair with a model parameter. The guard refuses any mass there.
    The pairing is built once, at :func:`apply` (the optimizer's parameter groups are fixed).
    """

    def __init__(self, slot_of_param: dict[int, int], num_units: int, optimizer: Any) -> None:
        unattributed = num_units + 1
        self.unattributed = unattributed
        self._mains: list[tuple[nn.Parameter, int]] = []
        for leaf in leaf_optimizers(optimizer) if optimizer is not None else ():
            model_of = main_to_model(leaf)
            for main in leaf.get_parameters():
                model = model_of.get(id(main))
                slot = unattributed if model is None else slot_of_param.get(id(model))
                self._mains.append((main, unattributed if slot is None else slot))

    def slots(self, grads: Sequence[torch.Tensor]) -> list[int]:
        """The slot of each gradient of one clip-norm call."""
        by_grad: dict[int, int] = {}
        for main, slot in self._mains:
            for attr in ("grad", "decoupled_grad"):
                grad = getattr(main, attr, None)
                if grad is not None:
                    by_grad[id(grad)] = slot
        return [by_grad.get(id(g), self.unattributed) for g in grads]


def guard_violation(sums: torch.Tensor, max_rest_share: float) -> str | None:
    """Why the reduced ``[units..., rest, unattributed]`` sums of squares cannot be trusted."""
    units, rest, lost = float(sums[:-2].sum()), float(sums[-2]), float(sums[-1])
    total = units + rest + lost
    if lost > 0:
        return (
            f"{lost / total:.1%} of the squared gradient norm megatron's clip norm reads could not "
            "be attributed to a parameter of the model GNMR was applied to (is `optimizer` the "
            "one built for these model chunks? was a parameter added after apply()?)"
        )
    if total > 0 and units == 0:
        return (
            "the units received no gradient while the total norm is "
            f"{total**0.5:.4g}: every unit would score 1.0 and never be selected"
        )
    if total > 0 and max_rest_share < 1 and rest / total > max_rest_share:
        return (
            f"{rest / total:.1%} of the squared gradient norm is outside every unit (limit "
            f"gnmr.attribution.max_rest_share={max_rest_share}): check include/exclude"
        )
    return None
