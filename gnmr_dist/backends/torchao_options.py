"""``torchao_fp8``'s option blocks, and which torchao recipe may recover which (no torchao import).

The low-cost path runs one of torchao's float8 training recipes
(``torchao.float8.Float8LinearConfig.from_recipe_name``): ``"tensorwise"`` (e4m3 activations and
weights, e5m2 gradients, one scale per tensor: torchao's default and the fastest),
``"rowwise"`` (e4m3 everywhere, one power-of-two scale per row along each GEMM's reduction
dimension) or ``"rowwise_with_gw_hp"`` (rowwise fprop and dgrad, the weight gradient in high
precision). ``"mxfp8"`` and ``"nvfp4"`` (torchao's MX formats) are names the block accepts and
refuses when the backend is built on a device without their kernels (compute capability 10.0).
Recovery must be of strictly higher fidelity (:data:`FIDELITY`): ``"bf16"`` (torchao off: the
module's own ``F.linear``) or a stronger recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from gnmr_dist.core.validation import check_choice

__all__ = [
    "FIDELITY",
    "FLOAT8_RECIPES",
    "MX_RECIPES",
    "TorchaoLowCost",
    "TorchaoRecovery",
    "check_pair",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's ``Float8LinearRecipeName`` values: they run wherever ``torch._scaled_mm`` does (a
CPU with torch >= 2.13, an NVIDIA GPU of compute capability 8.9+)."""

MX_RECIPES = ("mxfp8", "nvfp4")
"""torchao's MX-format recipes (``torchao.prototype.mx_formats``): compute capability 10.0+."""

FIDELITY = {
    "nvfp4": -1,
    "tensorwise": 0,
    "rowwise": 1,
    "mxfp8": 1,
    "rowwise_with_gw_hp": 2,
    "bf16": 3,
}
"""How faithful each path is: recovery must rank strictly above low-cost. Rowwise beats
tensorwise (e4m3 gradients, one scale per row, so an outlier spoils its row only);
``rowwise_with_gw_hp`` keeps the weight gradient, the one the optimizer reads, in high
precision; BF16 rounds nothing to FP8."""


@dataclass(frozen=True)
class TorchaoLowCost:
    """The low-cost path: a torchao float8 training recipe."""

    recipe: str = "tensorwise"
    """``"tensorwise"`` | ``"rowwise"`` | ``"rowwise_with_gw_hp"`` (``"mxfp8"``, ``"nvfp4"``:
    refused where the device has no MX kernels)."""
    pad_inner_dim: bool = False
    """torchao's ``pad_inner_dim``: pad each GEMM's reduction dimension with zeros to a multiple
    of 16; without it a linear whose in or out features are not multiples of 16 is refused."""
    emulate: bool = False
    """torchao's ``emulate``: the FP8 GEMMs as fp32 matmuls of the dequantized operands (for
    testing; not with ``torch.compile``)."""
    fsdp_float8_all_gather: bool = False
    """torchao's ``enable_fsdp_float8_all_gather``: FSDP2 all-gathers each weight in FP8
    (``"tensorwise"`` only); a recovered unit then runs its BF16 GEMMs on the gathered FP8 weight
    dequantized (docs/backends.md#torchao_fp8)."""

    def __post_init__(self) -> None:
        check_choice(self.recipe, FLOAT8_RECIPES + MX_RECIPES, "recipe")
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"fsdp_float8_all_gather: torchao all-gathers FP8 weights with tensorwise "
                f'scales only, and recipe is {self.recipe!r}; use "recipe": "tensorwise" or '
                "drop fsdp_float8_all_gather"
            )


@dataclass(frozen=True)
class TorchaoRecovery:
    """The recovery path: BF16 (torchao off) or a stronger recipe."""

    recipe: str = "bf16"
    """``"bf16"`` (the module's own ``F.linear``, in the dtype it trains in), ``"rowwise"`` or
    ``"rowwise_with_gw_hp"``."""

    def __post_init__(self) -> None:
        check_choice(self.recipe, ("bf16", "rowwise", "rowwise_with_gw_hp"), "recipe")


def check_pair(low: str, recovery: str) -> None:
    """Refuse a recovery recipe that is not strictly more faithful than the low-cost one."""
    if FIDELITY[recovery] <= FIDELITY[low]:
        better = sorted(
            (r for r in FIDELITY if FIDELITY[r] > FIDELITY[low]), key=FIDELITY.__getitem__
        )
        raise ValueError(
            f"gnmr.recovery.recipe: {recovery!r} is not more faithful than the low-cost recipe "
            f"{low!r}; recovery must rank above it (allowed: "
            f"{', '.join(repr(r) for r in better if r != 'mxfp8')})"
        )
