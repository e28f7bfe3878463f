"""``te_fp8``'s option blocks, and which Transformer Engine recipe may recover which.

Megatron's recipe names (``"delayed"``, ``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``; as
docs/backends.md#te_fp8 notes, ``"current"`` and ``"block"`` are aliases; ``"nvfp4"``, megatron's
``--fp4-recipe``) map to TE recipe classes (:data:`RECIPES`). Recovery
must be of strictly higher fidelity than the low-cost recipe (:func:`check_pair`) and than what a
megatron module runs on its own (:func:`check_own`); :mod:`gnmr_dist.backends.te_fp8` explains
why, and why a delayed low-cost recipe only recovers in BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gnmr_dist.backends.emulated_options import AMAX_ALGOS
from gnmr_dist.core.validation import check_choice, check_nonnegative_int, check_positive_int

__all__ = [
    "DELAYED_DEFAULTS",
    "FIDELITY",
    "FORMATS",
    "NVFP4_SWITCHES",
    "RECIPES",
    "TELowCostOptions",
    "TERecoveryOptions",
    "canonical_recipe",
    "check_own",
    "check_pair",
]

RECIPES: dict[str, tuple[str, str]] = {
    "delayed": ("DelayedScaling", "1.0"),
    "tensorwise": ("Float8CurrentScaling", "2.2"),
    "blockwise": ("Float8BlockScaling", "2.3"),
    "mxfp8": ("MXFP8BlockScaling", "2.0"),
    "nvfp4": ("NVFP4BlockScaling", "2.8"),
}
"""Megatron's recipe names -> (class in ``transformer_engine.common.recipe``, first TE with it)."""

FIDELITY = {"nvfp4": -1, "delayed": 0, "tensorwise": 1, "blockwise": 2, "mxfp8": 2, "bf16": 3}
"""How faithful each recipe is: recovery must rank strictly above low-cost."""

NVFP4_SWITCHES = {
    "stochastic_rounding": "disable_stochastic_rounding",
    "hadamard": "disable_rht",
    "weight_2d": "disable_2d_quantization",
}
"""``low_cost`` options of the ``"nvfp4"`` recipe -> the ``NVFP4BlockScaling`` field each one
negates (TE's defaults, all on, are NVIDIA's recipe)."""

FORMATS = {"hybrid": "HYBRID", "e4m3": "E4M3"}
"""``fp8_format`` names -> ``transformer_engine.common.recipe.Format`` members."""

