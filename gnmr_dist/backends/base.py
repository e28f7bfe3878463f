"""The backend protocol: two paths per unit, switched by a flag, never by rebuilding anything.

A precision backend owns the low-cost and the recovery path of every unit it wraps:

* :meth:`PrecisionBackend.wrap` is called once, before the optimizer is built. For every
  operator of every unit it installs an *instance-level* ``forward`` (the module, its parameters,
  their ids and the optimizer state are untouched; :meth:`unwrap` deletes the override).
* :meth:`PrecisionBackend.apply` is called at the start of each optimizer step with the plan the
  controller chose at the end of the previous one. It only swaps a frozenset: every forward of
  the step, all micro-batches and any activation recomputation, reads the same plan.
* :meth:`PrecisionBackend.report` says which path each unit's operators actually ran during the
  step, counted in the forwards themselves, so tests and logs see what happened rather than what
  was asked for.
* :meth:`PrecisionBackend.error_sums` (after :meth:`PrecisionBackend.track_errors`) returns this
  rank's per-unit partial sums ``B(u)`` of DESIGN.md section 2.1's damage score, accumulated
  since the last :meth:`apply` (see below).

Custom autograd functions save the path they ran in the forward, so the backward of a step uses
the forward's precision even if the plan changes before it runs.

The controller never imports a backend; the integrations wire the two together.

Error sums (DESIGN.md section 2.1)
----------------------------------
A linear's weight gradient is ``dW = dy^T x``. A low-cost path computes it, in effect, as
``Q(dy)^T Q(x)`` (each backend rounds some of the two factors), and to first order

    ||Q(dy)^T Q(x) - dy^T x||_F  <=  ||dy||_F ||x - Q(x)||_F  +  ||Q(dy) - dy||_F ||x||_F

(a backend drops the term of a factor it does not round). ``B(u)`` is that bound summed over
every GEMM of unit u's operators on this rank since the last :meth:`apply`: every micro-batch's
backward, so it grows with the micro-batches as the accumulated gradient does. Each norm is one
``torch.linalg.vector_norm`` of a tensor the backend has at hand anyway (its quantized copy, or
``dy`` in the backward); the GEMMs only append their 0-dim norms, and :meth:`error_sums`
multiplies and scatters them into a float64 ``[U]`` vector in a few kernels: no host sync, no
extra GEMM. A unit on the recovery path is measured *in shadow*: the low-cost rounding is
applied once more to the same ``x`` (in the forward) and ``dy`` (in a hook on the output's
gradient) only to measure it, so ``B(u)`` is what the low-cost path would have done to that
unit's gradient this step. The runtime divides the reduced ``B(u)`` by ``n_t(u)`` to get the
dimensionless ``e_t(u)``.

Measuring is off until :meth:`track_errors` is called, so runs without ``gnmr.gamma`` pay
nothing. :meth:`error_sums` returns ``None`` for a backend that reports no error (the base class
default; ``te_fp8`` for now). Units the backend does not wrap read 0.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from gnmr_dist.distributed.monitor import IndexCache, index_tensor
from gnmr_dist.distributed.units import is_operator

__all__ = [
    "LOW_COST",
    "RECOVERY",
    "GemmProbe",
    "PrecisionBackend",
    "StepReport",
    "frobenius",
    "is_megatron_linear",
    "operators_of",
]

logger = logging.getLogger(__name__)

LOW_COST = "low_cost"
RECOVERY = "recovery"


@dataclass(frozen=True)
class StepReport:
    """What ran during one optimizer step (between two :meth:`PrecisionBackend.apply` calls)."""

    step: int
    """The step the plan was applied for."""
    planned: frozenset[int]
    """Units the plan put on the recovery path."""
    ran: Mapping[int, frozenset[str]]
    """Unit id -> the paths (``"low_cost"``, ``"recovery"``) its operators ran in forwards."""

    @property
    def recovered(self) -> frozenset[int]:
        """Units whose forwards ran the recovery path."""
        return frozenset(u for u, paths in self.ran.items() if RECOVERY in paths)

    @property
    def low_cost(self) -> frozenset[int]:
        """Units whose forwards ran the low-cost path."""
        return frozenset(u for u, paths in self.ran.items() if LOW_COST in paths)


def frobenius(t: torch.Tensor) -> torch.Tensor:
    """0-dim ``||t||_F`` on ``t``'s device, accumulated in fp32 at least (no host sync)."""
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=wide if t.dtype != wide else None)
    return norm


