"""``te_fp8``: Transformer Engine FP8 per unit, switched by nesting TE's own autocast regions.

How TE decides the precision of a GEMM. ``te.pytorch.autocast(enabled, recipe, ...)`` (called
``fp8_autocast`` before TE 2.9) sets a process-global state; every TE module (``Linear``,
``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``) reads it when its forward starts and
records in its autograd context what it ran, so its backward repeats the forward's choice.
Regions nest and the innermost one governs.

The two paths of a unit are therefore two nestings of the module's own, unchanged forward:

    with backend.autocast():                    # ONE outer region per forward: enabled, low-cost
        ...                                     #   recipe, amax_reduction_group
        low-cost unit:  Linear.forward(x)       #   runs the low-cost recipe
        recovered unit: with autocast(enabled=False):           # recipe "bf16"
                            Linear.forward(x)   #   BF16 in forward AND backward
                   or:  with autocast(enabled=True, recipe=R):  # a stronger recipe R
                            Linear.forward(x)

The switch is the frozenset the base class reads in every forward: no module is rebuilt, no
parameter moves, and activation recomputation sees the same plan.

Delayed scaling, and why Megatron refuses BF16 layers with it. The delayed recipe keeps per
module an amax history and a scale (``fp8_meta["scaling_fwd" / "scaling_bwd"]``); the amaxes of
all modules are reduced over the amax group, and new scales computed, when the *outermost*
enabled region exits (forward), and at the end of the backward of the first FP8 module.
Megatron-core picks the precision of a layer by giving every layer its own ``fp8_autocast`` and a
``nullcontext`` to BF16 layers. With delayed scaling that cannot work: either one outer enabled
region stays active (a ``nullcontext`` cannot turn FP8 off inside it), or every per-layer region
exits at depth 0 and triggers a reduction of every registered module once per layer; so its
``TransformerConfig`` raises ``ValueError("Delayed scaling does not support first / last layer
in BF16.")``. Here the inner region is *disabled* inside one outer enabled region: the depth
returns to 0 once per forward, exactly as in plain TE, and the BF16 module simply contributes no
amax (TE's fused update leaves its history and scale frozen). The opposite nesting (outer
disabled, inner enabled per module) never exits an enabled region at depth 0, so delayed scales
would silently never update: it is never used.

Stale scales and ``reseed``. A unit that sat in BF16 comes back with the history and scale of
the tensors it had *before* its recovery, and units are recovered because their gradients
spiked. ``reseed="keep"`` uses that state as it is: if the unit's magnitudes grew, its first
step back saturates (TE's casts clip at the FP8 maximum, 448 in E4M3, 57344 in E5M2); if they
shrank, the old maxima stay in the window (``amax_compute_algo="max"``) for up to
``amax_history_len`` steps and the scale wastes range meanwhile. ``reseed="reset"`` (the
default) restores the state TE starts training with, scale 1 and an empty history, in place
(TE's quantizers and amax-reduction buffers hold views of these tensors: new tensors would
silently detach them). Its cost: the first FP8 step back runs unscaled, like TE's first training
step, so for that one step values beyond the FP8 maximum saturate and values below the smallest
subnormal (2^-9 in E4M3, 2^-16 in E5M2) flush to zero; from the next step on the scale comes
from fresh amaxes only. "keep" fits short recoveries of units whose magnitudes did not move.

A stronger recovery recipe is a *different recipe class* (TE does not rebuild quantizers when
only the settings of a same-class recipe change, TE issue #3157): fidelity grows tensorwise <
blockwise, mxfp8 < bf16, and recovery must be strictly above the low-cost recipe. It is refused
when the low-cost recipe is delayed: a TE module that changes recipe class replaces its recipe
state, and the delayed-scaling state it builds on its way back is never registered again for the
amax reduction (a module registers once), so its scale would stay 1 for the rest of training.

megatron-core's TE linears as operator units: the switch is their own ``te_quant_params``.
megatron-core 0.16-0.19 subclass TE's modules (``TELinear`` and its column/row-parallel
subclasses, ``TELayerNormColumnParallelLinear``, ``TEGroupedLinear`` and its column/row
variants) and their ``forward`` opens, around TE's forward and on every call, the region that
the module's ``te_quant_params`` (a ``TEQuantizationParams``, None by default) asks for. When TE's
FP8 is enabled there (megatron's per-layer ``fp8_autocast``, or its one outer region with delayed
scaling) and the training recipe has ``override_quantized_autocast=True``, no fp8/fp4 recipe
gives ``fp8_autocast(enabled=False)`` and an fp8 recipe gives ``fp8_autocast(enabled=True,
recipe=<new object of that class>, fp8_group=<megatron's amax-reduction group>)``; with FP8 off
(a BF16 layer) it does nothing unless ``override_nonquantized_autocast``. So for a unit that *is*
one such module, :meth:`TEFp8Backend.apply` sets, on every plan change:

* recovery: ``TEQuantizationParams(training_recipe=TEQuantizationRecipe(
  override_quantized_autocast=True, override_nonquantized_autocast=False[,
  fp8_quantization_recipe=Fp8Recipe.<stronger>, fp8_format=<low_cost.fp8_format>,
  tp_only_amax_red=config.tp_only_amax_red]), evaluation_recipe=None)``, one object per module;
* low-cost: the module's original value, the very object it held when wrapped.

This is the nesting above, opened by megatron instead of the backend (megatron's own contexts
take the place of :meth:`autocast`): the inner region sits inside megatron's enabled one, so the
delayed-scaling story above holds unchanged (a module recovered in BF16 adds no amax, its state
freezes, ``reseed`` applies on its return); a stronger recipe reduces its amaxes over megatron's
group (not :attr:`amax_reduction_group`); megatron's ``will_execute_quantized`` tells the truth.
Every forward of the step reads the same attribute (micro-batches, recomputation, evaluation:
``evaluation_recipe=None``), and TE's backward uses what its forward saved in the autograd
context. :meth:`report` counts, in each forward, which of the two objects megatron read, and a
recovery forward checks that TE ran what was asked (``module.fp8`` false for BF16, else the
recipe class), raising if this megatron did not honour it. The plan is identical on every rank,
so a module switches on all tensor-parallel ranks together and TE's collectives stay matched.
Layer units (a whole transformer layer) keep nested regions and the layer-level context of
``megatron_patches``.

:meth:`TEFp8Backend.wrap` refuses, naming the module and the setting, before it installs
anything: a module whose megatron config runs another recipe or format than ``low_cost`` (or no
FP8 at all), a CUDA-graphed one (``cuda_graph_impl`` or the deprecated flags: a graph replays
the path it was captured with), one whose own ``te_quant_params`` already run it in BF16 or in a
recipe the recovery recipe is not known to be stronger than, and a megatron-core without these
fields.

NVFP4 (``low_cost={"recipe": "nvfp4"}``, TE >= 2.8). TE runs FP4 through the same autocast with
an ``NVFP4BlockScaling`` recipe (``stochastic_rounding``, ``hadamard`` and ``weight_2d`` map to
its ``disable_*`` fields; TE's defaults are NVIDIA's recipe), so both nestings above hold: a
recovered unit runs inside ``autocast(enabled=False)`` (BF16) or a stronger FP8 recipe's region
(TE warns "Recipe type changed" the first time a module flips class). NVFP4 keeps no per-module
scaling state, so nothing is reset on the way back. Under megatron-core's ``--fp4-format``,
megatron opens one NVFP4 region per layer (``get_fp4_context``, no outer region) and a
``te_quant_params`` unit overrides it as it overrides FP8 (``module_recipe`` reads FP4 as
``"nvfp4"``). FP4 GEMMs need compute capability 10.0; any other device is refused when the
backend is built, naming it (:func:`~gnmr_dist.backends.te_runtime.check_fp4_device`), because TE
fails inside its autocast's ``__enter__`` after switching its global state on.

Modules holding FP8 primary weights (``fp8_model_init``) have no high-precision weight to
recover with; they are left unwrapped, which makes their units ineligible. CUDA-graphed modules
(``te.make_graphed_callables``) replay the one path they were captured with: do not wrap them.

Layout: the option blocks and the recipe policy live in :mod:`gnmr_dist.backends.te_recipes`,
loading TE (version differences resolved by feature, not by number) and the modules'
delayed-scaling state in :mod:`gnmr_dist.backends.te_runtime`, the ``te_quant_params`` mechanism
in :mod:`gnmr_dist.integrations.megatron.te` (megatron owns it; it reaches this backend as
the integration's ``operators.switcher``).

Use::

    backend = get_backend("te_fp8", low_cost={"recipe": "delayed"}, recovery={"recipe": "bf16"})
    backend.amax_reduction_group = amax_group        # None: no reduction across ranks
    backend.wrap(units)                               # megatron: wrap(units, names=unit names)
    for step in steps:
        backend.apply(decision.active, step)
        with backend.autocast():                      # the one outer region, forward only
            loss = model(batch)
        loss.backward()
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend
from gnmr_dist.backends.operators import GemmAdapter, ModuleSwitch
from gnmr_dist.backends.registry import register_backend
from gnmr_dist.backends.te_recipes import TELowCostOptions, TERecoveryOptions, check_pair
from gnmr_dist.backends.te_runtime import (
    TE_MODULE_TYPES,
    build_recipe,
    check_available,
    is_te_module,
    load_te,
    reset_delayed_scaling,
)

__all__ = [
    "TE_MODULE_TYPES",
    "TEFp8Backend",
    "TELowCostOptions",
    "TERecoveryOptions",
    "is_te_module",
    "reset_delayed_scaling",
]

logger = logging.getLogger(__name__)


@register_backend("te_fp8")
class TEFp8Backend(PrecisionBackend):
    """Transformer Engine FP8 on the low-cost path, BF16 or a stronger recipe on recovery.

    Options: ``low_cost`` (:class:`TELowCostOptions`, default ``{"recipe": "delayed",
    "fp8_format": "hybrid"}`` = TE's ``DelayedScaling()``) and ``recovery``
    (:class:`TERecoveryOptions`, default ``{"recipe": "bf16"}``). ``amax_reduction_group`` (a
    process group, also settable as an attribute before the first :meth:`autocast`) is passed to
    every region. The training loop enters :meth:`autocast` around each forward.

    Raises ``ImportError`` without Transformer Engine and ``RuntimeError`` when a recipe cannot
    run on this machine; both point to the ``fp8_emulated`` backend.

    ``"gnmr"``::

        {"backend": "te_fp8", "low_cost": {"recipe": "delayed", "fp8_format": "hybrid"},
         "recovery": {"recipe": "bf16"}, "max_active": 4}
    """

    operator_types = TE_MODULE_TYPES
    LowCost = TELowCostOptions
    Recovery = TERecoveryOptions
    low_cost: TELowCostOptions
    recovery: TERecoveryOptions

    def __init__(self, *, amax_reduction_group: Any = None, **blocks: Any) -> None:
        super().__init__(**blocks)
        check_pair(self.low_cost.recipe, self.recovery.recipe)
        self.amax_reduction_group = amax_reduction_group
        """Process group over which delayed-scaling amaxes are reduced (None: this rank)."""
        self._te = load_te()
        self.low_cost_recipe = self._recipe(self.low_cost.recipe)
        """The TE recipe object of the outer region."""
        self.recovery_recipe = (
            None if self.recovery.recipe == "bf16" else self._recipe(self.recovery.recipe)
        )
        """The TE recipe object of the inner region, or None for BF16."""
        self._warned_no_fp8 = False
        self._warned_fp8_weights = False
        self._switches: dict[int, ModuleSwitch] = {}
        logger.info(
            "te_fp8: transformer_engine %s (%s), low-cost %s, recovery %s",
            self._te.version,
            "autocast" if self._te.new_autocast else "fp8_autocast",
            self.low_cost.recipe,
            self.recovery.recipe,
        )

    def _recipe(self, name: str) -> Any:
        check_available(self._te, name)
        low = self.low_cost
        return build_recipe(
            self._te, name, low.fp8_format, low.delayed_kwargs(), low.nvfp4_kwargs()
        )

    @property
    def te_version(self) -> str:
        """The installed ``transformer_engine.__version__``."""
        return self._te.version

    # ------------------------------------------------------------------ regions

    def _region(self, enabled: bool, recipe: Any) -> contextlib.AbstractContextManager[Any]:
        """A TE autocast region, with the argument names of the installed version."""
        te, group = self._te.pytorch, self.amax_reduction_group
        region: contextlib.AbstractContextManager[Any]
        if self._te.new_autocast:
            region = te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
        else:
            region = te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)
        return region

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The ONE outer FP8 region, entered around the whole forward of each micro-batch.

        Enabled, with the low-cost recipe and :attr:`amax_reduction_group`. Enter it once per
        forward (not per layer, and not around the backward): delayed scaling reduces amaxes when
        it exits.
        """
        return self._region(True, self.low_cost_recipe)

    step_context = autocast
    """Alias of :meth:`autocast` for integrations that wrap "the step's forward"."""

    def recovery_region(self) -> contextlib.AbstractContextManager[Any]:
        """The inner region of a recovered unit (also megatron's layer units' region,
        :meth:`PrecisionBackend.recovery_region`).

        BF16 passes the low-cost recipe along with ``enabled=False``: TE ignores it when disabled,
        and the process-global recipe stays the outer one (TE would otherwise build a default
        recipe object on every call).
        """
        if self.recovery_recipe is None:
            return self._region(False, self.low_cost_recipe)
        return self._region(True, self.recovery_recipe)

    # ------------------------------------------------------------------ units

    def supports(self, module: nn.Module) -> bool:
        """TE linear-type modules (and subclasses) with high-precision weights."""
        if not is_te_module(module):
            return False
        if getattr(module, "primary_weights_in_fp8", False):
            if not self._warned_fp8_weights:
                logger.warning(
                    "te_fp8: %s holds FP8 primary weights (fp8_model_init); it has no "
                    "high-precision weight to recover with and is left unwrapped",
                    type(module).__name__,
                )
                self._warned_fp8_weights = True
            return False
        return True

    def wrap(
        self, units: Mapping[int, nn.Module], *, names: Mapping[int, str] | None = None
    ) -> None:
        """Install the switch on every unit; ``names`` (unit id -> name) label error messages.

        An operator unit that switches its own precision through a framework setting (the
        integration's :attr:`~gnmr_dist.backends.operators.Operators.switcher`: a megatron-core
        TE linear's ``te_quant_params``) is switched through it (checked here, before anything
        is installed); every other unit, layer units included, through nested regions.
        """
        switcher, labels = self.operators.switcher, names or {}
        switches = {
            uid: switch
            for uid, mod in units.items()
            if switcher is not None and self.supports(mod)
            if (switch := switcher(mod, labels.get(uid, f"unit {uid}"), self)) is not None
        }
        self._switches.update(switches)
        try:
            super().wrap(units)
        except Exception:
            for uid in switches:
                del self._switches[uid]
            raise

    def unwrap(self) -> None:
        """Original ``te_quant_params`` objects back, then every installed forward removed."""
        for switch in self._switches.values():
            switch.restore()
        self._switches.clear()
        super().unwrap()

    @property
    def switched_units(self) -> frozenset[int]:
        """Units switched through their own framework setting (megatron's ``te_quant_params``;
        the others: by regions)."""
        return frozenset(self._switches)

    def _switching(
        self, uid: int, op: nn.Module, adapter: GemmAdapter | None
    ) -> Callable[..., Any]:
        switch = self._switches.get(uid)
        if switch is None or switch.module is not op:
            return super()._switching(uid, op, adapter)
        forward = types.MethodType(type(op).forward, op)

        def counted(*args: Any, **kwargs: Any) -> Any:  # megatron's forward opens the region
            path = self._begin_forward(uid, lambda _: switch.path())
            out = forward(*args, **kwargs)
            if path == RECOVERY:
                switch.check_recovered()
            else:
                self._warn_if_fp8_off(op)
            return out

        return counted

    def make_forward(self, op: nn.Module, path: str) -> Callable[..., Any]:
        forward = types.MethodType(type(op).forward, op)
        if path == LOW_COST:
            return self._low_cost_forward(op, forward)
        return self._recovery_forward(forward)

    def _warn_if_fp8_off(self, op: nn.Module) -> None:
        if not self._warned_no_fp8 and not getattr(op, "fp8", True):
            self._warned_no_fp8 = True
            logger.warning(
                "te_fp8: a low-cost %s ran with FP8 off; enter `backend.autocast()` (or "
                "megatron's FP8 context) around the forward",
                type(op).__name__,
            )

    def _low_cost_forward(self, op: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            self._warn_if_fp8_off(op)
            return out

        return run

    def _recovery_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.recovery_region():
                return forward(*args, **kwargs)

        return run

    def fp8_ran(self, unit: int) -> bool:
        """Whether every TE module of ``unit`` ran FP8 in its last forward (``module.fp8``).

        ``False`` for a unit recovered in BF16; ``True`` on the low-cost path inside
        :meth:`autocast` and for a unit recovered with a stronger FP8 recipe.
        """
        if unit not in self._wrapped:
            raise KeyError(f"unit {unit} is not wrapped by the te_fp8 backend")
        return all(bool(getattr(m, "fp8", False)) for m in self._wrapped[unit])

    # ------------------------------------------------------------------ plan changes

    def on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
        """Set ``te_quant_params`` of the switched megatron modules to the plan, then reset the
        delayed-scaling state of units returning to FP8 (``reseed="reset"``)."""
        _set_quant_params(self._switches.items(), after)
        if self.low_cost.recipe != "delayed" or self.low_cost.reseed_mode == "keep":
            return
        returning = sorted(u for u in before - after if u in self._wrapped)
        for uid in returning:
            for module in self._wrapped[uid]:
                reset_delayed_scaling(module)
        if returning:
            logger.debug("te_fp8: reset delayed scaling of units %s", returning)


def _set_quant_params(
    switches: Iterable[tuple[int, ModuleSwitch]], recover: frozenset[int]
) -> None:
    """The plan onto ``te_quant_params``: all values checked first, then all set."""
    switches = list(switches)
    for _, switch in switches:
        switch.path()
    for uid, switch in switches:
        switch.set(uid in recover)
