"""te_fp8 against plain Transformer Engine on a GPU: bitwise paths, delayed scaling, step time.

    pytest -m gpu tests/gpu -q

Skipped as a whole without CUDA, without Transformer Engine, or when TE says FP8 cannot run on
the device. Stacks of ``te.Linear`` layers with BF16 parameters; each check compares the backend
with plain TE on an identical copy of the stack:

* empty plan == plain ``autocast(enabled=True, recipe=DelayedScaling())``, bitwise (outputs,
  losses, every gradient, over several steps, so the delayed scales evolve too);
* every unit recovered ("bf16") == the stack run without FP8, bitwise;
* one unit recovered: that unit's output == the module in BF16, the others == plain FP8;
* units flipping every step under delayed scaling: no inf/nan, a returning unit is reset in
  place (``reseed="reset"``) or keeps its frozen state (``"keep"``), frozen units keep theirs;
* the step time of the backend with an empty plan stays within 1.3x of plain TE FP8;
* with megatron-core: one projection of a megatron ``GPTModel`` (TE layer spec, tensorwise FP8)
  recovered through its ``te_quant_params`` runs exactly as that module in BF16 while its
  neighbour runs FP8 (``gnmr-gpu-check``'s ``megatron_operator[bf16]``,
  :func:`gnmr_dist.train.gpu_check.mcore_checks.check_megatron_operator`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.te_fp8 import TEFp8Backend
from tests.gpu.te_guard import require_cuda_and_te

pytestmark = pytest.mark.gpu

te, te_recipe = require_cuda_and_te()
try:
    TEFp8Backend()
except (ImportError, RuntimeError) as err:
    pytest.skip(str(err), allow_module_level=True)

DEVICE = "cuda"
D, TOKENS, LAYERS = 1024, 4096, 4
TIMING_D, TIMING_TOKENS = 2048, 8192
Region = Callable[[], contextlib.AbstractContextManager]


def make_stack(n: int = LAYERS, d: int = D) -> nn.ModuleList:
    layers = (te.Linear(d, d, params_dtype=torch.bfloat16, device=DEVICE) for _ in range(n))
    return nn.ModuleList(layers)


def copy_of(stack: nn.ModuleList) -> nn.ModuleList:
    """A fresh stack (fresh FP8 state) with the same weights."""
    other = make_stack(len(stack), stack[0].in_features)
    with torch.no_grad():
        for p, q in zip(stack.parameters(), other.parameters(), strict=True):
            q.copy_(p)
    return other


def batch(seed: int, tokens: int = TOKENS, d: int = D) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16, generator=g)


def run(stack: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in stack:
        x = F.gelu(layer(x))
    return x


def train_step(stack: nn.ModuleList, x: torch.Tensor, region: Region, lr: float = 0.05):
    """Forward inside ``region()``, backward and an SGD update outside; (out, loss, grads)."""
    with region():
        y = run(stack, x)
    loss = y.float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in stack.parameters()]
    with torch.no_grad():
        for p in stack.parameters():
            p -= lr * p.grad
            p.grad = None
    return y.detach(), loss.detach(), grads


def plain_fp8(recipe=None) -> Region:
    recipe = recipe or te_recipe.DelayedScaling()
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=True, recipe=recipe)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def wrapped(stack: nn.ModuleList, **options) -> TEFp8Backend:
    backend = TEFp8Backend(**options)
    backend.wrap(dict(enumerate(stack)))
    return backend


def assert_same_steps(a_steps, b_steps) -> None:
    for (ya, la, ga), (yb, lb, gb) in zip(a_steps, b_steps, strict=True):
        assert torch.equal(ya, yb) and torch.equal(la, lb)
        assert all(torch.equal(g, h) for g, h in zip(ga, gb, strict=True))


def assert_bitwise_plain(plan: Collection[int], steps: int, plain: Callable[[], Region]):
    """``steps`` steps of a stack under the backend with ``plan`` (its units in BF16, the others
    FP8), then of a copy under ``plain()`` (a fresh region each step): bitwise the same.
    Returns the backend."""
    a = make_stack()
    b = copy_of(a)
    backend = wrapped(a)
    a_steps = []
    for step in range(1, steps + 1):
        backend.apply(plan, step)
        a_steps.append(train_step(a, batch(step), backend.autocast))
        assert [backend.fp8_ran(u) for u in range(LAYERS)] == [u not in plan for u in range(LAYERS)]
    # plain TE after the backend's run: the two stacks never share a step of amax reduction
    b_steps = [train_step(b, batch(step), plain()) for step in range(1, steps + 1)]
    assert_same_steps(a_steps, b_steps)
    return backend


def test_empty_plan_is_bitwise_plain_te_fp8():
    backend = assert_bitwise_plain(set(), steps=3, plain=plain_fp8)
    assert backend.report().low_cost == set(range(LAYERS))


def test_all_units_recovered_is_bitwise_plain_bf16():
    assert_bitwise_plain(range(LAYERS), steps=2, plain=lambda: contextlib.nullcontext)


def test_one_recovered_unit_is_bf16_and_the_others_fp8():
    a = make_stack(2)
    b = copy_of(a)
    backend = wrapped(a)
    backend.apply({1}, step=1)
    x = batch(7)
    with torch.no_grad():
        with backend.autocast():
            h = a[0](x)
            out = a[1](h)
        with plain_fp8()():
            ref_h = b[0](x)
        ref_out = b[1](h)  # no region: BF16
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)
    assert backend.fp8_ran(0) and not backend.fp8_ran(1)
    assert not torch.equal(ref_h, b[0](x))  # FP8 and BF16 differ, so the check has teeth


def _states(layer: nn.Module) -> list[torch.Tensor]:
    """Scale and amax history, forward and backward, of a delayed-scaling module."""
    states = (layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"])
    return [t for state in states for t in (state.scale, state.amax_history)]


PLANS = [set(), {0}, {1}, {0, 2}, {3}, set(), {1, 2, 3}, {0}, set(), {2}, set(), set()]
"""Step 1 runs every unit in FP8, so every unit has delayed-scaling state from then on."""


def _is_reset(layer: nn.Module) -> bool:
    return all(bool((t == (1 if t.dim() == 1 else 0)).all()) for t in _states(layer))


@pytest.mark.parametrize("reseed", ["reset", "keep"])
def test_flipping_units_under_delayed_scaling(reseed):
    a = make_stack()
    reference = copy_of(a)
    backend = wrapped(a, low_cost={"recipe": "delayed", "amax_history_len": 16, "reseed": reseed})
    tensors: dict[int, list[torch.Tensor]] = {}
    losses = []
    for step, plan in enumerate(PLANS, start=1):
        returning = backend.report().planned - plan
        backend.apply(plan, step)
        assert all(_is_reset(a[u]) == (reseed == "reset") for u in returning), step
        kept = {u: [t.clone() for t in _states(a[u])] for u in plan}
        y, loss, grads = train_step(a, batch(step), backend.autocast)
        assert torch.isfinite(loss) and bool(torch.isfinite(y).all())
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        assert [backend.fp8_ran(u) for u in range(LAYERS)] == [u not in plan for u in range(LAYERS)]
        # a unit in BF16 records no amax, and TE's fused update leaves its scale and history
        # alone (the unfused NVTE_UNFUSED_FP8_UPDATE=1 path would still roll the history)
        for u in plan:
            assert all(torch.equal(t, k) for t, k in zip(_states(a[u]), kept[u], strict=True))
        tensors = tensors or {u: _states(a[u]) for u in range(LAYERS)}
        for u, states in tensors.items():  # reset and updates work in place: same tensors
            assert all(s is t for s, t in zip(states, _states(a[u]), strict=True))
        losses.append(loss)
    ref = [train_step(reference, batch(s), contextlib.nullcontext)[1] for s in range(1, 13)]
    assert float(losses[-1]) == pytest.approx(float(ref[-1]), rel=0.1)


def _median_step_ms(step: Callable[[], object], iters: int = 10) -> float:
    """Median wall time of ``step`` after 3 warm-up calls, synchronised on both sides."""
    import time

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def test_step_time_of_the_switching_backend():
    d, tokens = TIMING_D, TIMING_TOKENS
    a = make_stack(d=d)
    b = copy_of(a)
    backend = wrapped(a)
    x = batch(0, tokens, d)
    counter = iter(range(1, 10**6))

    def switching(plan_of: Callable[[int], set[int]]) -> Callable[[], object]:
        def step() -> object:
            s = next(counter)
            backend.apply(plan_of(s), s)
            return train_step(a, x, backend.autocast, lr=0.0)

        return step

    ms = {
        "plain_fp8": _median_step_ms(lambda: train_step(b, x, plain_fp8(), lr=0.0)),
        "backend_empty": _median_step_ms(switching(lambda s: set())),
        "backend_one_bf16": _median_step_ms(switching(lambda s: {s % LAYERS})),
        "plain_bf16": _median_step_ms(lambda: train_step(b, x, contextlib.nullcontext, lr=0.0)),
    }
    ratios = {k: v / ms["plain_fp8"] for k, v in ms.items()}
    print("step ms:", {k: round(v, 3) for k, v in ms.items()}, "vs plain fp8:", ratios)
    assert ratios["backend_empty"] < 1.3


def test_megatron_operator_recovered_through_te_quant_params():
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from gnmr_dist.train.gpu_check.common import Context
    from gnmr_dist.train.gpu_check.mcore_checks import check_megatron_operator

    outcome = check_megatron_operator(Context(), recovery="bf16", low="tensorwise")
    assert outcome.ok, outcome.detail
