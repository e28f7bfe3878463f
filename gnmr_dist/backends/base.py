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
  rank's per-unit partial sums ``B(u)`` of the damage score (docs/algorithm.md#damage-term;
  :mod:`gnmr_dist.backends.error_sums`), accumulated since the last :meth:`apply`; ``None`` for a
  backend that reports no error. Measuring is off until ``track_errors``: runs without
  ``gnmr.gamma`` pay nothing.

Custom autograd functions save the path they ran in the forward, so the backward of a step uses
the forward's precision even if the plan changes before it runs.

The controller never imports a backend; the integrations wire the two together. A backend knows
no training framework: an integration describes its framework's operators with an
:class:`Operators` value passed to the backend when it is built. Writing a backend (the hooks a
subclass implements or overrides, a worked example): ``docs/backends.md#writing-a-backend``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from gnmr_dist.backends.error_sums import ErrorSums, GemmProbe
from gnmr_dist.backends.gemms import ALL_GEMMS, parse_gemms, subset_error
from gnmr_dist.backends.operators import Gemm, GemmAdapter, ModuleSwitch, operators_of
from gnmr_dist.backends.options import parse_options

__all__ = [
    "LOW_COST",
    "RECOVERY",
    "TORCH",
    "Operators",
    "PrecisionBackend",
    "StepReport",
    "Switcher",
]

logger = logging.getLogger(__name__)

LOW_COST = "low_cost"
RECOVERY = "recovery"


Switcher = Callable[[nn.Module, str, "PrecisionBackend"], "ModuleSwitch | None"]
"""``(module, label, backend) -> switch``, or ``None`` when the module is not such a module."""


@dataclass(frozen=True)
class Operators:
    """What a framework adds to the operators a backend knows, described by its integration
    (:mod:`gnmr_dist.backends.operators`) and passed to the backend when it is built."""

    types: frozenset[str] = frozenset()
    """Class names of the framework's operators besides ``nn.Linear`` and LoRA layers."""
    adapters: tuple[GemmAdapter, ...] = ()
    """How GEMM backends run those operators."""
    switcher: Switcher | None = None
    """Factory of :class:`ModuleSwitch` objects for self-switching modules (``te_fp8``)."""

    def adapter_of(self, module: nn.Module) -> GemmAdapter | None:
        """The adapter that runs ``module``, or ``None``."""
        return next((a for a in self.adapters if a.matches(module)), None)

    def all_types(self) -> frozenset[str]:
        """:attr:`types` and every adapter's."""
        return self.types.union(*(a.types for a in self.adapters))


TORCH = Operators()
"""Plain torch: ``nn.Linear`` and LoRA layers only (what a backend knows by default)."""


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


