"""The wgrad operands the quantizer checks compare, and how to read a cast's numbers back.

Pure torch (no Transformer Engine): the host check runs all of it on the CPU, the TE checks on
the GPU. ``x`` is ``[256 tokens, 384 features]`` and ``dy`` ``[256, 640]``, BF16 ``N(0, 1)``
(``dy`` scaled by ``2^-10``, as gradients are) with *outlier channels*: one feature of each
``2^14`` (``2^10`` for ``dy``) times larger, one ``2^6`` and one ``2^-8`` times. The three
sizes differ, so a layout read back the wrong way round fails on its shape, and every block
recipe's blocks fit the token count (128, 32 and 16 tokens).

Delayed scaling is checked at a *stale* scale, as after a spike: ``x``'s from a quarter of its
amax (the outlier channel saturates at 448) and ``dy``'s from twice its amax.
"""

from __future__ import annotations

import torch

from gnmr_dist.backends.numerics.formats import get_format
from gnmr_dist.backends.shadow import (
    SHADOW_RECIPES,
    ShadowRecipe,
    WgradOperands,
    quantize_wgrad_operands,
)

__all__ = [
    "BLOCK",
    "E2M1_GRID",
    "FEATURES",
    "TOKENS",
    "decode",
    "delayed_scales",
    "fp8_dtype",
    "grid_index",
    "nearest_fp8",
    "outlier_operands",
    "recipe_of",
    "shadow_operands",
]

TOKENS = 256
FEATURES = {"x": 384, "dy": 640}
X_OUTLIERS = {5: 2.0**14, 77: 2.0**6, 200: 2.0**-8}
DY_OUTLIERS = {3: 2.0**10, 401: 2.0**-6}
DY_SCALE = 2.0**-10

BLOCK = {"delayed": 0, "tensorwise": 0, "blockwise": 128, "mxfp8": 32, "nvfp4": 16}
"""Tokens per scale along the tokens (0: one scale per tensor)."""

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of e2m1, by their 3-bit code."""

_NVFP4_DEQ = 1.0 / (6.0 * 448.0)
"""``factor_inv`` of TE's NVFP4 dequantize kernel (``cast/nvfp4/dequantize_nvfp4.cuh``)."""


def outlier_operands(
    device: str | torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, dy)`` with outlier channels (module docstring), BF16 on ``device``; drawn on the
    CPU, so the same numbers everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, FEATURES["x"], generator=g)
    dy = torch.randn(TOKENS, FEATURES["dy"], generator=g) * DY_SCALE
    for t, outliers in ((x, X_OUTLIERS), (dy, DY_OUTLIERS)):
        for channel, factor in outliers.items():
            t[:, channel] *= factor
    return x.to(torch.bfloat16).to(device), dy.to(torch.bfloat16).to(device)


def recipe_of(name: str) -> ShadowRecipe:
    """The shadow of ``te_fp8``'s recipe ``name`` under TE's defaults and ``HYBRID``."""
    return ShadowRecipe.of(name, fp8_format="hybrid")


def delayed_scales(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stale fp32 per-tensor scales (module docstring), 0-dim on the tensors' device."""
    four = torch.tensor(4.0, device=x.device)
    x_scale = torch.tensor(448.0, device=x.device) / (x.abs().amax().float() / four)
    dy_scale = torch.tensor(57344.0, device=dy.device) / (dy.abs().amax().float() * 2)
    return x_scale, dy_scale


def shadow_operands(
    name: str,
    x: torch.Tensor,
    dy: torch.Tensor,
    *,
    seed: int | None = None,
    x_amax: torch.Tensor | None = None,
) -> WgradOperands:
    """The shadow's wgrad operands of recipe ``name`` (delayed: at :func:`delayed_scales`;
    ``nvfp4``: ``dy`` rounded to nearest without ``seed``, stochastically with it)."""
    if name not in SHADOW_RECIPES:
        raise ValueError(f"unknown recipe {name!r}")
    scales = delayed_scales(x, dy) if name == "delayed" else (None, None)
    return quantize_wgrad_operands(
        x, dy, recipe_of(name), x_scale=scales[0], dy_scale=scales[1], seed=seed, x_amax=x_amax
    )


def _along_tokens(factor: torch.Tensor, block: int, tokens: int) -> torch.Tensor:
    """One factor per ``block`` tokens, repeated down to one per token."""
    return factor.repeat_interleave(block, dim=0)[:tokens]


def decode(
    name: str,
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values of a cast in the ``[tokens, features]`` layout, in TE's dequantizing
    arithmetic: ``codes * scale_inv`` per tensor and per 1 x 128 tile, ``codes * 2^(e - 127)``
    per MXFP8 block, ``codes * ((sc * A) * fl(1 / 2688))`` per NVFP4 block (``amax``: the
    tensor amax ``A``; ``codes``: e2m1 values)."""
    values = codes.float()
    block = BLOCK[name]
    if block == 0:
        return values * scale_inv.float().reshape(())
    if name == "mxfp8":
        exponent = scale_inv.to(torch.int32) - 127
        factor = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    elif name == "nvfp4":
        if amax is None:
            raise ValueError("an NVFP4 cast decodes with its tensor amax")
        deq = torch.tensor(_NVFP4_DEQ, dtype=torch.float32, device=codes.device)
        factor = (scale_inv.float() * amax.float().reshape(())) * deq
    else:
        factor = scale_inv.float()
    return values * _along_tokens(factor, block, values.shape[0])


def nearest_fp8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value of ``dtype`` (an FP8 type) nearest to each fp32 ``v`` (already clamped to the
    format's range), ties to the even code: a brute-force table of all 256 codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = codes.view(dtype).float()
    finite = torch.isfinite(table)
    values, order = torch.sort(table[finite])
    even = (codes[finite][order].to(torch.int32) & 1) == 0
    flat = v.detach().float().cpu().reshape(-1)
    i = torch.searchsorted(values, flat).clamp(1, len(values) - 1)
    lo, hi = values[i - 1], values[i]
    d_lo, d_hi = flat - lo, hi - flat
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[i])
    return torch.where(pick_hi, hi, lo).reshape(v.shape).to(v.device)


def grid_index(values: torch.Tensor) -> torch.Tensor:
    """Signed position of e2m1 values on their grid (``-7 .. 7``; ``-0`` and ``0`` are 0)."""
    grid = torch.tensor(E2M1_GRID, device=values.device)
    index = torch.searchsorted(grid, values.abs().float())
    return torch.where(values < 0, -index, index)


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of FP8 format ``fmt`` (``"e4m3"``, ``"e5m2"``)."""
    dtype = get_format(fmt).dtype
    if dtype is None:
        raise ValueError(f"{fmt!r} has no torch dtype")
    return dtype
