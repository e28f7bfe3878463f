"""megatron-core's TE linears: one projection's precision set through its own ``te_quant_params``.

megatron-core 0.16-0.19 wrap Transformer Engine's modules in ``TELinear`` (and its subclasses
``TEColumnParallelLinear`` / ``TERowParallelLinear``), ``TELayerNormColumnParallelLinear`` and
``TEGroupedLinear`` (and ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``),
all in ``megatron/core/extensions/transformer_engine.py``. Each of them holds an attribute
``te_quant_params: TEQuantizationParams | None`` (``None`` after ``__init__``; ``finish_init``
fills it from ``config.quant_recipe``) and its ``forward`` reads it on *every* call::

    quant_context = _get_fp8_autocast_for_quant_params(self.te_quant_params, self.training)
    with quant_context:
        out = super().forward(x, is_first_microbatch=...)

``_get_fp8_autocast_for_quant_params`` picks ``training_recipe`` (or ``evaluation_recipe`` when
``not self.training`` and one is set) and ``_get_fp8_autocast_for_quant_recipe`` turns it into a
TE region: if TE's FP8 is enabled at that point (megatron's per-layer or outer ``fp8_autocast``)
and ``override_quantized_autocast`` is true, a recipe with neither ``fp8_quantization_recipe``
nor ``fp4_quantization_recipe`` gives ``fp8_autocast(enabled=False)`` (the module runs BF16), and
an FP8 recipe gives ``fp8_autocast(enabled=True, fp8_recipe=<new recipe object of that class,
fp8_format>, fp8_group=<megatron's amax-reduction group>)``; with FP8 disabled it only acts when
``override_nonquantized_autocast`` is true, otherwise it returns ``nullcontext()``.

This module holds the mechanism (detection, the two values of ``te_quant_params``, the checks
made when wrapping and while a step runs) and reaches the ``te_fp8`` backend as
``MEGATRON_OPERATORS.switcher`` (:mod:`~gnmr_dist.integrations.megatron.operators`);
:mod:`gnmr_dist.backends.te_fp8` holds the policy (which recipes may recover which) and explains
the precision consequences.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend
from gnmr_dist.backends.te_recipes import RECIPES, check_own

__all__ = [
    "MEGATRON_TE_LINEARS",
    "QuantParamsSwitch",
    "cuda_graph_setting",
    "is_megatron_te_linear",
    "megatron_outer_recipe",
    "module_recipe",
    "quant_params_switch",
    "te_quant_params_switcher",
]

MEGATRON_TE_LINEARS = frozenset(
    {
        "TELinear",
        "TEColumnParallelLinear",
        "TERowParallelLinear",
        "TELayerNormColumnParallelLinear",
        "TEGroupedLinear",
        "TEColumnParallelGroupedLinear",
        "TERowParallelGroupedLinear",
    }
)
"""megatron-core's wrappers of Transformer Engine linears: their forward reads
``self.te_quant_params`` (0.16-0.19); subclasses (0.19's ``TELMHeadColumnParallelLinear``) are
matched through their MRO by :func:`is_megatron_te_linear`. Operator classes of megatron's units
(:data:`~gnmr_dist.integrations.megatron.operators.MEGATRON_OPERATORS`)."""

_RECIPE_FIELDS = frozenset(
    {
        "fp8_quantization_recipe",
        "fp4_quantization_recipe",
        "fp8_format",
        "override_quantized_autocast",
        "override_nonquantized_autocast",
        "tp_only_amax_red",
    }
)
_PARAMS_FIELDS = frozenset({"training_recipe", "evaluation_recipe"})


def _megatron_class(module: nn.Module) -> type | None:
    for cls in type(module).__mro__:
        if cls.__name__ in MEGATRON_TE_LINEARS and cls.__module__.startswith("megatron."):
            return cls
    return None


def is_megatron_te_linear(module: nn.Module) -> bool:
    """A megatron-core TE linear (or subclass) with a ``te_quant_params`` attribute.

    Matched by class name and defining package; megatron is never imported here.
    """
    return _megatron_class(module) is not None and hasattr(module, "te_quant_params")


def _name(value: Any) -> str | None:
    """A recipe setting as megatron spells it (``Fp8Recipe.tensorwise`` -> ``"tensorwise"``)."""
    return None if value is None else str(getattr(value, "value", value))


def megatron_outer_recipe(config: Any) -> str:
    """What megatron's own context runs a layer in: ``config.fp8_recipe``, FP4's, or ``"bf16"``.

    ``get_fp8_context`` enters ``fp8_autocast(enabled=True, recipe of config.fp8_recipe)`` when
    ``config.fp8`` is set (the first/last ``num_layers_at_*_in_bf16`` layers excepted).
    """
    if getattr(config, "fp8", None):
        return _name(getattr(config, "fp8_recipe", None)) or "delayed"
    if getattr(config, "fp4", None):
        return _name(getattr(config, "fp4_recipe", None)) or "nvfp4"
    return "bf16"


def module_recipe(params: Any, outer: str) -> str:
    """The recipe a module with ``te_quant_params=params`` runs in under megatron's ``outer``.

    Mirrors ``_get_fp8_autocast_for_quant_recipe`` for the training recipe: the module's own
    setting applies only when it overrides the outer state (quantized or not).
    """
    if params is None:
        return outer
    recipe = params.training_recipe
    flag = "override_quantized_autocast" if outer != "bf16" else "override_nonquantized_autocast"
    if not getattr(recipe, flag):
        return outer
    own = _name(recipe.fp8_quantization_recipe) or _name(recipe.fp4_quantization_recipe)
    return own or "bf16"


def cuda_graph_setting(config: Any) -> str | None:
    """The megatron setting that CUDA-graphs the module's layer (``None`` when none does)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        return f"cuda_graph_impl={impl!r}"
    for flag in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, flag, False):
            return f"{flag}=True"
    return None


