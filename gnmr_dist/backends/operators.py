"""The operators a backend switches, and the pieces an integration describes a framework's with.

A unit is made of *operators*: the projections whose GEMMs run on the low-cost or the recovery
path. Out of the box every backend knows torch's ``nn.Linear`` (and a peft LoRA layer around
one, which belongs to its outer layer as a whole: :func:`operators_of`). A backend may declare
more module classes of the library it wraps (``te_fp8``: Transformer Engine's linears) in
:attr:`~gnmr_dist.backends.base.PrecisionBackend.operator_types`.

A training framework with projections of its own (megatron-core's tensor-parallel linears) is
described by its integration, never here, in the
:class:`~gnmr_dist.backends.base.Operators` value the backend is built with, from two pieces:

* a :class:`GemmAdapter` per operator family that can run a backend's :data:`Gemm`: which
  method of the instance is replaced, and how the framework's data movement (a tensor-parallel
  all-gather or all-reduce) is put around the GEMM;
* a :class:`ModuleSwitch` for a module that switches its own precision through a framework
  setting (a megatron TE linear's ``te_quant_params``).

A backend runs an adapted operator only if it opts in (:attr:`~gnmr_dist.backends.base.
PrecisionBackend.adapted_gemms`): a backend written and tested on ``nn.Linear`` is never applied
to a tensor-parallel shard by default.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from gnmr_dist.distributed.units import is_operator

__all__ = ["Gemm", "GemmAdapter", "ModuleSwitch", "operators_of"]

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``(x, weight, bias) -> y``: one operator's GEMM on one path, with its own autograd."""


def _no_shard(module: nn.Module) -> tuple[int, int] | None:
    del module
    return None


@dataclass(frozen=True)
class GemmAdapter:
    """Runs a framework's operator class on a backend's :data:`Gemm`.

    ``build(gemm, backend_name)`` returns the callable installed as ``module.<attr>`` on each
    instance (the instance attribute shadows the class's method; unwrapping deletes it).
    ``input_widths(module)`` is ``(full, local)`` input features when the GEMM sees a shard of
    the input (tensor parallelism), else ``None``: a backend whose groups must not straddle a
    shard boundary checks them (``act_quant``).
    """

    types: frozenset[str]
    """Class names (matched exactly, nothing imported) of the modules this adapter runs."""
    attr: str
    """The method replaced on each instance (its signature is the framework's)."""
    build: Callable[[Gemm, str], Callable[..., torch.Tensor]]
    """``(gemm, backend name) -> replacement`` (the name is for error messages)."""
    input_widths: Callable[[nn.Module], tuple[int, int] | None] = _no_shard
    """``(full, this rank's)`` input features of a sharded GEMM, else ``None``."""

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of :attr:`types` with the method :attr:`attr`."""
        return type(module).__name__ in self.types and hasattr(module, self.attr)


class ModuleSwitch(Protocol):
    """A module that runs the path a framework setting of its own names (see
    :class:`~gnmr_dist.backends.base.Operators`): the backend sets the setting instead of
    replacing a forward."""

    module: nn.Module

    def path(self) -> str:
        """The path the module runs next (``"low_cost"`` or ``"recovery"``)."""
        ...

    def set(self, recover: bool) -> None:
        """Put the module on the recovery path (``True``) or back on the low-cost one."""
        ...

    def restore(self) -> None:
        """Give the module its own setting back (unwrap)."""
        ...

    def check_recovered(self) -> None:
        """After a recovery forward: raise if the module did not run what was asked."""
        ...


def operators_of(
    module: nn.Module, operator_types: Collection[str] = frozenset()
) -> Iterator[tuple[str, nn.Module]]:
    """``(relative path, operator)`` for the outermost operators in ``module`` (itself included).

    An operator nested in another (peft's ``lora.Linear`` holds ``base_layer`` and ``lora_A``)
    belongs to the outer one, which the backend handles as a whole. ``operator_types``: as
    :func:`~gnmr_dist.distributed.units.is_operator`'s.
    """
    taken: list[str] = []
    for path, sub in module.named_modules():
        if any(t == "" or path == t or path.startswith(t + ".") for t in taken):
            continue
        if is_operator(sub, operator_types):
            taken.append(path)
            yield path, sub