class _ErrorSums:
    """This rank's ``B(u)`` since the last reset, kept as the GEMMs' 0-dim factor norms.

    Each GEMM appends its terms ``(unit, a, b)`` (``B(unit) += a * b``): a list append, no
    kernel. :meth:`total` multiplies and scatters them all at once (two stacks, one product,
    one ``index_add_``, the index cached on the device): a handful of kernels per step however
    many GEMMs and micro-batches ran, and no host sync. Past :data:`FOLD_AT` terms (many
    micro-batches, or no ``apply`` for a long time) they are folded into a running vector.
    """

    FOLD_AT = 4096

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self._terms: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._folded: torch.Tensor | None = None
        self._index: dict[torch.device, IndexCache] = {}

    def add(self, unit: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """``B(unit) += a * b`` (0-dim tensors on one device), evaluated in :meth:`total`."""
        self._terms.append((unit, a, b))
        if len(self._terms) >= self.FOLD_AT:
            self._folded = self.total(a.device)
            self._terms = []

    def total(self, device: torch.device) -> torch.Tensor:
        """A float64 ``[U]`` tensor on ``device`` (zeros before the first GEMM)."""
        out = torch.zeros(self.num_units, dtype=torch.float64, device=device)
        if self._folded is not None:
            out.add_(self._folded.to(device))
        if not self._terms:
            return out
        units, a, b = zip(*self._terms, strict=True)
        terms = torch.stack(a).double() * torch.stack(b).double()
        out.index_add_(0, self._index_of(units, device), terms.to(device))
        return out

    def _index_of(self, units: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The unit ids as a device tensor, copied from the host once per distinct sequence."""
        cache = self._index.setdefault(device, {})
        if len(cache) > 64:  # the sequence repeats every step; never grow unbounded
            cache.clear()
        return index_tensor(units, device, cache)

    def reset(self) -> None:
        self._terms, self._folded = [], None


@dataclass
class GemmProbe:
    """The error bound of one GEMM call of one unit, filled in its forward, added in its backward.

    ``x_err = ||x - Q(x)||_F`` and ``x_norm = ||x||_F`` are 0-dim device tensors (``None``: the
    term is dropped); :meth:`record` adds ``||dy|| x_err + dy_err x_norm`` to ``B(unit)``.
    """

    sink: _ErrorSums
    unit: int
    x_err: torch.Tensor | None = None
    """``||x - Q(x)||_F`` (``None`` when the backend does not round ``x``)."""
    x_norm: torch.Tensor | None = None
    """``||x||_F`` (only needed when the backend rounds ``dy``)."""

    def record(self, dy_norm: torch.Tensor, dy_err: torch.Tensor | None = None) -> None:
        """Add ``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` to the unit's sum (terms whose
        factors are ``None`` are dropped)."""
        if self.x_err is not None:
            self.sink.add(self.unit, dy_norm, self.x_err)
        if dy_err is not None and self.x_norm is not None:
            self.sink.add(self.unit, dy_err, self.x_norm)

    def record_output_grad(self, y: torch.Tensor) -> None:
        """Record ``||dy|| x_err`` from a hook on the GEMM's output ``y`` (shadow measurement of
        a path that has no backward of its own to read ``dy`` in). The hook only reads."""

        def hook(dy: torch.Tensor) -> None:
            self.record(frobenius(dy))

        y.register_hook(hook)  # type: ignore[no-untyped-call]


Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_MEGATRON_LINEARS = frozenset({"ColumnParallelLinear", "RowParallelLinear"})


def is_megatron_linear(module: nn.Module) -> bool:
    """megatron-core's own (non-TE) tensor-parallel linear, switched via ``_forward_impl``."""
    return type(module).__name__ in _MEGATRON_LINEARS and hasattr(module, "_forward_impl")


def operators_of(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(relative path, operator)`` for the outermost operators in ``module`` (itself included).

    An operator nested in another (peft's ``lora.Linear`` holds ``base_layer`` and ``lora_A``)
    belongs to the outer one, which the backend handles as a whole.
    """
    taken: list[str] = []
    for path, sub in module.named_modules():
        if any(t == "" or path == t or path.startswith(t + ".") for t in taken):
            continue
        if is_operator(sub):
            taken.append(path)
            yield path, sub


class PrecisionBackend:
    """Base class of the precision backends; subclasses implement :meth:`_gemm_fn` (or
    :meth:`_forward_fn` for whole-module backends such as ``te_fp8``).

    Subclasses parse their ``low_cost`` / ``recovery`` option blocks strictly in ``__init__``
    (unknown keys name the closest valid one) and may narrow :meth:`supports`.
    """

    name: ClassVar[str] = ""
    reports_errors: ClassVar[bool] = False
    """Whether :meth:`error_sums` reports section 2.1's ``B(u)`` (``False``: it returns None)."""

    def __init__(self) -> None:
        self._wrapped: dict[int, list[nn.Module]] = {}
        self._recover: frozenset[int] = frozenset()
        self._step = 0
        self._ran: dict[int, set[str]] = {}
        self._errors: _ErrorSums | None = None
        self._error_every = 1
        self._unit: int | None = None  # the unit whose switched forward is running
        self.before_forward: Callable[[], None] | None = None
        """Called by the next switched forward, then cleared by its owner: an integration that
        takes its decision lazily (megatron-core, no host sync after the step) sets it."""

    # ------------------------------------------------------------------ set-up

    def supports(self, module: nn.Module) -> bool:
        """Whether this backend can run ``module`` (an operator) on both paths.

        Default: ``nn.Linear`` and megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``
        (through :meth:`_gemm_fn`).
        """
        return isinstance(module, nn.Linear) or is_megatron_linear(module)

    def is_eligible(self, name: str, unit: nn.Module) -> bool:
        """A unit is eligible for recovery when the backend supports one of its operators."""
        return any(self.supports(op) for _, op in operators_of(unit))

    def targets(self, op: nn.Module) -> list[nn.Module]:
        """The modules whose forward is switched for operator ``op`` (default: ``op`` itself).

        A backend that quantizes only part of an operator (the frozen ``base_layer`` of a peft
        LoRA layer) returns that part.
        """
        return [op]

    def wrap(self, units: Mapping[int, nn.Module]) -> None:
        """Install the switchable forward on every supported operator of every unit, once."""
        for uid, unit in units.items():
            mods = [
                t for _, op in operators_of(unit) if self.supports(op) for t in self.targets(op)
            ]
            for mod in mods:
                attr = "_forward_impl" if is_megatron_linear(mod) else "forward"
                if attr in vars(mod):
                    raise RuntimeError(f"unit {uid}: {type(mod).__name__} is already wrapped")
                setattr(mod, attr, self._switching(uid, mod, attr))
            if mods:
                self._wrapped[uid] = mods
        logger.info("%s backend wrapped %d units", self.name, len(self._wrapped))

    def unwrap(self) -> None:
        """Remove every installed forward: the modules are plain again."""
        for ops in self._wrapped.values():
            for op in ops:
                delattr(op, "_forward_impl" if is_megatron_linear(op) else "forward")
        self._wrapped.clear()

    @property
    def units(self) -> frozenset[int]:
        """Ids of the units this backend wrapped."""
        return frozenset(self._wrapped)

    def track_errors(self, num_units: int | None, every: int = 1) -> None:
        """Start (or, with ``None``, stop) accumulating ``B(u)`` for unit ids ``0..num_units-1``.

        ``num_units`` is the registry's ``num_units`` (all units of the model, not only those
        this rank wraps). Off by default: without it the paths do no extra work. ``every``:
        measure only during steps ``t`` (the ``step`` of :meth:`apply`) with ``t % every == 0``
        (``gnmr.error_every``; the runtime carries the last score forward in between); the other
        steps do no extra work and their sums stay 0. A backend that does not report errors
        (:attr:`reports_errors` false) ignores the call.
        """
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"track_errors: every must be an integer >= 1, got {every!r}")
        self._error_every = every
        if num_units is None or not self.reports_errors:
            self._errors = None
            return
        wrapped = max(self._wrapped, default=-1) + 1
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < wrapped:
            raise ValueError(
                f"track_errors: num_units must be an integer >= {wrapped} (one more than the "
                f"largest wrapped unit id), got {num_units!r}"
            )
        self._errors = _ErrorSums(num_units)

    def error_sums(self, device: torch.device) -> torch.Tensor | None:
        """float64 ``[U]`` on ``device``: this rank's ``B(u)`` since the last :meth:`apply`.

        ``None`` when the backend reports no error (the base default). A reporting backend needs
        :meth:`track_errors` first (a ``RuntimeError`` says so). No host sync.
        """
        if not self.reports_errors:
            return None
        if self._errors is None:
            raise RuntimeError(
                f"the {self.name} backend measures no error sums yet: call "
                "backend.track_errors(registry.num_units) before training (gnmr.gamma)"
            )
        return self._errors.total(device)

    def _error_probe(self) -> GemmProbe | None:
        """A :class:`GemmProbe` for the GEMM the running unit is about to do, or ``None`` when
        nothing is measured (tracking off, no grad mode)."""
        if self._errors is None or self._unit is None or not torch.is_grad_enabled():
            return None
        if self._step % self._error_every:
            return None  # gnmr.error_every: not a measured step
        return GemmProbe(self._errors, self._unit)

    # ------------------------------------------------------------------ per step

    def apply(self, active: Iterable[int], step: int) -> None:
        """Set the plan for optimizer step ``step``: ``active`` units run the recovery path.

        Also starts a new step for :meth:`report` and zeroes the error sums.
        """
        recover = frozenset(int(u) for u in active)
        self._on_plan_change(self._recover, recover)
        self._recover, self._step = recover, step
        self._ran = {}
        if self._errors is not None:
            self._errors.reset()

    def _on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
        """Hook for backends that keep per-unit state across path changes (TE amax history)."""
        del before, after  # nothing to do for stateless paths

    def path_of(self, unit: int) -> str:
        """The path ``unit`` runs under the current plan."""
        return RECOVERY if unit in self._recover else LOW_COST

    def report(self) -> StepReport:
        """Which path each unit ran since the last :meth:`apply`."""
        ran = {u: frozenset(p) for u, p in self._ran.items()}
        return StepReport(step=self._step, planned=self._recover, ran=ran)

    # ------------------------------------------------------------------ forwards

    def _switching(self, uid: int, op: nn.Module, attr: str) -> Callable[..., Any]:
        """The installed ``forward`` (or megatron ``_forward_impl``): the plan picks the path."""
        make = self._megatron_impl if attr == "_forward_impl" else self._forward_fn
        low, high = make(op, LOW_COST), make(op, RECOVERY)

        def switching(*args: Any, **kwargs: Any) -> Any:
            path = self._begin_forward(uid, self.path_of)
            outer, self._unit = self._unit, uid
            try:
                return (high if path == RECOVERY else low)(*args, **kwargs)
            finally:
                self._unit = outer

        return switching

    def _begin_forward(self, uid: int, path_of: Callable[[int], str]) -> str:
        """Where every switched forward starts: take a lazily pending plan (``before_forward``),
        then read the unit's path under it and count it for :meth:`report`."""
        if self.before_forward is not None:
            self.before_forward()
        path = path_of(uid)
        self._ran.setdefault(uid, set()).add(path)
        return path

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """The region the training loop enters around each step's forward (TE's FP8 autocast).

        Most backends need none; integrations enter it for every backend.
        """
        return contextlib.nullcontext()

    def measuring(self) -> contextlib.AbstractContextManager[None]:
        """The region of passes that measure rather than train (the recovery-gap probe's):
        state that training passes update (amax histories) is read but not updated inside,
        and plan changes made inside have no side effect on it.

        Default: a ``nullcontext`` (a backend without such state has nothing to freeze).
        """
        return contextlib.nullcontext()

    def _forward_fn(self, op: nn.Module, path: str) -> Callable[..., Any]:
        """The forward of operator ``op`` on ``path`` (called with the module's own arguments).

        Default: ``nn.Linear.forward`` on top of :meth:`_gemm_fn`.
        """
        gemm = self._gemm_fn(op, path)

        linear = cast(nn.Linear, op)

        def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature
            return gemm(input, linear.weight, linear.bias)

        return forward

    def _gemm_fn(self, op: nn.Module, path: str) -> Gemm:
        """``(x, weight, bias) -> y`` of ``op`` on ``path``, with its own autograd."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _gemm_fn")

    def _megatron_impl(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        """megatron-core's ``_forward_impl`` of a Column/RowParallelLinear on ``path``.

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
        counterpart in a GEMM with its own autograd and is refused.
        """
        gemm = self._gemm_fn(op, path)

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
                    f"the {self.name} backend runs megatron linears without gradient-accumulation "
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
