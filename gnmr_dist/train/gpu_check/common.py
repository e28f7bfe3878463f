"""What the GPU check's TE checks share: the context, plain-TE regions, the models, a step.

Nothing imports Transformer Engine at module level: :func:`te_pytorch` and :func:`te_recipe`
import it when a check runs. Every TE call is written against TE's source (2.20, with the
feature tests of :mod:`gnmr_dist.backends.te_runtime` for older versions).

The loss of every training step here is ``sum(y * g)`` with a fixed ``g ~ N(0, 1)``, so the
output gradient is ``g`` itself: of order one, far above e5m2's smallest subnormal (``2^-16``)
even unscaled, so a gradient that underflows or a scale that stops updating shows up as a
difference, not as zeros that happen to be finite.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.te_fp8 import TEFp8Backend

DEVICE = "cuda"
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")
"""The low-cost recipes of ``te_fp8`` (megatron's names), in the order the checks run them."""

Region = Callable[[], contextlib.AbstractContextManager[Any]]
Grads = list[torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """The model checks' size (``--hidden``, ``--layers``, ``--tokens``, ``--steps``)."""

    hidden: int = 4096
    layers: int = 2
    tokens: int = 16384
    steps: int = 12


@dataclass
class Context:
    """What every check is called with."""

    sizes: Sizes = field(default_factory=Sizes)
    workdir: Path = Path(".")
    """A scratch folder (the megatron run's traces)."""
    small_limit: float = 1.5
    """``tokens_per_s[small]`` fails when GNMR's step takes longer than this times plain TE's."""
    large_limit: float = 1.05
    """The same for ``tokens_per_s[large]``."""
    recipe: str = "tensorwise"
    """The low-cost recipe of ``tokens_per_s`` (``--recipe``)."""


# ---------------------------------------------------------------------- Transformer Engine


def te_pytorch() -> Any:
    """``transformer_engine.pytorch``."""
    import transformer_engine.pytorch as te

    return te


def te_recipe() -> Any:
    """``transformer_engine.common.recipe``."""
    from transformer_engine.common import recipe

    return recipe


def plain_recipe(name: str, **fields: Any) -> Any:
    """The recipe object plain TE users write for megatron's recipe ``name`` (HYBRID format;
    ``fields`` such as ``backward_override``), built here and not by the backend."""
    r = te_recipe()
    if name == "nvfp4":
        return r.NVFP4BlockScaling(**fields)
    cls = {
        "delayed": "DelayedScaling",
        "tensorwise": "Float8CurrentScaling",
        "blockwise": "Float8BlockScaling",
        "mxfp8": "MXFP8BlockScaling",
    }[name]
    return getattr(r, cls)(fp8_format=r.Format.HYBRID, **fields)


def region(enabled: bool, recipe: Any = None) -> contextlib.AbstractContextManager[Any]:
    """``te.autocast(enabled, recipe=)`` (TE >= 2.9), else ``fp8_autocast``."""
    te = te_pytorch()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe)  # type: ignore[no-any-return]
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)  # type: ignore[no-any-return]


def plain_region(name: str, **fields: Any) -> Region:
    """A fresh plain-TE region of recipe ``name`` per call; ``"bf16"``: no region."""
    if name == "bf16":
        return contextlib.nullcontext
    recipe = plain_recipe(name, **fields)
    return lambda: region(True, recipe)


def fp8_state() -> Any:
    """TE's ``FP8GlobalStateManager`` (``quantization`` since 2.10, ``fp8`` before)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


# ---------------------------------------------------------------------- models


def bf16_kw() -> dict[str, Any]:
    return {"params_dtype": torch.bfloat16, "device": DEVICE}


class Block(nn.Module):
    """``h = x + proj(gelu(qkv(x)))``, then ``h + mlp(h)``: ``LayerNormLinear``, ``Linear``,
    ``LayerNormMLP``, one unit each (the model of the bitwise and switching checks)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        te = te_pytorch()
        self.qkv = te.LayerNormLinear(d, d, **bf16_kw())
        self.proj = te.Linear(d, d, **bf16_kw())
        self.mlp = te.LayerNormMLP(d, 4 * d, **bf16_kw())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(F.gelu(self.qkv(x)))
        return h + self.mlp(h)  # type: ignore[no-any-return]


