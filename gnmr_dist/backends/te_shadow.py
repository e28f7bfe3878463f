"""``te_fp8``'s damage term: where each input of the shadow route comes from for TE's modules.

The shadow route (:mod:`gnmr_dist.backends.shadow`) quantizes in TE's arithmetic; this module
finds its inputs:

* :func:`shadow_recipe`: the recipe, from the TE recipe object the outer region runs
  (``fp8_format``; the ``QParams``: ``power_2_scale``, ``amax_epsilon``, NVFP4's Hadamard
  transform and stochastic rounding); refuses what it does not reproduce (NVFP4's ``4over6``,
  row-scaled activations, different ``QParams`` for ``x`` and ``dy``);
* :func:`gemm_input`: a ``LayerNormLinear``'s normalised input, recomputed in fp32 from the
  module's ``normalization``, ``eps``, ``layer_norm_weight`` (+1 under ``zero_centered_gamma``)
  and ``layer_norm_bias``, rounded to the activation dtype except under ``delayed`` (TE's fused
  norm kernel casts fp32 to FP8 directly);
* :func:`delayed_sources`: delayed scaling's scales, read from the module's ``fp8_meta`` when
  they are used (after the forward; when ``dy`` arrives), or for a recovered unit under
  ``reseed: "reset"`` the scale of its own amax and the margin;
* :func:`check_module`: refuses ``LayerNormMLP`` (internal operands), ``GroupedLinear`` (grouped
  quantizers) and a sequence-parallel module (TE gathers the sequence inside it).

Each rank scores the GEMMs it runs on the operands they read; the ranks' bounds add in the
norms' all-reduce. ``docs/backends.md#the-shadow-route``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.shadow import ScaleSource, ShadowRecipe

__all__ = ["check_module", "delayed_sources", "gemm_input", "shadow_recipe"]

_GEMM1_INPUT = 0
"""``FP8FwdTensorIdx.GEMM1_INPUT`` (``pytorch/csrc/common.h``)."""
_GRAD_OUTPUT1 = 0
"""``FP8BwdTensorIdx.GRAD_OUTPUT1``."""


def _qparams(recipe: Any, name: str) -> tuple[bool, float, bool, bool]:
    """``(power_2_scale, amax_epsilon, random_hadamard_transform, stochastic_rounding)`` of a
    recipe's ``QParams`` attribute (TE's defaults when the recipe has none)."""
    q = getattr(recipe, name, None)
    return (
        bool(getattr(q, "power_2_scale", False)),
        float(getattr(q, "amax_epsilon", 0.0)),
        bool(getattr(q, "random_hadamard_transform", False)),
        bool(getattr(q, "stochastic_rounding", False)),
    )


def shadow_recipe(name: str, recipe: Any, fp8_format: str, margin: int = 0) -> ShadowRecipe:
    """The :class:`~gnmr_dist.backends.shadow.ShadowRecipe` of TE recipe object ``recipe``
    (megatron's name ``name``; ``fp8_format`` and delayed scaling's ``margin`` as the backend
    built it), or a ``ValueError`` naming the setting it does not reproduce."""
    if name == "nvfp4":
        return _nvfp4_recipe(recipe)
    fmt = getattr(recipe, "fp8_format", None)
    fmt_name = getattr(fmt, "name", None) or ("HYBRID" if fp8_format == "hybrid" else "E4M3")
    grad = "e5m2" if fmt_name == "HYBRID" else "e4m3"
    if name == "delayed":
        return ShadowRecipe.of(
            name, grad_format=grad, margin=int(getattr(recipe, "margin", margin))
        )
    x_q = _qparams(recipe, "fp8_quant_fwd_inp")[:2]
    dy_q = _qparams(recipe, "fp8_quant_bwd_grad")[:2]
    if not hasattr(recipe, "fp8_quant_fwd_inp"):  # a recipe object without QParams: TE's defaults
        x_q = dy_q = (name == "blockwise", 0.0)
    if x_q != dy_q:
        raise ValueError(
            f"te_fp8: gnmr.gamma: recipe {name!r} quantizes the input with {x_q} and the "
            f"gradient with {dy_q} (power_2_scale, amax_epsilon); the shadow route reproduces one "
            "setting for both: make them equal (TE's environment variables set both) or drop "
            "gnmr.gamma"
        )
    return ShadowRecipe.of(name, grad_format=grad, pow2=x_q[0], eps=x_q[1])


def _nvfp4_recipe(recipe: Any) -> ShadowRecipe:
    for attr, off in (("nvfp4_4over6", "none"), ("row_scaled_activation", False)):
        value = getattr(recipe, attr, off)
        if value != off:
            raise ValueError(
                f"te_fp8: gnmr.gamma: NVFP4BlockScaling({attr}={value!r}) chooses its block "
                "scales in a way the shadow route does not reproduce; unset it (its "
                f"NVTE_NVFP4_* environment variable) or drop gnmr.gamma"
            )
    inp, grad = _qparams(recipe, "fp4_quant_fwd_inp"), _qparams(recipe, "fp4_quant_bwd_grad")
    if hasattr(recipe, "fp4_quant_fwd_inp"):
        if inp[2] != grad[2]:
            raise ValueError(
                "te_fp8: gnmr.gamma: NVFP4BlockScaling rotates only one of the wgrad operands "
                "by the Hadamard transform; the shadow route rotates both or neither"
            )
        return ShadowRecipe.of("nvfp4", hadamard=grad[2], stochastic_rounding=grad[3])
    kwargs = getattr(recipe, "kwargs", {})  # a stand-in recipe: TE's defaults, as built
    return ShadowRecipe.of(
        "nvfp4",
        hadamard=not kwargs.get("disable_rht", False),
        stochastic_rounding=not kwargs.get("disable_stochastic_rounding", False),
    )


def _is_te(module: nn.Module, name: str) -> bool:
    return any(
        c.__name__ == name and c.__module__.startswith("transformer_engine.")
        for c in type(module).__mro__
    )


def check_module(label: str, module: nn.Module) -> None:
    """``ValueError`` naming ``label`` when the shadow route cannot score ``module``."""
    why = None
    if _is_te(module, "LayerNormMLP"):
        why = (
            "a LayerNormMLP runs two GEMMs whose operands (the FC1 output gradient, the "
            "activation) stay inside the module",
            "build the MLP from LayerNormLinear + Linear (megatron: its TE spec does), or "
            "exclude the unit",
        )
    elif _is_te(module, "GroupedLinear"):
        why = (
            "a GroupedLinear quantizes its splits with grouped quantizers and offsets that the "
            "route does not reproduce",
            "exclude the unit (gnmr.exclude)",
        )
    elif getattr(module, "sequence_parallel", False):
        why = (
            "it runs sequence parallel, so TE all-gathers the sequence shard inside the module "
            "and its GEMM reads a tensor the module is never given",
            "turn sequence parallelism off for the run, or exclude the unit",
        )
    if why is not None:
        raise ValueError(
            f"te_fp8: gnmr.gamma: {label} ({type(module).__name__}) cannot be scored by the "
            f"shadow route: {why[0]}. {why[1][0].upper()}{why[1][1:]}, or drop gnmr.gamma"
        )


def gemm_input(module: nn.Module, x: torch.Tensor, fused_cast: bool) -> torch.Tensor:
    """What ``module``'s GEMM reads for input ``x``: ``x``, or a ``LayerNormLinear``'s
    normalised input (module docstring); ``fused_cast``: keep it fp32 (TE's fused norm + FP8
    cast under delayed scaling)."""
    kind = getattr(module, "normalization", None)
    if kind is None:
        return x
    x32 = x.detach().float()
    weight: torch.Tensor = getattr(module, "layer_norm_weight")  # noqa: B009 (typed as Module)
    weight = weight.detach().float()
    if getattr(module, "zero_centered_gamma", False):
        weight = weight + 1
    eps = float(getattr(module, "eps"))  # noqa: B009
    if kind == "RMSNorm":
        y = F.rms_norm(x32, (x32.shape[-1],), weight, eps)
    elif kind == "LayerNorm":
        bias = getattr(module, "layer_norm_bias", None)
        y = F.layer_norm(x32, (x32.shape[-1],), weight, None if bias is None else bias.float(), eps)
    else:
        raise ValueError(f"te_fp8: normalization {kind!r} is neither LayerNorm nor RMSNorm")
    return y if fused_cast else y.to(x.dtype)


def _scale_at(module: nn.Module, key: str, index: int) -> torch.Tensor:
    state = (getattr(module, "fp8_meta", None) or {}).get(key)
    scale = getattr(state, "scale", None)
    if not isinstance(scale, torch.Tensor):
        raise RuntimeError(
            f"te_fp8: gnmr.gamma: {type(module).__name__} holds no delayed-scaling state "
            f"(fp8_meta[{key!r}].scale) after an FP8 forward: this Transformer Engine keeps "
            "it elsewhere; drop gnmr.gamma with recipe 'delayed'"
        )
    return scale[index]


def delayed_sources(
    module: nn.Module, recovered: bool, keep: bool
) -> tuple[ScaleSource, ScaleSource]:
    """``(x_scale, dy_scale)`` of a delayed-scaling module (module docstring): read from its
    ``fp8_meta`` (the ``dy`` one when the gradient arrives); ``(None, None)`` for a recovered
    unit under ``reseed: "reset"`` (the recipe then scales by the tensor's own amax and its
    margin)."""
    if recovered and not keep:
        return None, None
    x_scale = _scale_at(module, "scaling_fwd", _GEMM1_INPUT)
    return x_scale, lambda: _scale_at(module, "scaling_bwd", _GRAD_OUTPUT1)
