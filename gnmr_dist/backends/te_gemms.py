"""``te_fp8`` under ``gnmr.gemms``: the Transformer Engine route that recovers a subset of GEMMs.

Each tensor of a TE linear feeds two GEMMs, one per layout (TE's
``custom_recipes/quantizer_factory_zoo.py``, ``mxfp8_fwd_nvfp4_bwd_factory``)::

    fprop  weight.rowwise    x  input.rowwise
    dgrad  weight.columnwise x  grad_output.rowwise
    wgrad  input.columnwise  x  grad_output.columnwise

so a GEMM's precision is chosen by quantizing each tensor's two layouts apart. The routes
(:func:`choose_route`; file:line references to TE 2.20.0.dev0 in ``docs/gemms.md``):

* all three GEMMs: the nested regions of :mod:`~gnmr_dist.backends.te_fp8`, unchanged;
* ``[dgrad, wgrad]`` with recovery ``bf16``: the low-cost recipe again, with
  ``backward_override="high_precision"`` (TE >= 2.15): TE's own fused module path, the forward
  quantized as on the low-cost path, the backward GEMMs in BF16 on the saved original input and
  weight (one BF16 copy of ``x`` kept for backward instead of its FP8 one);
* every other subset (and ``[dgrad, wgrad]`` into a stronger FP8 recipe): a ``CustomRecipe``
  whose factory gives each tensor a ``HybridQuantizer`` of the two paths' quantizers, built by the
  recipes' own ``RecipeState`` (an ``IdentityQuantizer`` for ``bf16``; TE >= 2.19). The GEMMs stay
  TE's; custom quantizers skip TE's fused bias-gradient cast and a module that changes recipe
  class rebuilds its quantizers ("Recipe type changed"), once per change of plan.

Refused when the backend is built: any subset with a ``delayed`` low-cost recipe, a subset the
installed TE has no route for, and (on a GPU without non-TN FP8 GEMMs: Hopper) one that would
put a ``tensorwise`` quantizer on a columnwise layout alone. TE's debug API
(``DisableQuantizationGEMM``) is not used: it is configured per layer name at start-up and runs
every layer a feature touches without TE's fusions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gnmr_dist.backends.base import LOW_COST, RECOVERY
from gnmr_dist.backends.gemms import ALL_GEMMS, subset_error
from gnmr_dist.backends.te_recipes import RECIPES

__all__ = [
    "CUSTOM",
    "OVERRIDE",
    "REGIONS",
    "TENSOR_GEMMS",
    "TEFeatures",
    "choose_route",
    "split_layouts",
    "subset_qfactory",
]

REGIONS, OVERRIDE, CUSTOM = "regions", "backward_override", "custom_recipe"
"""The routes: nested autocast regions, ``backward_override``, a ``CustomRecipe``."""

TENSOR_GEMMS = {
    "input": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "grad_output": ("dgrad", "wgrad"),
}
"""A linear's quantized tensor -> (the GEMM its rowwise layout feeds, its columnwise one's)."""

_OUTPUT_GEMM = {"output": "fprop", "grad_input": "dgrad"}
"""A GEMM's output quantizer (FP8 outputs) follows that GEMM's path."""

_BACKWARD_TENSORS = ("grad_output", "grad_input")
_PER_TENSOR = ("tensorwise",)
"""Recipes whose FP8 quantizer cannot write a columnwise layout alone where the GPU has no
non-TN FP8 GEMMs (TE ``csrc/quantizer.cpp``, ``check_per_tensor_fp8_quantize_output``)."""


@dataclass(frozen=True)
class TEFeatures:
    """What the installed TE and GPU offer the routes."""

    backward_override: bool
    """Recipes take ``backward_override`` (TE >= 2.15)."""
    hybrid: bool
    """``CustomRecipe`` with ``QuantizerRole``, ``HybridQuantizer``, ``IdentityQuantizer``
    (TE >= 2.19)."""
    non_tn_fp8: bool
    """The GPU runs non-TN FP8 GEMMs (compute capability 10.x, 13+), so a per-tensor FP8
    quantizer may write a columnwise layout alone."""


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def te_features(recipe_module: Any, low_recipe: str) -> TEFeatures:
    """The :class:`TEFeatures` of the installed TE (``recipe_module``:
    ``transformer_engine.common.recipe``) for the low-cost recipe ``low_recipe`` (a name of
    :data:`~gnmr_dist.backends.te_recipes.RECIPES`)."""
    cls = getattr(recipe_module, RECIPES[low_recipe][0], None)
    hybrid = all(
        _importable(f"transformer_engine.pytorch.{m}")
        for m in ("quantization", "tensor.hybrid_tensor", "tensor.identity_tensor")
    )
    return TEFeatures(
        backward_override=cls is not None and hasattr(cls, "backward_override"),
        hybrid=hybrid and hasattr(recipe_module, "CustomRecipe"),
        non_tn_fp8=_non_tn_fp8(),
    )


def _non_tn_fp8() -> bool:
    """TE's ``is_non_tn_fp8_gemm_supported`` (``transformer_engine/pytorch/utils.py``), or its
    rule on the current device when this TE lacks it; False without CUDA."""
    try:
        utils = importlib.import_module("transformer_engine.pytorch.utils")
        return bool(utils.is_non_tn_fp8_gemm_supported())
    except (ImportError, AttributeError):
        pass
    if not torch.cuda.is_available():
        return False
    cap = torch.cuda.get_device_capability()
    return (10, 0) <= cap < (12, 0) or cap >= (13, 0)


def _path(gemm: str, gemms: Iterable[str]) -> str:
    return RECOVERY if gemm in gemms else LOW_COST


def split_layouts(gemms: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Tensor -> (path of its rowwise layout, of its columnwise layout), for the tensors whose
    two layouts run on different paths under ``gemms`` (the ones that need a hybrid)."""
    gemms = set(gemms)
    paths = {t: (_path(r, gemms), _path(c, gemms)) for t, (r, c) in TENSOR_GEMMS.items()}
    return {t: p for t, p in paths.items() if p[0] != p[1]}


