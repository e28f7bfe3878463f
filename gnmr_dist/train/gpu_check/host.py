"""``shadow_casts[cpu]`` / ``[cuda]``: the shadow's casts on this machine's torch, no TE needed.

The shadow route (:mod:`gnmr_dist.backends.shadow`) quantizes with torch's FP8 casts and bit
operations on the device its tensors live on; the TE checks compare it with TE's quantizers,
which only a GPU with TE has. This check runs anywhere and checks what the shadow itself must
guarantee for those comparisons to mean anything, on the :mod:`.operands` tensors with outlier
channels, for every recipe and both operands:

* the layout the GPU check reads: codes and dequantized values ``[tokens, features]``, one scale
  per tensor, per 128 / 32 / 16 tokens of each feature;
* the codes are values of their format, and the dequantized tensor is the codes times their
  scales in TE's dequantizing arithmetic (:func:`.operands.decode`);
* every FP8 code is the nearest value of its format to the scaled input, ties to even (a
  brute-force table of the 256 codes: torch's cast on this device rounds as TE's kernels do);
* delayed scaling's stale scale saturates the outlier channel at the format's maximum;
* block recipes: scaling one feature leaves every other feature's codes and scales unchanged
  (the blocks run along the tokens, never across features);
* NVFP4's stochastic rounding of ``dy`` keeps the scales and moves each code by at most one
  step of the e2m1 grid from the nearest one;
* ``B`` of :func:`~gnmr_dist.backends.shadow.wgrad_bound` (fp32 norms, a float64 product)
  equals the bound recomputed in float64 within ``1e-4``.
"""

from __future__ import annotations

from typing import Any

import torch

from gnmr_dist.backends.numerics import te_casts
from gnmr_dist.backends.numerics.formats import get_format
from gnmr_dist.backends.shadow import SHADOW_RECIPES, WgradOperands, wgrad_bound
from gnmr_dist.train.gpu_check.operands import (
    BLOCK,
    E2M1_GRID,
    X_OUTLIERS,
    decode,
    delayed_scales,
    fp8_dtype,
    grid_index,
    nearest_fp8,
    outlier_operands,
    recipe_of,
    shadow_operands,
)
from gnmr_dist.train.gpu_check.runner import Outcome, Skip

__all__ = ["check_shadow_casts", "fp64_bound"]

BOUND_RTOL = 1e-4
SR_SEED = 1234
_OUTLIER = next(iter(X_OUTLIERS))


def fp64_bound(ops: WgradOperands) -> float:
    """``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` in float64 from the fp32 operands."""
    assert ops.qx is not None and ops.qdy is not None
    x, dy = ops.x.double(), ops.dy.double()
    norm = torch.linalg.vector_norm
    return float(norm(dy) * norm(x - ops.qx.double()) + norm(ops.qdy.double() - dy) * norm(x))


def _encoder(name: str, side: str, t: torch.Tensor, cast: Any, stale: torch.Tensor) -> Any:
    """The factor the shadow multiplied ``t`` by, one per element (FP8 recipes)."""
    fmt = get_format(recipe_of(name).x_format if side == "x" else recipe_of(name).grad_format)
    if name == "delayed":
        return stale
    if name == "tensorwise":
        return te_casts.scale_from_amax(t.abs().amax(), fmt.max_value)
    if name == "mxfp8":
        e = cast.scale_inv.to(torch.int32)
        factor = torch.ldexp(torch.ones_like(e, dtype=torch.float32), 127 - e)
    else:  # blockwise: power-of-two scales, so 1 / scale_inv is the scale exactly
        factor = torch.reciprocal(cast.scale_inv.float())
    return factor.repeat_interleave(BLOCK[name], dim=0)[: t.shape[0]]