def _megatron_namespace(module: nn.Module, label: str) -> types.ModuleType:
    """megatron's ``extensions/transformer_engine`` module, checked for the fields used here."""
    cls = _megatron_class(module)
    assert cls is not None
    namespace = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
    needed = ("TEQuantizationParams", "TEQuantizationRecipe", "Fp8Recipe")
    missing = [n for n in needed if not hasattr(namespace, n)]
    if not missing:
        have = {f.name for f in dataclasses.fields(namespace.TEQuantizationRecipe)}
        have |= {f.name for f in dataclasses.fields(namespace.TEQuantizationParams)}
        missing = sorted((_RECIPE_FIELDS | _PARAMS_FIELDS) - have)
    if missing:
        raise RuntimeError(
            f"te_fp8: {label} comes from {cls.__module__}, which lacks {missing}: this "
            "megatron-core has no per-module te_quant_params switch (read in 0.16-0.19); use "
            "layer units (gnmr.units='layer') or a megatron-core from 0.16 to 0.19"
        )
    return namespace


@dataclass
class QuantParamsSwitch:
    """One megatron TE linear whose path is the value of its ``te_quant_params``."""

    module: nn.Module
    label: str
    """How error messages name the module: ``"<unit name> (<class>)"``."""
    original: Any
    """The module's own value when wrapped: the low-cost path, restored as this very object."""
    recovery: Any
    """The ``TEQuantizationParams`` of the recovery path (one object per module)."""
    recovery_class: str | None
    """The TE recipe class of a stronger recovery recipe; ``None`` for BF16."""

    def path(self) -> str:
        """The path megatron runs next: which of the two objects the module holds."""
        current = getattr(self.module, "te_quant_params", None)
        if current is self.recovery:
            return RECOVERY
        if current is self.original:
            return LOW_COST
        raise RuntimeError(
            f"te_fp8: {self.label}: te_quant_params was replaced after backend.wrap (now "
            f"{current!r}; e.g. by finish_init): GNMR no longer knows which path it runs. Set "
            "the module's quantization before wrapping, or unwrap and wrap again"
        )

    def set(self, recover: bool) -> None:
        """Put the recovery object (or the original one, the same object) on the module."""
        self.path()  # refuse to overwrite a value set by someone else
        self.module.te_quant_params = self.recovery if recover else self.original

    def restore(self) -> None:
        """The original object back, unless someone else replaced ours."""
        if getattr(self.module, "te_quant_params", None) is self.recovery:
            self.module.te_quant_params = self.original

    def check_recovered(self) -> None:
        """After a recovery forward: TE ran what ``te_quant_params`` asked for.

        BF16: ``module.fp8`` (set by TE at the start of each forward) is false. Stronger recipe:
        if FP8 ran (the layer itself may be in BF16), its recipe is of the recovery class.
        """
        fp8 = bool(getattr(self.module, "fp8", False))
        if self.recovery_class is None:
            if fp8:
                self._refuse("FP8")
            return
        recipe = (getattr(self.module, "fp8_meta", None) or {}).get("recipe")
        if fp8 and recipe is not None and type(recipe).__name__ != self.recovery_class:
            self._refuse(type(recipe).__name__)

    def _refuse(self, ran: str) -> None:
        raise RuntimeError(
            f"te_fp8: {self.label} ran {ran} although its te_quant_params asked for "
            f"{self.recovery_class or 'BF16'}: this megatron-core's forward does not honour "
            "te_quant_params"
        )


