"""Every check of ``gnmr-gpu-check``, in the order it runs: the host's, the TE-only ones, then
megatron-core's. ``--list`` prints this table; docs/backends.md#gnmr-gpu-check describes each."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from gnmr_dist.train.gpu_check.common import RECIPES
from gnmr_dist.train.gpu_check.host import check_shadow_casts
from gnmr_dist.train.gpu_check.mcore_checks import (
    check_megatron_fp4_refused,
    check_megatron_gamma,
    check_megatron_operator,
)
from gnmr_dist.train.gpu_check.runner import Check, Outcome
from gnmr_dist.train.gpu_check.te_model import (
    check_bf16_equal,
    check_delayed_state,
    check_fp8_equal,
    check_one_recovered,
    check_switching,
)
from gnmr_dist.train.gpu_check.te_quant import check_quantizers, check_shadow_bound
from gnmr_dist.train.gpu_check.te_subsets import check_gemm_subset, check_nvfp4_refused
from gnmr_dist.train.gpu_check.throughput import check_tokens_per_s

__all__ = ["catalog"]

_SHADOW = (
    "the shadow's casts on this torch: [tokens, features] layout, codes x scales, nearest FP8 "
    "codes (a table of all 256), saturation, blocks along the tokens, stochastic rounding one "
    "step from nearest, B within 1e-4 of float64; fails on any violation"
)


def _recipes(low: str, recovery: str) -> tuple[str, ...]:
    return (low,) if recovery == "bf16" else (low, recovery)


def _per_recipe(
    family: str, compares: Callable[[str], str], run: Callable[..., Outcome]
) -> list[Check]:
    """``family[r]`` for each low-cost recipe ``r`` of :data:`RECIPES`, in order: a TE check that
    runs ``run(context, name=r)`` where ``r`` runs, and says ``compares(r)``."""
    return [Check(f"{family}[{r}]", "te", compares(r), partial(run, name=r), (r,)) for r in RECIPES]


def _quantizers_compares(recipe: str) -> str:
    stochastic = " (stochastic dy: on a scale, a code two steps off, B 3% apart)"
    return (
        f"the shadow's {recipe} codes and scales of x and dy with outlier channels vs TE's own "
        "quantizer, and B from TE's tensors; fails on any bit"
        + (stochastic if recipe == "nvfp4" else "")
    )


def catalog() -> list[Check]:
    """The checks, in running order."""
    checks = [
        Check("shadow_casts[cpu]", "host", _SHADOW, partial(check_shadow_casts, device="cpu")),
        Check("shadow_casts[cuda]", "cuda", _SHADOW, partial(check_shadow_casts, device="cuda")),
    ]
    checks += _per_recipe(
        "quantizers",
        _quantizers_compares,
        check_quantizers,
    )
    checks += _per_recipe(
        "shadow_bound",
        lambda r: (
            f"te_fp8 with gamma ({r}) on a Linear and a LayerNormLinear: the backend's B(u) "
            "vs B from TE's quantizers on what the module had; fails when they differ "
            "(LayerNormLinear 1%, NVFP4 3%) or when measuring changes an output"
        ),
        check_shadow_bound,
    )
    checks += _per_recipe(
        "fp8_equal",
        lambda r: (
            f"te_fp8, nothing recovered, vs plain te.autocast({r}) over 3 steps; fails on "
            "any difference beyond a plain-vs-plain control"
        ),
        check_fp8_equal,
    )
    checks += [
        Check(
            "bf16_equal",
            "te",
            "every unit recovered vs the model without FP8 over 2 steps; fails on any difference",
            check_bf16_equal,
            ("delayed",),
        ),
        Check(
            "unit_bf16_equal",
            "te",
            "one recovered unit vs that module alone in BF16 on its input and output gradient, "
            "its FP8 neighbour vs alone under plain FP8; fails on any difference",
            partial(check_one_recovered, low="delayed", recovery="bf16"),
            ("delayed",),
        ),
    ]
    for low, high in (("tensorwise", "blockwise"), ("nvfp4", "mxfp8")):
        checks.append(
            Check(
                f"stronger_recovery[{low}->{high}]",
                "te",
                f"one unit recovered under {high} vs that module alone under plain {high}, its "
                f"neighbour vs alone under {low}; fails on any difference",
                partial(check_one_recovered, low=low, recovery=high),
                (low, high),
            )
        )
    pairs = [(r, "bf16") for r in RECIPES] + [("tensorwise", "blockwise"), ("nvfp4", "mxfp8")]
    for low, high in pairs:
        checks.append(
            Check(
                f"switching[{low}->{high}]",
                "te",
                "units flipping every step vs TE's regions nested by hand; fails on a "
                "difference, a wrong path, inf/nan, or a gradient 0.5 (NVFP4 0.8) from BF16's",
                partial(check_switching, low=low, recovery=high),
                _recipes(low, high),
            )
        )
    for reseed in ("reset", "keep"):
        checks.append(
            Check(
                f"delayed_state[{reseed}]",
                "te",
                f"delayed scaling around a recovery (reseed {reseed}): scale and amax history vs "
                "TE's update rule every step, frozen while recovered; fails on any bit",
                partial(check_delayed_state, reseed=reseed),
                ("delayed",),
            )
        )
    for part in ("dgrad+wgrad", "fprop"):
        checks.append(
            Check(
                f"gemm_subset[{part}]",
                "te",
                f"one Linear recovering {part}: those GEMMs near an fp32 reference, the others "
                "FP8's; fails on the wrong route or numerics",
                partial(check_gemm_subset, part=part),
                ("tensorwise",),
            )
        )
    checks.append(
        Check(
            "nvfp4_refused",
            "te",
            "without FP4 GEMMs: te_fp8 nvfp4 refused naming the GPU, TE's state and an FP8 step "
            "unchanged; fails otherwise",
            check_nvfp4_refused,
        )
    )
    for size in ("small", "large"):
        checks.append(
            Check(
                f"tokens_per_s[{size}]",
                "te",
                "plain TE vs te_fp8 + GNMR + gamma at the default interval, interleaved; fails "
                "when GNMR's step takes longer than the limit times plain TE's",
                partial(check_tokens_per_s, size=size),
            )
        )
    checks += [
        Check(
            "megatron_operator[bf16]",
            "megatron",
            "a megatron TE linear recovered through te_quant_params vs alone in BF16, its "
            "neighbour vs alone under FP8; fails on any difference",
            partial(check_megatron_operator, recovery="bf16", low="tensorwise"),
            ("tensorwise",),
        ),
        Check(
            "megatron_operator[blockwise]",
            "megatron",
            "the same, recovery blockwise",
            partial(check_megatron_operator, recovery="blockwise", low="tensorwise"),
            ("tensorwise", "blockwise"),
        ),
        Check(
            "megatron_operator[nvfp4->bf16]",
            "megatron",
            "the same under megatron's FP4 context",
            partial(check_megatron_operator, recovery="bf16", low="nvfp4"),
            ("nvfp4",),
        ),
        Check(
            "megatron_fp4_refused",
            "megatron",
            "without FP4 GEMMs: megatron_patches.enable on an FP4 model refused naming the GPU",
            check_megatron_fp4_refused,
        ),
        Check(
            "megatron_gamma[tensorwise]",
            "megatron",
            "megatron TP1 with te_fp8 and gamma and an injected outlier: e in the trace, the "
            "faulted unit chosen, losses vs plain FP8; fails on a missing e, a wrong choice or "
            "a loss 2% worse",
            check_megatron_gamma,
            ("tensorwise",),
        ),
    ]
    return checks