DELAYED_DEFAULTS = {"amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0}
"""TE's own ``DelayedScaling`` defaults: an empty ``low_cost`` block equals plain TE."""

_ALIASES = {"current": "tensorwise", "block": "blockwise"}
"""Alias names in docs/backends.md#te_fp8 ("current", "block") for Megatron's ("tensorwise",
"blockwise")."""

_RESEEDS = ("reset", "keep")


def canonical_recipe(recipe: Any) -> Any:
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
    amax history to 0, or ``"keep"`` the frozen ones (the trade-off: ``te_fp8``'s docstring)."""
    stochastic_rounding: bool | None = None
    """NVFP4 only: stochastic rounding of the gradients (``None``: TE's default, on)."""
    hadamard: bool | None = None
    """NVFP4 only: the 16 x 16 random Hadamard transform of the wgrad inputs (``None``: on)."""
    weight_2d: bool | None = None
    """NVFP4 only: 16 x 16 weight tiles (``None``: on)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", canonical_recipe(self.recipe))
        check_choice(self.recipe, sorted(RECIPES), "recipe")
        check_choice(self.fp8_format, sorted(FORMATS), "fp8_format")
        if self.recipe != "delayed":
            self._refuse_delayed_only()
        for name in NVFP4_SWITCHES:
            value = getattr(self, name)
            if value is not None and (self.recipe != "nvfp4" or not isinstance(value, bool)):
                raise ValueError(
                    f"{name} is an option of recipe 'nvfp4' (true or false), got {value!r} "
                    f"with recipe {self.recipe!r}"
                )
        if self.amax_history_len is not None:
            check_positive_int(self.amax_history_len, "amax_history_len")
        if self.margin is not None:
            check_nonnegative_int(self.margin, "margin")
        if self.amax_compute_algo is not None:
            check_choice(self.amax_compute_algo, sorted(AMAX_ALGOS), "amax_compute_algo")
        if self.reseed is not None:
            check_choice(self.reseed, sorted(_RESEEDS), "reseed")

    def _refuse_delayed_only(self) -> None:
        for name in (*DELAYED_DEFAULTS, "reseed"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} applies only to recipe 'delayed' (recipe is {self.recipe!r})"
                )

    @property
    def reseed_mode(self) -> str:
        """``reseed`` with its default filled in."""
        return self.reseed or "reset"

    def nvfp4_kwargs(self) -> dict[str, Any]:
        """``NVFP4BlockScaling`` keyword arguments for the options given (the others: TE's)."""
        return {
            field: not getattr(self, name)
            for name, field in NVFP4_SWITCHES.items()
            if getattr(self, name) is not None
        }

    def delayed_kwargs(self) -> dict[str, Any]:
        """``DelayedScaling`` keyword arguments (without ``fp8_format``), defaults filled in."""
        given = {k: getattr(self, k) for k in DELAYED_DEFAULTS}
        return {k: DELAYED_DEFAULTS[k] if v is None else v for k, v in given.items()}


@dataclass(frozen=True)
class TERecoveryOptions:
    """The recovery path: FP8 off for the unit, or a stronger recipe in an inner region."""

    recipe: str = "bf16"
    """``"bf16"`` (FP8/FP4 off) | ``"tensorwise"`` | ``"blockwise"`` | ``"mxfp8"``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", canonical_recipe(self.recipe))
        allowed = sorted([*RECIPES.keys() - {"delayed", "nvfp4"}, "bf16"])
        check_choice(self.recipe, allowed, "recipe")


def check_pair(low: str, recovery: str) -> None:
    """Refuse recovery recipes that are not safer than, or unsafe with, the low-cost one."""
    if low == "delayed" and recovery != "bf16":
        raise ValueError(
            f"gnmr.recovery.recipe {recovery!r} cannot recover units whose low-cost recipe is "
            "'delayed': a TE module that changes recipe class rebuilds its delayed-scaling state "
            "on the way back, and TE never registers the rebuilt state for the amax reduction, "
            "so its scale would stay 1. Use recovery 'bf16' or a non-delayed low-cost recipe."
        )
    if FIDELITY[recovery] <= FIDELITY[low]:
        stronger = sorted(r for r, f in FIDELITY.items() if f > FIDELITY[low])
        raise ValueError(
            f"gnmr.recovery.recipe {recovery!r} is not of higher fidelity than the low-cost "
            f"recipe {low!r}; choose one of {stronger}"
        )


def check_own(label: str, own: str, recovery: str) -> None:
    """Recovery must be stronger than what the module runs on its own (its te_quant_params)."""
    rank = FIDELITY.get(own)  # None: megatron's "custom" recipe, unranked
    if own == "bf16":
        raise ValueError(
            f"te_fp8: {label}: its te_quant_params already run it in BF16 (training_recipe has "
            "no fp8/fp4 recipe), so recovery would change nothing: leave it out of the units "
            "(gnmr.exclude) or drop its entry from config.quant_recipe"
        )
    if recovery == "bf16":
        return
    if rank is None or FIDELITY[recovery] <= rank:
        raise ValueError(
            f"te_fp8: {label}: its te_quant_params run it with recipe {own!r}, which "
            f"gnmr.recovery.recipe {recovery!r} is not known to be stronger than; use recovery "
            "'bf16' or leave the module out of the units (gnmr.exclude)"
        )