def quant_params_switch(
    module: nn.Module,
    label: str,
    *,
    recipe: str | None,
    recipe_class: str | None,
    fp8_format: str,
) -> QuantParamsSwitch:
    """The switch of ``module``: recovery in BF16 (``recipe=None``) or megatron's ``recipe``.

    The recovery value overrides an enabled outer FP8 context only
    (``override_quantized_autocast=True``, ``override_nonquantized_autocast=False``): a module
    whose layer megatron already runs in BF16 stays BF16. Its ``evaluation_recipe`` is None, so
    evaluation forwards follow the plan too. A stronger ``recipe`` (megatron's name; TE class
    ``recipe_class``) carries the backend's ``fp8_format`` and the module's
    ``config.tp_only_amax_red``, as megatron's own per-layer context does.
    """
    namespace = _megatron_namespace(module, label)
    fields: dict[str, Any] = {
        "override_quantized_autocast": True,
        "override_nonquantized_autocast": False,
    }
    if recipe is not None:
        config = getattr(module, "config", None)
        fields |= {
            "fp8_quantization_recipe": namespace.Fp8Recipe(recipe),
            "fp8_format": fp8_format,
            "tp_only_amax_red": bool(getattr(config, "tp_only_amax_red", False)),
        }
    training = namespace.TEQuantizationRecipe(**fields)
    recovery = namespace.TEQuantizationParams(training_recipe=training, evaluation_recipe=None)
    return QuantParamsSwitch(module, label, module.te_quant_params, recovery, recipe_class)


def te_quant_params_switcher(
    module: nn.Module, name: str, backend: PrecisionBackend
) -> QuantParamsSwitch | None:
    """The ``te_quant_params`` switch of one megatron TE linear of unit ``name`` for the
    ``te_fp8`` ``backend`` (``None`` for any other module), or a ``ValueError`` naming what
    stops it: no megatron config, a CUDA-graphed layer, megatron's own recipe other than the
    backend's low-cost one, a recovery recipe not stronger than the module's own.

    The integration's ``switcher`` (:class:`~gnmr_dist.backends.base.Operators`).
    """
    if not is_megatron_te_linear(module):
        return None
    low, recovery = backend.low_cost, backend.recovery
    label = f"{name} ({type(module).__name__})"
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"te_fp8: {label} has no megatron config (module.config)")
    graphed = cuda_graph_setting(config)
    if graphed is not None:
        raise ValueError(
            f"te_fp8: {label}: megatron CUDA-graphs its layer ({graphed}); a graph replays "
            "the path it was captured with, so its te_quant_params cannot switch it. Turn "
            "CUDA graphs off or leave the module out of the units (gnmr.exclude)"
        )
    _check_outer(label, config, low)
    own = module_recipe(module.te_quant_params, megatron_outer_recipe(config))
    check_own(label, own, recovery.recipe)
    recipe = None if recovery.recipe == "bf16" else recovery.recipe
    return quant_params_switch(
        module,
        label,
        recipe=recipe,
        recipe_class=None if recipe is None else RECIPES[recipe][0],
        fp8_format=low.fp8_format,
    )


def _check_outer(label: str, config: Any, low: Any) -> None:
    """megatron's own FP8/FP4 setting of the module must be this backend's low-cost path."""
    outer = megatron_outer_recipe(config)
    if outer == "bf16":
        raise ValueError(
            f"te_fp8: {label}: megatron runs it without FP8 or FP4 (config.fp8 and "
            "config.fp4 are None), so te_fp8 has no low-cost path to switch: set "
            "config.fp8 / config.fp8_recipe (--fp8-format, --fp8-recipe) or config.fp4 "
            "(--fp4-format e2m1), or use backend 'fp8_emulated'"
        )
    if low.recipe == "nvfp4" or outer == "nvfp4":
        if outer != low.recipe:
            fp4 = getattr(config, "fp4", None)
            raise ValueError(
                f"te_fp8: {label}: megatron runs it with fp4={fp4!r}, fp8="
                f"{getattr(config, 'fp8', None)!r} (recipe {outer!r}) but gnmr.low_cost is "
                f"recipe {low.recipe!r}; make them the same (--fp4-format e2m1 with "
                "--fp4-recipe nvfp4 for low_cost 'nvfp4')"
            )
        return
    fp8 = config.fp8
    if outer != low.recipe or fp8 != low.fp8_format:
        raise ValueError(
            f"te_fp8: {label}: megatron runs it with config.fp8={fp8!r}, "
            f"fp8_recipe={outer!r} but gnmr.low_cost is recipe={low.recipe!r}, "
            f"fp8_format={low.fp8_format!r}; make them the same (the recovery checks and "
            "the delayed-scaling reseed rely on it)"
        )
