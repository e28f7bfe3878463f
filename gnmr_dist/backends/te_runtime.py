"""The installed Transformer Engine, loaded when ``te_fp8`` is built, and its modules' state.

Version differences are resolved by feature, not by number: ``te.pytorch.autocast(enabled,
recipe=, amax_reduction_group=)`` when it exists (TE >= 2.9), else ``te.pytorch.fp8_autocast(
enabled, fp8_recipe=, fp8_group=)``; ``te.pytorch.is_*_available(return_reason=True)`` (>= 2.9)
else ``te.pytorch.fp8.check_*_support()``; a recipe class missing from
``transformer_engine.common.recipe`` (``Float8CurrentScaling`` < 2.2, ``Float8BlockScaling``
< 2.3, ``MXFP8BlockScaling`` < 2.0) is an error naming the version needed.

Nothing here imports Transformer Engine at module level: TE modules are recognised by class name
and defining package (:func:`is_te_module`), and :func:`load_te` imports it on demand.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.te_recipes import FORMATS, RECIPES

__all__ = [
    "FP4_MIN_CAPABILITY",
    "TE_MODULE_TYPES",
    "build_recipe",
    "check_available",
    "check_fp4_device",
    "cuda_device",
    "is_te_module",
    "load_te",
    "reset_delayed_scaling",
]

TE_MODULE_TYPES = frozenset({"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"})
"""TE module classes the backend switches (megatron's ``TELinear`` & co. subclass them)."""

_SUPPORT_KIND = {
    "delayed": "fp8",
    "tensorwise": "fp8",
    "blockwise": "fp8_block_scaling",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}

FP4_MIN_CAPABILITY = (10, 0)
"""The first compute capability with FP4 tensor-core GEMMs (Blackwell: B200, GB200)."""
_META_KEYS = ("scaling_fwd", "scaling_bwd")

NO_TE_HINT = (
    "Without an NVIDIA GPU, use the 'fp8_emulated' backend, which emulates FP8 GEMMs with "
    "tensor-, row- or block-wise scales on CPU and GPU."
)


@dataclass(frozen=True)
class TE:
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


FP4_HINT = (
    "Recipe 'nvfp4' also needs FP4 GEMMs: an NVIDIA GPU of compute capability {need} or higher "
    "(Blackwell). On any other device the 'fp8_emulated' backend runs NVFP4 emulated "
    '(low_cost {{"format": "e2m1"}}).'
)
"""What an ``nvfp4`` request adds to a refusal: the GPU it needs and the emulated route."""


def load_te(fp4: bool = False) -> TE:
    """Import Transformer Engine, or raise an ``ImportError`` that says what to do (``fp4``:
    the run asked for NVFP4, so the message also names the GPU it needs, :data:`FP4_HINT`)."""
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
            f"PyTorch container). {_fp4_hint() if fp4 else NO_TE_HINT}"
        ) from err
    new = hasattr(te_pytorch, "autocast")
    if not new and not hasattr(te_pytorch, "fp8_autocast"):
        raise ImportError(f"transformer_engine {_te_version(root)} has no fp8_autocast/autocast")
    return TE(_te_version(root), te_pytorch, recipe, new)


def _fp4_hint() -> str:
    return FP4_HINT.format(need=".".join(map(str, FP4_MIN_CAPABILITY)))


def _support(te: TE, kind: str) -> tuple[bool, str] | None:
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


def cuda_device() -> tuple[str, tuple[int, int]] | None:
    """``(name, compute capability)`` of the current CUDA device; ``None`` without one."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), (int(major), int(minor))


def check_fp4_device(what: str) -> None:
    """Raise a ``RuntimeError`` naming the device when it has no FP4 GEMMs (``what``: the
    setting that asked for them)."""
    device = cuda_device()
    need = ".".join(map(str, FP4_MIN_CAPABILITY))
    fallback = (
        "The 'fp8_emulated' backend runs NVFP4 emulated on any device (low_cost {\"format\": "
        '"e2m1"}), or run FP8 here.'
    )
    if device is None:
        raise RuntimeError(
            f"{what} needs FP4 GEMMs (an NVIDIA GPU of compute capability {need} or higher: "
            f"Blackwell), but this machine has no CUDA device: it runs on the CPU. {fallback}"
        )
    name, cap = device
    if cap < FP4_MIN_CAPABILITY:
        raise RuntimeError(
            f"{what} needs FP4 GEMMs (compute capability {need} or higher: Blackwell), but "
            f"this GPU, {name}, has compute capability {cap[0]}.{cap[1]} and none (H100 and "
            f"H200 are 9.0). {fallback}"
        )


def check_available(te: TE, name: str) -> None:
    """Raise a ``RuntimeError`` naming TE's reason when recipe ``name`` cannot run here (for
    ``"nvfp4"``, naming the device first: :func:`check_fp4_device`)."""
    if name == "nvfp4":
        check_fp4_device("te_fp8 recipe 'nvfp4'")
    try:
        answer = _support(te, _SUPPORT_KIND[name])
    except Exception as err:  # no device: TE's capability query fails inside torch.cuda
        answer = (False, f"{type(err).__name__}: {err}")
    if answer is not None and not answer[0]:
        raise RuntimeError(
            f"the 'te_fp8' backend cannot run recipe {name!r} here: {answer[1]} "
            f"(transformer_engine {te.version}). {NO_TE_HINT}"
        )


def build_recipe(
    te: TE,
    name: str,
    fp8_format: str,
    delayed: Mapping[str, Any],
    nvfp4: Mapping[str, Any] | None = None,
    backward_override: str | None = None,
) -> Any:
    """The TE recipe object for Megatron's recipe ``name`` (``nvfp4``: ``NVFP4BlockScaling``
    with the ``disable_*`` fields given, TE's defaults for the others); ``backward_override``
    (TE >= 2.15, not ``delayed``) is passed on when given (``gnmr.gemms``:
    :mod:`~gnmr_dist.backends.te_gemms`)."""
    cls_name, since = RECIPES[name]
    cls = getattr(te.recipe, cls_name, None)
    if cls is None:
        raise RuntimeError(
            f"recipe {name!r} ({cls_name}) needs transformer_engine >= {since}; "
            f"installed: {te.version}. Upgrade Transformer Engine or choose another recipe."
        )
    extra = {} if backward_override is None else {"backward_override": backward_override}
    if name == "nvfp4":
        return cls(**(nvfp4 or {}), **extra)
    fmt = getattr(te.recipe.Format, FORMATS[fp8_format])
    if name == "delayed":
        return cls(fp8_format=fmt, **delayed)
    return cls(fp8_format=fmt, **extra)


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