def _side_problems(name: str, side: str, ops: WgradOperands, stale: torch.Tensor) -> list[str]:
    t, cast = (ops.x, ops.x_cast) if side == "x" else (ops.dy, ops.dy_cast)
    assert cast is not None
    recipe, block = recipe_of(name), BLOCK[name]
    fmt = recipe.x_format if side == "x" else recipe.grad_format
    want = () if block == 0 else (t.shape[0] // block, t.shape[1])
    shapes = (tuple(cast.codes.shape), tuple(cast.dequantized.shape), tuple(cast.scale_inv.shape))
    if shapes != (tuple(t.shape), tuple(t.shape), want):
        return [f"{name} {side}: codes/dequantized/scales shaped {shapes}, want {tuple(t.shape)}"]
    out = []
    if name == "nvfp4":
        grid = torch.tensor(E2M1_GRID, device=t.device)
        off = int((~torch.isin(cast.codes.abs(), grid)).sum())
    else:
        off = int((~torch.isfinite(cast.codes.float())).sum())
        if cast.codes.dtype != fp8_dtype(fmt):
            out.append(f"{name} {side}: codes are {cast.codes.dtype}, not {fmt}")
    if off:
        out.append(f"{name} {side}: {off} codes are not values of {fmt}")
    amax = t.abs().amax() if name == "nvfp4" else None
    decoded = decode(name, cast.codes, cast.scale_inv, amax)
    if not torch.equal(decoded, cast.dequantized):
        out.append(f"{name} {side}: dequantized != codes x scales at {_count(decoded, cast)}")
    if name != "nvfp4":
        top = get_format(fmt).max_value
        v = (t * _encoder(name, side, t, cast, stale)).clamp(-top, top)
        wrong = int((nearest_fp8(v, fp8_dtype(fmt)) != cast.codes.float()).sum())
        if wrong:
            out.append(f"{name} {side}: {wrong} codes are not the nearest {fmt} value (ties even)")
    return out


def _count(a: torch.Tensor, cast: Any) -> str:
    return f"{int((a != cast.dequantized).sum())} elements"


def _independent(name: str, x: torch.Tensor, dy: torch.Tensor) -> list[str]:
    """Block recipes: scaling one feature changes no other feature's codes or scales."""
    x2 = x.clone()
    x2[:, _OUTLIER] *= 4
    pin = None
    if name == "nvfp4":  # NVFP4's tensor scale depends on the whole tensor: pin it
        amaxes = [shadow_operands(name, t, dy).x.abs().amax() for t in (x, x2)]
        pin = torch.maximum(*amaxes)
    a = shadow_operands(name, x, dy, x_amax=pin).x_cast
    b = shadow_operands(name, x2, dy, x_amax=pin).x_cast
    assert a is not None and b is not None
    keep = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
    keep[_OUTLIER] = False
    same = torch.equal(a.codes[:, keep], b.codes[:, keep]) and torch.equal(
        a.scale_inv[:, keep], b.scale_inv[:, keep]
    )
    moved = not torch.equal(a.scale_inv[:, _OUTLIER], b.scale_inv[:, _OUTLIER])
    if same and moved:
        return []
    return [
        f"{name}: scaling feature {_OUTLIER} changed other features {not same}, its own {moved}"
    ]


def _stochastic(x: torch.Tensor, dy: torch.Tensor) -> tuple[list[str], float]:
    """NVFP4's ``dy``: stochastic codes within one grid step of the nearest, same scales."""
    near = shadow_operands("nvfp4", x, dy).dy_cast
    sr = shadow_operands("nvfp4", x, dy, seed=SR_SEED).dy_cast
    assert near is not None and sr is not None
    steps = (grid_index(sr.codes) - grid_index(near.codes)).abs()
    moved = float((steps > 0).float().mean())
    out = []
    if not torch.equal(near.scale_inv, sr.scale_inv):
        out.append("nvfp4 dy: stochastic rounding changed the block scales")
    if int(steps.max()) > 1 or moved == 0.0:
        out.append(
            f"nvfp4 dy: stochastic codes up to {int(steps.max())} steps away, {moved:.1%} moved"
        )
    return out, moved


def check_shadow_casts(context: Any, device: str) -> Outcome:
    """The module docstring's properties, on ``device``."""
    del context
    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device")
    x, dy = outlier_operands(device)
    problems: list[str] = []
    data: dict[str, Any] = {}
    for name in SHADOW_RECIPES:
        ops = shadow_operands(name, x, dy)
        stale = delayed_scales(x, dy)
        for side, scale in (("x", stale[0]), ("dy", stale[1])):
            problems += _side_problems(name, side, ops, scale)
        b, ref = float(wgrad_bound(ops)), fp64_bound(ops)
        if not (b > 0 and abs(b - ref) <= BOUND_RTOL * ref):
            problems.append(f"{name}: B {b!r} vs float64 {ref!r}")
        data[name] = {"B": b}
        if name == "delayed":
            assert ops.x_cast is not None
            data[name]["saturated"] = saturated = int((ops.x_cast.codes.float().abs() == 448).sum())
            if not saturated:
                problems.append("delayed: the stale scale saturated nothing")
        if BLOCK[name]:
            problems += _independent(name, x, dy)
    sr_problems, moved = _stochastic(x, dy)
    problems += sr_problems
    data["nvfp4"]["sr_moved"] = moved
    detail = (
        f"{len(SHADOW_RECIPES)} recipes x (x, dy) on {device}: layouts, decode, nearest FP8 "
        f"codes, saturation ({data['delayed']['saturated']} codes), blocks along the tokens, "
        f"stochastic rounding ({moved:.0%} of dy codes moved one step), B within {BOUND_RTOL} "
        "of float64"
    )
    return Outcome.judged(problems, detail, data)
