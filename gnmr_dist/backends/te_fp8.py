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

Modules holding FP8 primary weights (``fp8_model_init``) have no high-precision weight to
recover with; they are left unwrapped, which makes their units ineligible. CUDA-graphed modules
(``te.make_graphed_callables``) replay the one path they were captured with: do not wrap them.

Version differences are resolved by feature, not by number: ``te.pytorch.autocast(enabled,
recipe=, amax_reduction_group=)`` when it exists (TE >= 2.9), else ``te.pytorch.fp8_autocast(
enabled, fp8_recipe=, fp8_group=)``; ``te.pytorch.is_*_available(return_reason=True)`` (>= 2.9)
else ``te.pytorch.fp8.check_*_support()``; a recipe class missing from
``transformer_engine.common.recipe`` (``Float8CurrentScaling`` < 2.2, ``Float8BlockScaling``
< 2.3, ``MXFP8BlockScaling`` < 2.0) is an error naming the version needed.

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
import importlib
import importlib.metadata
import logging
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend
from gnmr_dist.backends.options import parse_options
from gnmr_dist.backends.te_megatron import (
    QuantParamsSwitch,
    cuda_graph_setting,
    is_megatron_te_linear,
    megatron_outer_recipe,
    module_recipe,
    quant_params_switch,
)
from gnmr_dist.core.validation import check_choice, check_nonnegative_int, check_positive_int

__all__ = [
    "TE_MODULE_TYPES",
    "TEFp8Backend",
    "TELowCostOptions",
    "TERecoveryOptions",
    "is_te_module",
    "reset_delayed_scaling",
]

logger = logging.getLogger(__name__)

TE_MODULE_TYPES = frozenset({"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"})
"""TE module classes the backend switches (megatron's ``TELinear`` & co. subclass them)."""

_RECIPES: dict[str, tuple[str, str]] = {
    "delayed": ("DelayedScaling", "1.0"),
    "tensorwise": ("Float8CurrentScaling", "2.2"),
    "blockwise": ("Float8BlockScaling", "2.3"),
    "mxfp8": ("MXFP8BlockScaling", "2.0"),
}
"""Megatron's recipe names -> (class in ``transformer_engine.common.recipe``, first TE with it)."""

_ALIASES = {"current": "tensorwise", "block": "blockwise"}
"""DESIGN.md's names ("current", "block") for Megatron's ("tensorwise", "blockwise")."""