class Stack(nn.Module):
    """``layers`` of blocks; the modules of :meth:`units` are the units, in order."""

    def __init__(self, make: Callable[[], nn.Module], layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def units(self) -> list[nn.Module]:
        return [m for layer in self.layers for m in layer.children()]


def build(sizes: Sizes, like: nn.Module | None = None) -> Stack:
    """A fresh :class:`Block` stack (fresh FP8 state); with ``like``, a copy of its weights."""
    torch.manual_seed(0)
    model = Stack(lambda: Block(sizes.hidden), sizes.layers)
    if like is not None:
        copy_weights(like, model)
    return model


def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for p, q in zip(src.parameters(), dst.parameters(), strict=True):
            q.copy_(p)


def wrapped(model: Stack, **options: Any) -> TEFp8Backend:
    """``te_fp8`` with ``options`` on every unit of ``model``."""
    backend = TEFp8Backend(**options)
    backend.wrap(dict(enumerate(model.units())))
    return backend


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded ``N(0, scale^2)`` in BF16 on the device (drawn on the CPU: the same numbers on
    every GPU)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, torch.bfloat16)


def batch(sizes: Sizes, seed: int) -> torch.Tensor:
    return randn((sizes.tokens, sizes.hidden), seed)


def target(sizes: Sizes, seed: int) -> torch.Tensor:
    """``g`` of the loss ``sum(y * g)``: the output gradient."""
    return randn((sizes.tokens, sizes.hidden), 10_000 + seed).float()


@dataclass
class StepResult:
    """One training step: output, loss, and every parameter's gradient (before the update)."""

    y: torch.Tensor
    loss: torch.Tensor
    grads: Grads


def step(
    model: nn.Module,
    x: torch.Tensor,
    g: torch.Tensor,
    forward_region: Region,
    lr: float = 1e-6,
) -> StepResult:
    """Forward inside ``forward_region()``, ``sum(y * g)`` backward outside, then SGD (``lr``
    0: no update). The gradients are the parameters' own ``.grad`` tensors, detached from the
    model (``.grad`` set to ``None`` after the update, so nothing is copied)."""
    with forward_region():
        y = model(x)
    loss = (y.float() * g).sum()
    loss.backward()
    grads = []
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None, "a parameter got no gradient"
            grads.append(p.grad)
            if lr:
                p.sub_(p.grad, alpha=lr)
            p.grad = None
    return StepResult(y.detach(), loss.detach(), grads)


# ---------------------------------------------------------------------- comparisons


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in fp32 (inf where one is non-finite and the other not)."""
    return float((a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius, fp64)."""
    b64 = b.double()
    return float(torch.linalg.vector_norm(a.double() - b64) / torch.linalg.vector_norm(b64))


def steps_diff(a: list[StepResult], b: list[StepResult]) -> float:
    """Largest ``|difference|`` over outputs, losses and gradients of two runs."""
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        pairs = [(sa.y, sb.y), (sa.loss, sb.loss), *zip(sa.grads, sb.grads, strict=True)]
        worst = max([worst, *(diff(t, u) for t, u in pairs)])
    return worst


def nonfinite(runs: list[StepResult]) -> int:
    return sum(
        int((~torch.isfinite(t)).sum()) for s in runs for t in (s.y, s.loss.reshape(1), *s.grads)
    )


CONTROL_FACTOR = 2.0
"""Where two runs of the reference differ (a kernel that is not deterministic), the run under
test may be at most this many times further from it."""


def bitwise_or_control(
    got: Callable[[], list[StepResult]], want: Callable[[], list[StepResult]]
) -> tuple[bool, float, float | None]:
    """``(ok, max |got - want|, control)``: equal bit for bit, or, when not, no more than
    :data:`CONTROL_FACTOR` times as far apart as ``want`` from a second run of itself (the
    control, run only then). Each run seeds torch's generators alike (:func:`build`), so TE's
    stochastic rounding, which draws from torch's CUDA generator, draws the same bits."""
    d = steps_diff(got(), want())
    if d == 0.0:
        return True, d, None
    control = steps_diff(want(), want())
    return d <= CONTROL_FACTOR * control, d, control


def free_device_memory() -> None:
    """Between checks: drop what the last one left and return the cache to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def hooks(*handles: Any) -> Iterator[None]:
    """Remove the hook ``handles`` on exit."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
