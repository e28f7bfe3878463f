"""``tokens_per_s[small]`` and ``tokens_per_s[large]``: what watching costs in training steps.

Three copies of one model train side by side, a step of each in turn (the order rotating every
round, so none always runs after a sync or on a warm cache), each step timed between two
``torch.cuda.synchronize()``: plain TE under ``te.autocast(recipe)``; ``te_fp8`` with GNMR
(:class:`~gnmr_dist.distributed.GNMRRuntime`: per-unit norms, the controller's decision on the
host) and ``gamma`` measured at the backend's default interval (``error_every``: 50 for the
per-tensor recipes, 100 block, 200 NVFP4); and BF16 for scale. Every variant does the same
work otherwise: forward, ``sum(y * g)`` backward, an SGD step, gradients set to ``None`` (no
copies). GNMR's thresholds are out of reach, so no unit is recovered: the figure is the cost of
the route and the controller, not of running a unit in BF16. Warm-up covers a measuring step;
the timed window is two full intervals (two measuring steps in ``2 x error_every`` steps, as
in a run), and tokens/s is tokens over the window's summed step time.

The model: ``layers`` blocks of ``h = x + proj(gelu(q + k + v))`` with ``q, k, v`` from one
``LayerNormLinear`` (``d -> 3d``), then ``h + fc2(gelu(fc1(h)))`` with ``fc1`` a
``LayerNormLinear`` (``d -> 4d``): megatron's GEMM shapes without attention, 4 units a layer.
``small`` is 256 wide, 2 layers, 1,024 tokens (the host's work dominates: the check of GNMR's
per-step overhead, :attr:`~.common.Context.small_limit`); ``large`` is ``--hidden`` x
``--layers`` x ``--tokens`` (the GPU's work dominates, :attr:`~.common.Context.large_limit`).
Fails when GNMR's tokens/s is below plain TE's divided by the limit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.train.gpu_check.common import (
    Context,
    Sizes,
    Stack,
    bf16_kw,
    copy_weights,
    plain_region,
    randn,
    te_pytorch,
)
from gnmr_dist.train.gpu_check.runner import Outcome, Skip

__all__ = ["SMALL", "check_tokens_per_s"]

SMALL = Sizes(hidden=256, layers=2, tokens=1024)
LR = 1e-6
NEVER = 1e30
"""GNMR's thresholds in this check: out of reach, so nothing is recovered."""


class MegatronShaped(nn.Module):
    """One block of megatron's GEMM shapes (module docstring)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        te = te_pytorch()
        self.qkv = te.LayerNormLinear(d, 3 * d, **bf16_kw())
        self.proj = te.Linear(d, d, **bf16_kw())
        self.fc1 = te.LayerNormLinear(d, 4 * d, **bf16_kw())
        self.fc2 = te.Linear(4 * d, d, **bf16_kw())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.proj(F.gelu(q + k + v))
        return h + self.fc2(F.gelu(self.fc1(h)))  # type: ignore[no-any-return]


class Variant:
    """One of the three models and how it trains a step."""

    def __init__(self, name: str, model: Stack, x: torch.Tensor, g: torch.Tensor) -> None:
        self.name, self.model, self.x, self.g = name, model, x, g
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.region: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.before: Callable[[], object] = lambda: None
        self.after: Callable[[], object] = lambda: None
        self.seconds: list[float] = []

    def step(self) -> None:
        self.before()
        with self.region():
            y = self.model(self.x)
        (y.float() * self.g).sum().backward()
        self.after()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.step()
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - start)


def _gnmr(variant: Variant, recipe: str) -> tuple[TEFp8Backend, Any, int]:
    """Put ``te_fp8``, the shadow route and GNMR's runtime on ``variant``: (backend, runtime,
    error_every)."""
    from gnmr_dist.backends import registered_operator_types
    from gnmr_dist.core import GNMRConfig
    from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

    registry = UnitRegistry.from_model(variant.model, operator_types=registered_operator_types())
    backend = TEFp8Backend(low_cost={"recipe": recipe})
    backend.wrap(registry.local_modules)
    every = TEFp8Backend.default_error_every({"recipe": recipe})
    backend.track_errors(registry.num_units, every)
    config = GNMRConfig(alpha=NEVER, beta=NEVER, gamma=NEVER)
    runtime = GNMRRuntime(registry, config, error_fn=backend.error_sums, error_every=every)
    variant.region = backend.autocast
    variant.before = lambda: backend.apply(runtime.plan.active, runtime.plan.step)
    variant.after = lambda: runtime.step(lr=LR)
    return backend, runtime, every


def check_tokens_per_s(context: Context, size: str) -> Outcome:
    sizes = SMALL if size == "small" else context.sizes
    limit = context.small_limit if size == "small" else context.large_limit
    recipe = context.recipe
    try:
        TEFp8Backend(low_cost={"recipe": recipe})
    except RuntimeError as err:
        raise Skip(f"recipe {recipe!r} does not run here: {err}") from None
    torch.manual_seed(0)
    first = Stack(lambda: MegatronShaped(sizes.hidden), sizes.layers)
    x = randn((sizes.tokens, sizes.hidden), 1)
    g = randn((sizes.tokens, sizes.hidden), 2).float()
    variants = {}
    for name in ("te", "gnmr", "bf16"):
        model = first if name == "te" else Stack(lambda: MegatronShaped(sizes.hidden), sizes.layers)
        if model is not first:
            copy_weights(first, model)
        variants[name] = Variant(name, model, x, g)
    variants["te"].region = plain_region(recipe)
    backend, runtime, every = _gnmr(variants["gnmr"], recipe)
    for name, variant in variants.items():  # warm-up; GNMR's covers a measuring step
        for _ in range(every if name == "gnmr" else 3):
            variant.step()
    order = list(variants.values())
    measured = recovered = 0
    for i in range(2 * every):
        for variant in order[i % 3 :] + order[: i % 3]:
            if variant.name == "gnmr":
                measured += runtime.plan.measure_errors
                recovered += len(runtime.plan.active)
            variant.timed()
    tps = {k: sizes.tokens * len(v.seconds) / sum(v.seconds) for k, v in variants.items()}
    ratio = tps["te"] / tps["gnmr"]
    ok = ratio <= limit and recovered == 0 and measured == 2
    backend.unwrap()
    shape = f"{sizes.hidden} x {sizes.layers} layers x {sizes.tokens} tokens"
    return Outcome(
        ok,
        f"{shape}, {recipe}: tokens/s plain TE {tps['te']:.4g}, GNMR+gamma (every {every}) "
        f"{tps['gnmr']:.4g} ({ratio:.3f}x the step time, limit {limit}), BF16 {tps['bf16']:.4g}; "
        f"{2 * every} steps each, interleaved, {measured} measured, {recovered} unit-steps "
        "recovered",
        {"tokens_per_s": tps, "ratio": ratio, "every": every, "measured": measured},
    )
