"""The three GEMMs of a linear layer, and ``gnmr.gemms``: which of them a recovered unit recovers.

A linear layer ``y = x W^T + b`` runs three GEMMs per training step::

    fprop  y  = x W^T       forward
    dgrad  dx = dy W        backward: the input gradient, sent on to the layers below
    wgrad  dW = dy^T x      backward: the weight gradient, the one the optimizer reads

A unit on the recovery path runs the GEMMs ``gnmr.gemms`` lists with the recovery path's
numerics and the others with the low-cost path's. The default, all three, is the whole recovery
path, bit for bit what it was before the key existed. A backend says which subsets it can run
(:meth:`~gnmr_dist.backends.base.PrecisionBackend.check_gemms`) and refuses the others when it
is built. Each backend's route and its cost: ``docs/gemms.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gnmr_dist.core.validation import did_you_mean

__all__ = ["ALL_GEMMS", "GEMMS", "parse_gemms", "subset_error"]

GEMMS = ("fprop", "dgrad", "wgrad")
"""The three GEMMs of a linear layer, in the order every message lists them."""

ALL_GEMMS = frozenset(GEMMS)
"""The default subset: the whole recovery path."""


def parse_gemms(value: Any, path: str = "gnmr.gemms") -> tuple[str, ...]:
    """``value``, a non-empty list of distinct GEMM names, as a tuple in :data:`GEMMS`' order;
    else a ``ValueError`` naming ``path``, the value and the allowed names."""
    allowed = ", ".join(repr(g) for g in GEMMS)
    if isinstance(value, str):
        raise ValueError(
            f"{path} must be a list of GEMM names, got the string {value!r}; write "
            f'["{value}"] (allowed names: {allowed})'
        )
    if not isinstance(value, list | tuple | set | frozenset):
        raise ValueError(
            f"{path} must be a non-empty list of GEMM names ({allowed}), got {value!r} "
            f"({type(value).__name__})"
        )
    if not value:
        raise ValueError(
            f"{path} must name at least one GEMM ({allowed}), got an empty list; drop {path} "
            "to recover all three"
        )
    for item in value:
        if not isinstance(item, str) or item not in GEMMS:
            raise ValueError(
                f"{path}: unknown GEMM {item!r}{did_you_mean(item, GEMMS)} (allowed: {allowed})"
            )
    items = list(value)
    twice = next((g for g in GEMMS if items.count(g) > 1), None)
    if twice is not None:
        raise ValueError(f"{path} names {twice!r} twice in {items}; name each GEMM once")
    return tuple(g for g in GEMMS if g in items)


def subset_error(backend: str, gemms: Iterable[str], reason: str, fix: str = "") -> ValueError:
    """The refusal of a subset ``backend`` cannot run: the subset, the backend, why, and what to
    do (by default: recover all three GEMMs)."""
    shown = [g for g in GEMMS if g in set(gemms)]
    fix = fix or "recover all three GEMMs (drop gnmr.gemms)"
    return ValueError(
        f"gnmr.gemms {shown}: the {backend!r} backend cannot recover only these GEMMs: "
        f"{reason}. {fix[0].upper()}{fix[1:]}"
    )