def choose_route(low: str, recovery: str, gemms: frozenset[str], features: TEFeatures) -> str:
    """The route that runs ``gemms`` of a recovered unit on ``recovery`` and the others on the
    ``low`` recipe (module docstring), or a ``ValueError`` naming why none does."""
    if gemms == ALL_GEMMS:
        return REGIONS
    if low == "delayed":
        raise subset_error(
            "te_fp8",
            gemms,
            "TE's DelayedScaling takes no backward_override (transformer_engine/common/recipe/"
            "__init__.py: 'Delayed scaling only supports backward_override=None'), and a "
            "HybridQuantizer takes no delayed-scaling request (tensor/hybrid_tensor.py, "
            "TODO(#3158))",
            "use a current-scaling low-cost recipe (tensorwise, blockwise, mxfp8, nvfp4) or "
            "recover all three GEMMs",
        )
    if gemms == {"dgrad", "wgrad"} and recovery == "bf16" and features.backward_override:
        return OVERRIDE
    if not features.hybrid:
        raise subset_error(
            "te_fp8",
            gemms,
            "this Transformer Engine has no per-layout quantizers (CustomRecipe with "
            "HybridQuantizer and IdentityQuantizer, TE >= 2.19); TE >= 2.15 runs only "
            "['dgrad', 'wgrad'] with recovery 'bf16' (backward_override)",
            "upgrade Transformer Engine, or recover all three GEMMs",
        )
    lone = [t for t, (_, col) in split_layouts(gemms).items() if col == LOW_COST]
    if low in _PER_TENSOR and lone and not features.non_tn_fp8:
        raise subset_error(
            "te_fp8",
            gemms,
            f"it would quantize the columnwise layout of {lone} alone with the per-tensor "
            f"{low!r} recipe, which TE refuses on a GPU without non-TN FP8 GEMMs (Hopper: "
            "'Columnwise-only per-tensor FP8 quantization is not implemented', TE issue #3158)",
            "use low-cost recipe 'blockwise' or 'mxfp8', a subset that keeps those GEMMs "
            "together, or all three GEMMs",
        )
    return CUSTOM


Quantizer = Any
Make = Callable[[str, Any], Quantizer]
"""``(path, role) -> quantizer`` of that path's recipe for a TE ``QuantizerRole``."""


def subset_qfactory(
    gemms: frozenset[str], make: Make, hybrid: Callable[[Quantizer, Quantizer], Quantizer]
) -> Callable[[Any], Quantizer]:
    """A ``CustomRecipe`` ``qfactory``: for each role, the quantizer of the path each of its
    layouts runs on (``make(path, role)``), combined by ``hybrid(rowwise, columnwise)`` when the
    two differ; an output quantizer follows its GEMM; a role TE leaves unnamed, fprop."""

    def qfactory(role: Any) -> Quantizer:
        tensor = getattr(role, "tensor_type", "") or ""
        if tensor in TENSOR_GEMMS:
            row, col = (_path(g, gemms) for g in TENSOR_GEMMS[tensor])
            if row == col:
                return make(row, role)
            return hybrid(make(row, role), make(col, role))
        return make(_path(_OUTPUT_GEMM.get(tensor, "fprop"), gemms), role)

    return qfactory


def custom_recipe(
    recipe_module: Any, gemms: frozenset[str], low: Any, recovery: Any, fp8_format: Any
) -> Any:
    """The ``CustomRecipe`` of route :data:`CUSTOM`: quantizers made by the ``RecipeState`` of
    ``low`` / ``recovery`` (TE recipe objects; ``None``: ``IdentityQuantizer``, BF16), so each
    GEMM gets the quantizers its path's built-in recipe gives it."""
    quantization = importlib.import_module("transformer_engine.pytorch.quantization")
    hybrid_cls = importlib.import_module("transformer_engine.pytorch.tensor.hybrid_tensor")
    identity = importlib.import_module("transformer_engine.pytorch.tensor.identity_tensor")
    recipes = {LOW_COST: low, RECOVERY: recovery}

    def make(path: str, role: Any) -> Quantizer:
        recipe = recipes[path]
        if recipe is None:
            return identity.IdentityQuantizer()
        tensor = getattr(role, "tensor_type", "")
        mode = "backward" if tensor in _BACKWARD_TENSORS else "forward"
        state = quantization.RecipeState.create(recipe, mode=mode, num_quantizers=1, roles=[role])
        return state.make_quantizers()[0]

    def hybrid(row: Quantizer, col: Quantizer) -> Quantizer:
        return hybrid_cls.HybridQuantizer(rowwise_quantizer=row, columnwise_quantizer=col)

    factory = subset_qfactory(gemms, make, hybrid)
    return recipe_module.CustomRecipe(qfactory=factory, fp8_format=fp8_format)