class PrecisionBackend:
    """Base class of the precision backends: everything the integrations, the runtime and the
    recovery-gap probe call on a backend is declared here, with its default.

    A subclass is registered under its config name with
    :func:`~gnmr_dist.backends.registry.register_backend`, sets its option dataclasses
    (:attr:`LowCost`, :attr:`Recovery`: parsed strictly here) and implements :meth:`make_gemm`
    (or :meth:`make_forward` for whole-module backends such as ``te_fp8``); it may narrow
    :meth:`supports`, declare :attr:`operator_types` of the library it wraps, opt in to
    integration-adapted operators (:attr:`adapted_gemms`), report errors
    (:attr:`reports_errors`) and give layer units a :meth:`recovery_region`.

    ``operators`` (keyword, default :data:`TORCH`): what the integration adds to the operators
    the backend knows (its framework's; see :class:`Operators`).
    """

    name: ClassVar[str] = ""
    """The backend's name in configs (``gnmr.backend``) and messages."""
    reports_errors: ClassVar[bool] = False
    """Whether :meth:`error_sums` reports the damage term's ``B(u)``
    (docs/algorithm.md#damage-term; ``False``: it returns None, and a block with ``gamma`` that
    names this backend is refused when it is read)."""
    operator_types: ClassVar[frozenset[str]] = frozenset()
    """Class names (matched by name, nothing imported) of the modules of the library this
    backend wraps that it switches besides ``nn.Linear`` and LoRA layers (``te_fp8``: Transformer
    Engine's linears). The integrations' unit registries find the union over every registered
    backend (:func:`~gnmr_dist.backends.registry.registered_operator_types`), so unit ids never
    depend on the backend a run chose."""
    adapted_gemms: ClassVar[bool] = False
    """Whether :meth:`make_gemm` may also run the operators an integration adapts
    (:class:`~gnmr_dist.backends.operators.GemmAdapter`: a tensor-parallel shard with the
    framework's data movement around it). Off by default: a backend written for ``nn.Linear``
    opts in once it is right on a shard."""
    LowCost: ClassVar[type[Any] | None] = None
    """The dataclass the ``gnmr.low_cost`` block is parsed into (``None``: no options). Parsed
    strictly (:func:`~gnmr_dist.backends.options.parse_options`: an unknown key names the
    closest valid one; the dataclass checks values)."""
    Recovery: ClassVar[type[Any] | None] = None
    """The dataclass of the ``gnmr.recovery`` block (``None``: no options)."""
    recovery_defaults: ClassVar[Mapping[str, Any]] = {}
    """The recovery block's own defaults where they differ from :attr:`Recovery`'s."""

    def __init__(
        self,
        *,
        low_cost: Mapping[str, Any] | None = None,
        recovery: Mapping[str, Any] | None = None,
        operators: Operators = TORCH,
    ) -> None:
        owner = f"the {self.name or type(self).__name__} backend"
        for block, cls, given in (
            ("low_cost", self.LowCost, low_cost),
            ("recovery", self.Recovery, recovery),
        ):
            if cls is None and given:
                raise ValueError(
                    f"gnmr.{block}: {owner} takes no {block} options, got {given!r}; leave "
                    f"gnmr.{block} empty or out"
                )
        self.operators = operators
        """What the integration adds to the operators this backend knows (read-only)."""
        self.low_cost: Any = None
        """The parsed ``low_cost`` block (an instance of :attr:`LowCost`)."""
        self.recovery: Any = None
        """The parsed ``recovery`` block (an instance of :attr:`Recovery`)."""
        if self.LowCost is not None:
            self.low_cost = parse_options(self.LowCost, low_cost, "gnmr.low_cost", owner=owner)
        if self.Recovery is not None:
            self.recovery = parse_options(
                self.Recovery, recovery, "gnmr.recovery", self.recovery_defaults, owner=owner
            )
        self._wrapped: dict[int, list[nn.Module]] = {}
        self._attrs: dict[int, str] = {}  # id(module) -> the attribute its switch replaced
        self._recover: frozenset[int] = frozenset()
        self._step = 0
        self._ran: dict[int, set[str]] = {}
        self._errors: ErrorSums | None = None
        self._error_every = 1
        self._unit: int | None = None  # the unit whose switched forward is running
        self.gemms: frozenset[str] = ALL_GEMMS
        """The GEMMs (``"fprop"``, ``"dgrad"``, ``"wgrad"``) a unit on the recovery path runs on
        the recovery path's numerics; the others keep the low-cost path's (``gnmr.gemms``;
        :meth:`set_gemms`, default all three)."""
        self.before_forward: Callable[[], None] | None = None
        """Called by the next switched forward, then cleared by its owner: an integration that
        takes its decision lazily (megatron-core, no host sync after the step) sets it."""

    @classmethod
    def default_error_every(cls, low_cost: Mapping[str, Any]) -> int:
        """The ``gnmr.error_every`` a block with ``gamma`` that names this backend gets when it
        gives none, for its ``low_cost`` block (default 1: every step; ``te_fp8``: the interval
        whose measured cost is at most 1% of a step, docs/algorithm.md#damage-term)."""
        del low_cost
        return 1

    # ------------------------------------------------------------------ set-up

    def supports(self, module: nn.Module) -> bool:
        """Whether this backend can run ``module`` (an operator) on both paths.

        Default: ``nn.Linear`` (through :meth:`make_gemm`), and an operator the integration
        adapts (:attr:`operators`) when the backend opts in (:attr:`adapted_gemms`).
        """
        if isinstance(module, nn.Linear):
            return True
        return self.adapted_gemms and self.operators.adapter_of(module) is not None

    def operator_names(self) -> frozenset[str]:
        """Every operator class name this backend sees in a unit: its own and the
        integration's (:attr:`operator_types`, :attr:`operators`)."""
        return self.operator_types | self.operators.all_types()

    def is_eligible(self, name: str, unit: nn.Module) -> bool:
        """A unit is eligible for recovery when the backend supports one of its operators."""
        return any(self.supports(op) for _, op in operators_of(unit, self.operator_names()))

    def targets(self, op: nn.Module) -> list[nn.Module]:
        """The modules whose forward is switched for operator ``op`` (default: ``op`` itself).

        A backend that quantizes only part of an operator (the frozen ``base_layer`` of a peft
        LoRA layer) returns that part.
        """
        return [op]

    def set_gemms(self, gemms: Iterable[str]) -> None:
        """Recover only ``gemms`` of each recovered unit (``gnmr.gemms``; default all three).

        Checked (:func:`~gnmr_dist.backends.gemms.parse_gemms`, then :meth:`check_gemms`, which
        refuses a subset this backend cannot run) and set before :meth:`wrap`; a
        ``RuntimeError`` after it, since the wrapped forwards are built for one subset.
        """
        if self._wrapped:
            raise RuntimeError(f"{self.name}: set_gemms must be called before wrap")
        parsed = frozenset(parse_gemms(gemms))
        self.check_gemms(parsed)
        self.gemms = parsed

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """Raise a ``ValueError`` (:func:`~gnmr_dist.backends.gemms.subset_error`) when this
        backend cannot run ``gemms`` on the recovery path and the other GEMMs on the low-cost
        path. Default: all three only, so a backend that knows nothing of subsets refuses one."""
        if gemms != ALL_GEMMS:
            raise subset_error(
                self.name or type(self).__name__,
                gemms,
                "it runs the three GEMMs of a recovered unit together (its check_gemms "
                "accepts no subset)",
            )

    def wrap(self, units: Mapping[int, nn.Module]) -> None:
        """Install the switchable forward on every supported operator of every unit, once."""
        for uid, unit in units.items():
            ops = operators_of(unit, self.operator_names())
            mods = [t for _, op in ops if self.supports(op) for t in self.targets(op)]
            for mod in mods:
                adapter = self.operators.adapter_of(mod) if self.adapted_gemms else None
                attr = "forward" if adapter is None else adapter.attr
                if attr in vars(mod):
                    raise RuntimeError(f"unit {uid}: {type(mod).__name__} is already wrapped")
                setattr(mod, attr, self._switching(uid, mod, adapter))
                self._attrs[id(mod)] = attr
            if mods:
                self._wrapped[uid] = mods
        logger.info("%s backend wrapped %d units", self.name, len(self._wrapped))

    def unwrap(self) -> None:
        """Remove every installed forward: the modules are plain again."""
        for ops in self._wrapped.values():
            for op in ops:
                delattr(op, self._attrs.pop(id(op)))
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
        self._errors = ErrorSums(num_units)

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
        self.on_plan_change(self._recover, recover)
        self._recover, self._step = recover, step
        self._ran = {}
        if self._errors is not None:
            self._errors.reset()

    def on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
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

    def _switching(
        self, uid: int, op: nn.Module, adapter: GemmAdapter | None
    ) -> Callable[..., Any]:
        """The installed ``forward`` (or the adapter's method): the plan picks the path."""

        def make(path: str) -> Callable[..., Any]:
            if adapter is None:
                return self.make_forward(op, path)
            return adapter.build(self.make_gemm(op, path), self.name)

        low, high = make(LOW_COST), make(RECOVERY)

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

    def recovery_region(self) -> contextlib.AbstractContextManager[Any] | None:
        """The region a *layer* unit on the recovery path runs in, in place of the framework's
        own per-layer precision context (megatron's ``get_fp8_context``).

        ``None`` (the default): the backend has no layer-level region and switches the
        operators themselves, so the framework's per-layer context stays (``te_fp8`` returns its
        inner region: FP8 off, or its stronger recipe).
        """
        return None

    def measuring(self) -> contextlib.AbstractContextManager[None]:
        """The region of passes that measure rather than train (the recovery-gap probe's):
        state that training passes update (amax histories) is read but not updated inside,
        and plan changes made inside have no side effect on it.

        Default: a ``nullcontext`` (a backend without such state has nothing to freeze).
        """
        return contextlib.nullcontext()

    def make_forward(self, op: nn.Module, path: str) -> Callable[..., Any]:
        """The forward of operator ``op`` on ``path`` (called with the module's own arguments).

        Default: ``nn.Linear.forward`` on top of :meth:`make_gemm`.
        """
        gemm = self.make_gemm(op, path)

        linear = cast(nn.Linear, op)

        def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature
            return gemm(input, linear.weight, linear.bias)

        return forward

    def make_gemm(self, op: nn.Module, path: str) -> Gemm:
        """``(x, weight, bias) -> y`` of ``op`` on ``path``, with its own autograd.

        Called twice per operator when it is wrapped (once per path); the returned function runs
        in every forward. ``weight`` may be a tensor-parallel shard when :attr:`adapted_gemms`
        is on (the adapter moves the data around it). A backend that reports errors calls
        :meth:`_error_probe` inside (``None``: nothing is measured this step).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement make_gemm")
