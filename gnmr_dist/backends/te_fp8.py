"""``te_fp8``: Transformer Engine FP8/FP4 per unit, switched by nesting TE's own autocast regions.

``te.pytorch.autocast(enabled, recipe, ...)`` (called ``fp8_autocast`` before TE 2.9) sets a
process-global state; every TE module (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
``GroupedLinear``) reads it when its forward starts and records in its autograd context what it
ran, so its backward repeats the forward's choice. Regions nest and the innermost one governs.
The two paths of a unit are therefore two nestings of the module's own, unchanged forward:

    with backend.autocast():                    # ONE outer region per forward: enabled, low-cost
        ...                                     #   recipe, amax_reduction_group
        low-cost unit:  Linear.forward(x)       #   runs the low-cost recipe
        recovered unit: with autocast(enabled=False):           # recipe "bf16"
                            Linear.forward(x)   #   BF16 in forward AND backward
                   or:  with autocast(enabled=True, recipe=R):  # a stronger recipe R
                            Linear.forward(x)

The switch is the frozenset the base class reads in every forward: no module is rebuilt, no
parameter moves, and activation recomputation sees the same plan. The inner region is
*disabled* inside one outer enabled region, so delayed scaling's amaxes are reduced once per
forward, as in plain TE, and a BF16 module contributes none. Why megatron-core refuses BF16
layers under delayed scaling and this nesting does not need to, ``reseed``, which recovery
recipes are allowed, megatron's TE linears switched through their own ``te_quant_params``
(:class:`~gnmr_dist.backends.base.Operators`' switcher), what :meth:`TEFp8Backend.wrap` refuses,
and NVFP4: ``docs/backends.md#inside-te_fp8``.

Layout: options and recipe policy in :mod:`~gnmr_dist.backends.te_recipes`, loading TE (by
feature, not version number) and delayed-scaling state in :mod:`~gnmr_dist.backends.te_runtime`,
``gnmr.gemms`` in :mod:`~gnmr_dist.backends.te_gemms`, ``te_quant_params`` in
:mod:`gnmr_dist.integrations.megatron.te`, ``B(u)`` by the shadow route in
:mod:`~gnmr_dist.backends.te_shadow`.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend
from gnmr_dist.backends.gemms import ALL_GEMMS, subset_error
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.operators import GemmAdapter, ModuleSwitch
from gnmr_dist.backends.registry import register_backend
from gnmr_dist.backends.shadow import ShadowRecipe, ShadowRoute
from gnmr_dist.backends.te_gemms import (
    CUSTOM,
    OVERRIDE,
    REGIONS,
    choose_route,
    custom_recipe,
    te_features,
)
from gnmr_dist.backends.te_recipes import (
    FORMATS,
    TELowCostOptions,
    TERecoveryOptions,
    canonical_recipe,
    check_pair,
)
from gnmr_dist.backends.te_runtime import (
    TE_MODULE_TYPES,
    build_recipe,
    check_available,
    is_te_module,
    load_te,
    reset_delayed_scaling,
)
from gnmr_dist.backends.te_shadow import check_module, delayed_sources, gemm_input, shadow_recipe

__all__ = [
    "TE_MODULE_TYPES",
    "TEFp8Backend",
    "TELowCostOptions",
    "TERecoveryOptions",
    "is_te_module",
    "reset_delayed_scaling",
]

logger = logging.getLogger(__name__)

DEFAULT_ERROR_EVERY = {
    "delayed": 50,
    "tensorwise": 50,
    "blockwise": 100,
    "mxfp8": 100,
    "nvfp4": 200,
}
"""``gnmr.error_every`` of a block with ``gamma`` that gives none, per low-cost recipe: a measuring
step costs 1.42x (per-tensor), 1.59x (blockwise), 1.64x (MXFP8) and 2.13x (NVFP4) a low-cost CPU
step of the harness Llama, so these intervals keep the route within 1% (``delayed`` casts per
tensor, as ``tensorwise``)."""

_SR_SEED = 0x7E_F4
"""Mixed into the seed of ``dy``'s stochastic rounding in the shadow of an NVFP4 recipe."""


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
    reports_errors = True
    LowCost = TELowCostOptions
    Recovery = TERecoveryOptions
    low_cost: TELowCostOptions
    recovery: TERecoveryOptions

    @classmethod
    def default_error_every(cls, low_cost: Mapping[str, Any]) -> int:
        """Per low-cost recipe (:data:`DEFAULT_ERROR_EVERY`): the smallest interval at which the
        shadow route's measuring steps cost at most 1% of the low-cost path's steps on the
        harness Llama on a CPU (``benchmarks/results/overhead_shadow.json``; a GPU's casts weigh
        less against its FP8 GEMMs)."""
        recipe = canonical_recipe(low_cost.get("recipe", TELowCostOptions.recipe))
        return DEFAULT_ERROR_EVERY.get(recipe, 100) if isinstance(recipe, str) else 100

    def __init__(self, *, amax_reduction_group: Any = None, **blocks: Any) -> None:
        super().__init__(**blocks)
        check_pair(self.low_cost.recipe, self.recovery.recipe)
        self.amax_reduction_group = amax_reduction_group
        """Process group over which delayed-scaling amaxes are reduced (None: this rank)."""
        self._te = load_te(fp4="nvfp4" in (self.low_cost.recipe, self.recovery.recipe))
        self.low_cost_recipe = self._recipe(self.low_cost.recipe)
        """The TE recipe object of the outer region."""
        self.recovery_recipe = (
            None if self.recovery.recipe == "bf16" else self._recipe(self.recovery.recipe)
        )
        """The TE recipe object of the inner region, or None for BF16."""
        self.route = REGIONS
        """How a recovered unit runs ``gnmr.gemms`` (:mod:`~gnmr_dist.backends.te_gemms`):
        ``"regions"`` (all three), ``"backward_override"`` or ``"custom_recipe"``."""
        self.subset_recipe: Any = None
        """The inner region's recipe of the two subset routes (None: :attr:`recovery_recipe`)."""
        self._warned_no_fp8 = False
        self._warned_fp8_weights = False
        self._switches: dict[int, ModuleSwitch] = {}
        self._labels: dict[int, str] = {}
        self._shadow: ShadowRoute | None = None
        self.shadow_recipe: ShadowRecipe | None = None
        """The recipe the shadow route quantizes with (``gnmr.gamma``; ``None`` until
        :meth:`track_errors`)."""
        self._shadow_calls: dict[int, int] = {}  # id(module) -> measured calls this step
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

    def _route_of(self, gemms: frozenset[str]) -> str:
        features = te_features(self._te.recipe, self.low_cost.recipe)
        return choose_route(self.low_cost.recipe, self.recovery.recipe, gemms, features)

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """Refuse a subset no Transformer Engine route runs here (:func:`~gnmr_dist.backends.
        te_gemms.choose_route`: the routes, their TE versions and costs)."""
        self._route_of(gemms)

    def set_gemms(self, gemms: Iterable[str]) -> None:
        """:meth:`PrecisionBackend.set_gemms`, then the recipe of the subset's inner region:
        the low-cost recipe with ``backward_override="high_precision"``, or a ``CustomRecipe``
        of per-layout quantizers."""
        super().set_gemms(gemms)
        self.route, self.subset_recipe = self._route_of(self.gemms), None
        low = self.low_cost
        if self.route == OVERRIDE:
            self.subset_recipe = build_recipe(
                self._te,
                low.recipe,
                low.fp8_format,
                low.delayed_kwargs(),
                low.nvfp4_kwargs(),
                backward_override="high_precision",
            )
        elif self.route == CUSTOM:
            fmt = getattr(self._te.recipe.Format, FORMATS[low.fp8_format])
            self.subset_recipe = custom_recipe(
                self._te.recipe, self.gemms, self.low_cost_recipe, self.recovery_recipe, fmt
            )
        logger.info("te_fp8: gnmr.gemms %s by route %s", sorted(self.gemms), self.route)

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
        recipe object on every call). Under ``gnmr.gemms`` a subset: an enabled region of
        :attr:`subset_recipe`.
        """
        if self.subset_recipe is not None:
            return self._region(True, self.subset_recipe)
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
        integration's ``switcher``, :class:`~gnmr_dist.backends.base.Operators`: a
        megatron-core TE linear's ``te_quant_params``) is switched through it (checked here,
        before anything is installed); every other unit, layer units included, through nested
        regions.
        """
        switcher, labels = self.operators.switcher, names or {}
        switches = {
            uid: switch
            for uid, mod in units.items()
            if switcher is not None and self.supports(mod)
            if (switch := switcher(mod, labels.get(uid, f"unit {uid}"), self)) is not None
        }
        self._check_subset(units, switches, labels)
        self._switches.update(switches)
        self._labels.update({uid: labels.get(uid, f"unit {uid}") for uid in units})
        try:
            super().wrap(units)
        except Exception:
            for uid in switches:
                del self._switches[uid]
            raise

    def _check_subset(
        self,
        units: Mapping[int, nn.Module],
        switches: Mapping[int, ModuleSwitch],
        labels: Mapping[int, str],
    ) -> None:
        """Refuse, under a subset of GEMMs, a module switched through its own framework setting
        (it names a recipe, not a region of ours) and, on the ``backward_override`` route, a
        ``LayerNormMLP`` (TE asserts it has no such backward)."""
        if self.gemms == ALL_GEMMS:
            return
        if switches:
            uid = min(switches)
            raise subset_error(
                self.name,
                self.gemms,
                f"{labels.get(uid, f'unit {uid}')} switches its precision through its own "
                "te_quant_params, which name a whole recipe (FP8 off or a recipe class), not "
                f"the inner region route {self.route!r} needs",
                "use layer units (gnmr.units: layer), or recover all three GEMMs",
            )
        if self.route != OVERRIDE:
            return
        for uid, unit in units.items():
            mlp = next((m for m in unit.modules() if _is_layernorm_mlp(m)), None)
            if mlp is not None:
                raise subset_error(
                    self.name,
                    self.gemms,
                    f"unit {labels.get(uid, uid)} holds a LayerNormMLP, which TE runs with no "
                    "backward_override (transformer_engine/pytorch/module/layernorm_mlp.py: "
                    "'not implemented in LayerNormMLP')",
                    "replace LayerNormMLP with LayerNormLinear + Linear, exclude the unit, or "
                    "recover all three GEMMs",
                )

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
            outer, self._unit = self._unit, uid
            try:
                out = forward(*args, **kwargs)
                if path == RECOVERY:
                    switch.check_recovered()
                else:
                    self._warn_if_fp8_off(op)
                self._measure(uid, op, path, args, kwargs, out)
            finally:
                self._unit = outer
            return out

        return counted

    def make_forward(self, op: nn.Module, path: str) -> Callable[..., Any]:
        forward = types.MethodType(type(op).forward, op)
        if path == LOW_COST:
            return self._low_cost_forward(op, forward)
        return self._recovery_forward(op, forward)

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
            if self._unit is not None:
                self._measure(self._unit, op, LOW_COST, args, kwargs, out)
            return out

        return run

    def _recovery_forward(self, op: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.recovery_region():
                out = forward(*args, **kwargs)
            if self._unit is not None:
                self._measure(self._unit, op, RECOVERY, args, kwargs, out)
            return out

        return run

    # ------------------------------------------------------------------ the damage term

    def track_errors(self, num_units: int | None, every: int = 1) -> None:
        """:meth:`PrecisionBackend.track_errors`, then the shadow route of the low-cost recipe
        (:mod:`~gnmr_dist.backends.te_shadow`): refuses, naming the unit, a module or recipe
        setting the route does not reproduce."""
        recipe = None
        if num_units is not None:
            low = self.low_cost
            margin = low.delayed_kwargs()["margin"]
            recipe = shadow_recipe(low.recipe, self.low_cost_recipe, low.fp8_format, margin)
            for uid, modules in sorted(self._wrapped.items()):
                for module in modules:
                    check_module(self._labels.get(uid, f"unit {uid}"), module)
        super().track_errors(num_units, every)
        self.shadow_recipe = recipe if self._errors is not None else None
        self._shadow = None if self.shadow_recipe is None else ShadowRoute(self.shadow_recipe)
        if self.shadow_recipe is not None:
            logger.info("te_fp8: damage term by the shadow route, %s", self.shadow_recipe)

    def apply(self, active: Iterable[int], step: int) -> None:
        """:meth:`PrecisionBackend.apply`; the shadow's call counts start again."""
        self._shadow_calls = {}
        super().apply(active, step)

    def _measure(
        self,
        uid: int,
        op: nn.Module,
        path: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
    ) -> None:
        """On a measuring step, give the shadow route this call's GEMM input and output."""
        route = self._shadow
        if route is None or self._error_probe() is None or self._errors is None:
            return
        x = (
            args[0]
            if args
            else next((kwargs[k] for k in ("inp", "x", "input_", "input") if k in kwargs), None)
        )
        y = out[0] if isinstance(out, tuple) else out
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            return
        recipe = self.shadow_recipe
        assert recipe is not None
        x_scale, dy_scale = None, None
        if recipe.name == "delayed":
            keep = self.low_cost.reseed_mode == "keep"
            x_scale, dy_scale = delayed_sources(op, path == RECOVERY, keep)
        n = self._shadow_calls.get(id(op), 0)
        self._shadow_calls[id(op)] = n + 1
        index = next((i for i, m in enumerate(self._wrapped.get(uid, ())) if m is op), -1)
        seed = sr_seed(_SR_SEED, self._step, uid, index, n) if recipe.stochastic else None
        xg = gemm_input(op, x, fused_cast=recipe.name == "delayed")
        route.measure(self._errors, uid, xg, y, x_scale=x_scale, dy_scale=dy_scale, seed=seed)

    def fp8_ran(self, unit: int) -> bool:
        """Whether every TE module of ``unit`` ran FP8 in its last forward (``module.fp8``).

        ``False`` for a unit recovered in BF16; ``True`` on the low-cost path inside
        :meth:`autocast`, for a unit recovered with a stronger FP8 recipe, and for one that
        recovers a subset of its GEMMs (``gnmr.gemms``: its region is enabled).
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


def _is_layernorm_mlp(module: nn.Module) -> bool:
    """TE's ``LayerNormMLP`` or a subclass (matched by name and package, nothing imported)."""
    return any(
        cls.__name__ == "LayerNormMLP" and cls.__module__.startswith("transformer_engine.")
        for cls in type(module).__mro__
    )


def _set_quant_params(
    switches: Iterable[tuple[int, ModuleSwitch]], recover: frozenset[int]
) -> None:
    """The plan onto ``te_quant_params``: all values checked first, then all set."""
    switches = list(switches)
    for _, switch in switches:
        switch.path()
    for uid, switch in switches:
        switch.set(uid in recover)