_FIDELITY = {"delayed": 0, "tensorwise": 1, "blockwise": 2, "mxfp8": 2, "bf16": 3}
_SUPPORT_KIND = {
    "delayed": "fp8",
    "tensorwise": "fp8",
    "blockwise": "fp8_block_scaling",
    "mxfp8": "mxfp8",
}
_FORMATS = {"hybrid": "HYBRID", "e4m3": "E4M3"}
_AMAX_ALGOS = ("max", "most_recent")
_RESEEDS = ("reset", "keep")
_META_KEYS = ("scaling_fwd", "scaling_bwd")
_DELAYED_DEFAULTS = {"amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0}
"""TE's own ``DelayedScaling`` defaults: an empty ``low_cost`` block equals plain TE."""

_NO_TE_HINT = (
    "Without an NVIDIA GPU, use the 'fp8_emulated' backend, which emulates FP8 GEMMs with "
    "tensor-, row- or block-wise scales on CPU and GPU."
)


def _canonical_recipe(recipe: Any) -> Any:
    """A recipe name with Megatron's aliases resolved (anything else as given, for the check)."""
    return _ALIASES.get(recipe, recipe) if isinstance(recipe, str) else recipe


@dataclass(frozen=True)
class TELowCostOptions:
    """The low-cost path: the recipe of the one outer FP8 region."""

    recipe: str = "delayed"
    """``"delayed"`` | ``"tensorwise"`` | ``"blockwise"`` | ``"mxfp8"`` (Megatron's names)."""
    fp8_format: str = "hybrid"
    """``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``; also used by recovery."""
    amax_history_len: int | None = None
    """Delayed only: amax history length (TE default 1024)."""
    amax_compute_algo: str | None = None
    """Delayed only: ``"max"`` over the history (TE default) or ``"most_recent"``."""
    margin: int | None = None
    """Delayed only: scale = FP8_max / amax / 2^margin (TE default 0)."""
    reseed: str | None = None
    """Delayed only, for a unit back from recovery: ``"reset"`` (default) its scale to 1 and its
    amax history to 0, or ``"keep"`` the frozen ones (the trade-off: module docstring)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", _canonical_recipe(self.recipe))
        check_choice(self.recipe, sorted(_RECIPES), "recipe")
        check_choice(self.fp8_format, sorted(_FORMATS), "fp8_format")
        if self.recipe != "delayed":
            self._refuse_delayed_only()
        if self.amax_history_len is not None:
            check_positive_int(self.amax_history_len, "amax_history_len")
        if self.margin is not None:
            check_nonnegative_int(self.margin, "margin")
        if self.amax_compute_algo is not None:
            check_choice(self.amax_compute_algo, sorted(_AMAX_ALGOS), "amax_compute_algo")
        if self.reseed is not None:
            check_choice(self.reseed, sorted(_RESEEDS), "reseed")

    def _refuse_delayed_only(self) -> None:
        for name in (*_DELAYED_DEFAULTS, "reseed"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} applies only to recipe 'delayed' (recipe is {self.recipe!r})"
                )

    @property
    def reseed_mode(self) -> str:
        """``reseed`` with its default filled in."""
        return self.reseed or "reset"

    def delayed_kwargs(self) -> dict[str, Any]:
        """``DelayedScaling`` keyword arguments (without ``fp8_format``), defaults filled in."""
        given = {k: getattr(self, k) for k in _DELAYED_DEFAULTS}
        return {k: _DELAYED_DEFAULTS[k] if v is None else v for k, v in given.items()}


@dataclass(frozen=True)
class TERecoveryOptions:
    """The recovery path: FP8 off for the unit, or a stronger recipe in an inner region."""

    recipe: str = "bf16"
    """``"bf16"`` (FP8 off) | ``"tensorwise"`` | ``"blockwise"`` | ``"mxfp8"``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", _canonical_recipe(self.recipe))
        check_choice(self.recipe, sorted([*_RECIPES.keys() - {"delayed"}, "bf16"]), "recipe")


# ---------------------------------------------------------------------- loading TE


@dataclass(frozen=True)
class _TE:
    """The installed Transformer Engine, as far as this backend uses it."""

    version: str
    pytorch: types.ModuleType
    recipe: types.ModuleType
    new_autocast: bool
    """``te.pytorch.autocast`` exists (TE >= 2.9); else ``fp8_autocast``."""


def _te_version(root: types.ModuleType) -> str:
    version = getattr(root, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _load_te() -> _TE:
    """Import Transformer Engine, or raise an ``ImportError`` that says what to do."""
    try:
        root = importlib.import_module("transformer_engine")
        te_pytorch = importlib.import_module("transformer_engine.pytorch")
        recipe = importlib.import_module("transformer_engine.common.recipe")
    except (ImportError, OSError, RuntimeError) as err:
        cuda = "a CUDA device is visible" if torch.cuda.is_available() else "no CUDA device"
        raise ImportError(
            "the 'te_fp8' backend needs NVIDIA Transformer Engine and a CUDA GPU "
            f"(import failed: {err}; {cuda}). Install it on a GPU machine with "
            "`pip install --no-build-isolation transformer_engine[pytorch]` (or use an NGC "
            f"PyTorch container). {_NO_TE_HINT}"
        ) from err
    new = hasattr(te_pytorch, "autocast")
    if not new and not hasattr(te_pytorch, "fp8_autocast"):
        raise ImportError(f"transformer_engine {_te_version(root)} has no fp8_autocast/autocast")
    return _TE(_te_version(root), te_pytorch, recipe, new)


def _support(te: _TE, kind: str) -> tuple[bool, str] | None:
    """TE's own answer to "can recipe family ``kind`` run here?", or None if it cannot say."""
    query = getattr(te.pytorch, f"is_{kind}_available", None)
    if query is not None:
        ok, reason = query(return_reason=True)
        return bool(ok), str(reason)
    legacy = importlib.import_module("transformer_engine.pytorch.fp8")
    check = getattr(legacy, f"check_{kind}_support", None)
    if check is None:
        return None
    ok, reason = check()
    return bool(ok), str(reason)


def _check_available(te: _TE, name: str) -> None:
    """Raise a ``RuntimeError`` naming TE's reason when recipe ``name`` cannot run here."""
    try:
        answer = _support(te, _SUPPORT_KIND[name])
    except Exception as err:  # no device: TE's capability query fails inside torch.cuda
        answer = (False, f"{type(err).__name__}: {err}")
    if answer is not None and not answer[0]:
        raise RuntimeError(
            f"the 'te_fp8' backend cannot run recipe {name!r} here: {answer[1]} "
            f"(transformer_engine {te.version}). {_NO_TE_HINT}"
        )


def _build_recipe(te: _TE, name: str, fp8_format: str, delayed: Mapping[str, Any]) -> Any:
    """The TE recipe object for Megatron's recipe ``name``."""
    cls_name, since = _RECIPES[name]
    cls = getattr(te.recipe, cls_name, None)
    if cls is None:
        raise RuntimeError(
            f"recipe {name!r} ({cls_name}) needs transformer_engine >= {since}; "
            f"installed: {te.version}. Upgrade Transformer Engine or choose another recipe."
        )
    fmt = getattr(te.recipe.Format, _FORMATS[fp8_format])
    if name == "delayed":
        return cls(fp8_format=fmt, **delayed)
    return cls(fp8_format=fmt)


# ---------------------------------------------------------------------- module state


def is_te_module(module: nn.Module) -> bool:
    """True for a TE linear-type module or a subclass of one (megatron's ``TELinear`` & co.).

    Matched by class name and defining package, so nothing is imported (``torch.nn.Linear`` is
    also called ``Linear``; the package tells them apart).
    """
    return any(
        cls.__name__ in TE_MODULE_TYPES and cls.__module__.startswith("transformer_engine.")
        for cls in type(module).__mro__
    )


def _delayed_states(module: nn.Module) -> tuple[list[Any], int]:
    """(the delayed-scaling states in ``module.fp8_meta``, how many scaling states it has)."""
    meta = getattr(module, "fp8_meta", None) or {}
    present = [meta[k] for k in _META_KEYS if k in meta]
    delayed = [s for s in present if hasattr(s, "scale") and hasattr(s, "amax_history")]
    return delayed, len(present)


def reset_delayed_scaling(module: nn.Module) -> int:
    """Reset ``module``'s delayed-scaling scale to 1 and amax history to 0, in place.

    Uses TE's ``reset_fp8_meta_tensors()`` when every scaling state of the module is a
    delayed one; otherwise fills the tensors in place (``scale_inv`` too, on TE 1.x). The
    tensor objects stay the same: TE's quantizers and amax-reduction buffers hold views of them.
    Returns the number of states reset (0 for a module that never ran delayed scaling).
    """
    states, present = _delayed_states(module)
    if not states:
        return 0
    reset = getattr(module, "reset_fp8_meta_tensors", None)
    if callable(reset) and len(states) == present:
        reset()
        return len(states)
    with torch.no_grad():
        for state in states:
            state.scale.fill_(1.0)
            state.amax_history.zero_()
            scale_inv = getattr(state, "scale_inv", None)
            if isinstance(scale_inv, torch.Tensor):
                scale_inv.fill_(1.0)
    return len(states)


# ---------------------------------------------------------------------- the backend


class TEFp8Backend(PrecisionBackend):
    """Transformer Engine FP8 on the low-cost path, BF16 or a stronger recipe on recovery.

    Options: ``low_cost`` (:class:`TELowCostOptions`, default ``{"recipe": "delayed",
    "fp8_format": "hybrid"}`` = TE's ``DelayedScaling()``) and ``recovery``
    (:class:`TERecoveryOptions`, default ``{"recipe": "bf16"}``). ``amax_reduction_group`` (a
    process group, also settable as an attribute before the first :meth:`autocast`) is passed to
    every region. The training loop enters :meth:`autocast` around each forward.

    Raises ``ImportError`` without Transformer Engine and ``RuntimeError`` when a recipe cannot
    run on this machine; both point to the ``fp8_emulated`` backend.
    """

    name = "te_fp8"

    def __init__(
        self,
        *,
        low_cost: Mapping[str, Any] | None = None,
        recovery: Mapping[str, Any] | None = None,
        amax_reduction_group: Any = None,
    ) -> None:
        super().__init__()
        self.low_cost = parse_options(TELowCostOptions, low_cost, "gnmr.low_cost")
        self.recovery = parse_options(TERecoveryOptions, recovery, "gnmr.recovery")
        _check_pair(self.low_cost.recipe, self.recovery.recipe)
        self.amax_reduction_group = amax_reduction_group
        """Process group over which delayed-scaling amaxes are reduced (None: this rank)."""
        self._te = _load_te()
        self.low_cost_recipe = self._recipe(self.low_cost.recipe)
        """The TE recipe object of the outer region."""
        self.recovery_recipe = (
            None if self.recovery.recipe == "bf16" else self._recipe(self.recovery.recipe)
        )
        """The TE recipe object of the inner region, or None for BF16."""
        self._warned_no_fp8 = False
        self._warned_fp8_weights = False
        self._switches: dict[int, QuantParamsSwitch] = {}
        logger.info(
            "te_fp8: transformer_engine %s (%s), low-cost %s, recovery %s",
            self._te.version,
            "autocast" if self._te.new_autocast else "fp8_autocast",
            self.low_cost.recipe,
            self.recovery.recipe,
        )

    def _recipe(self, name: str) -> Any:
        _check_available(self._te, name)
        delayed = self.low_cost.delayed_kwargs()
        return _build_recipe(self._te, name, self.low_cost.fp8_format, delayed)

    @property
    def te_version(self) -> str:
        """The installed ``transformer_engine.__version__``."""
        return self._te.version

    # ------------------------------------------------------------------ regions

    def _region(self, enabled: bool, recipe: Any) -> contextlib.AbstractContextManager[Any]:
        """A TE autocast region, with the argument names of the installed version."""
        te, group = self._te.pytorch, self.amax_reduction_group
        if self._te.new_autocast:
            return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
        return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)

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
        """The inner region of a recovered unit.

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

        An operator unit that *is* a megatron-core TE linear is switched through its own
        ``te_quant_params`` (checked here, before anything is installed: see the module
        docstring); every other unit, layer units included, through nested regions.
        """
        switches = {
            uid: self._megatron_switch(mod, (names or {}).get(uid, f"unit {uid}"))
            for uid, mod in units.items()
            if is_megatron_te_linear(mod) and self.supports(mod)
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
    def quant_params_units(self) -> frozenset[int]:
        """Units switched through megatron's ``te_quant_params`` (the others: by regions)."""
        return frozenset(self._switches)

    def _megatron_switch(self, module: nn.Module, name: str) -> QuantParamsSwitch:
        """The ``te_quant_params`` switch of one megatron TE linear, or a ``ValueError``."""
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
        self._check_outer(label, config)
        own = module_recipe(module.te_quant_params, megatron_outer_recipe(config))
        _check_own(label, own, self.recovery.recipe)
        recipe = None if self.recovery.recipe == "bf16" else self.recovery.recipe
        return quant_params_switch(
            module,
            label,
            recipe=recipe,
            recipe_class=None if recipe is None else _RECIPES[recipe][0],
            fp8_format=self.low_cost.fp8_format,
        )

    def _check_outer(self, label: str, config: Any) -> None:
        """megatron's own FP8 setting of the module must be this backend's low-cost path."""
        outer, low = megatron_outer_recipe(config), self.low_cost
        if outer == "bf16":
            raise ValueError(
                f"te_fp8: {label}: megatron runs it without FP8 (config.fp8 is None), so te_fp8 "
                "has no low-cost path to switch: set config.fp8 / config.fp8_recipe (--fp8-format,"
                " --fp8-recipe) or use backend 'fp8_emulated'"
            )
        fp8 = config.fp8
        if outer != low.recipe or fp8 != low.fp8_format:
            raise ValueError(
                f"te_fp8: {label}: megatron runs it with config.fp8={fp8!r}, "
                f"fp8_recipe={outer!r} but gnmr.low_cost is recipe={low.recipe!r}, "
                f"fp8_format={low.fp8_format!r}; make them the same (the recovery checks and "
                "the delayed-scaling reseed rely on it)"
            )

    def _switching(self, uid: int, op: nn.Module, attr: str) -> Callable[..., Any]:
        switch = self._switches.get(uid)
        if switch is None or switch.module is not op:
            return super()._switching(uid, op, attr)
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

    def _forward_fn(self, op: nn.Module, path: str) -> Callable[..., Any]:
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

    def _on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
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


def _check_pair(low: str, recovery: str) -> None:
    """Refuse recovery recipes that are not safer than, or unsafe with, the low-cost one."""
    if low == "delayed" and recovery != "bf16":
        raise ValueError(
            f"gnmr.recovery.recipe {recovery!r} cannot recover units whose low-cost recipe is "
            "'delayed': a TE module that changes recipe class rebuilds its delayed-scaling state "
            "on the way back, and TE never registers the rebuilt state for the amax reduction, "
            "so its scale would stay 1. Use recovery 'bf16' or a non-delayed low-cost recipe."
        )
    if _FIDELITY[recovery] <= _FIDELITY[low]:
        stronger = sorted(r for r, f in _FIDELITY.items() if f > _FIDELITY[low])
        raise ValueError(
            f"gnmr.recovery.recipe {recovery!r} is not of higher fidelity than the low-cost "
            f"recipe {low!r}; choose one of {stronger}"
        )


def _check_own(label: str, own: str, recovery: str) -> None:
    """Recovery must be stronger than what the module runs on its own (its te_quant_params)."""
    rank = {**_FIDELITY, "nvfp4": -1}.get(own)  # None: megatron's "custom" recipe, unranked
    if own == "bf16":
        raise ValueError(
            f"te_fp8: {label}: its te_quant_params already run it in BF16 (training_recipe has "
            "no fp8/fp4 recipe), so recovery would change nothing: leave it out of the units "
            "(gnmr.exclude) or drop its entry from config.quant_recipe"
        )
    if recovery == "bf16":
        return
    if rank is None or _FIDELITY[recovery] <= rank:
        raise ValueError(
            f"te_fp8: {label}: its te_quant_params run it with recipe {own!r}, which "
            f"gnmr.recovery.recipe {recovery!r} is not known to be stronger than; use recovery "
            "'bf16' or leave the module out of the units (gnmr.exclude)"
        )


def _set_quant_params(
    switches: Iterable[tuple[int, QuantParamsSwitch]], recover: frozenset[int]
) -> None:
    """The plan onto ``te_quant_params``: all values checked first, then all set."""
    switches = list(switches)
    for _, switch in switches:
        switch.path()
    for uid, switch in switches:
        switch.set(uid in recover)
