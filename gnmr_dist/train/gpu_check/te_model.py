"""The checks of ``te_fp8`` on a model of TE modules against plain Transformer Engine.

The model (:class:`~.common.Block`): ``--layers`` blocks of ``x + Linear(gelu(LayerNormLinear
(x)))`` then ``h + LayerNormMLP(h)``, BF16 parameters, every TE module one unit; the loss
``sum(y * g)`` (:mod:`.common`). A bitwise comparison passes when the two runs are equal bit for
bit, or, where a kernel is not deterministic, when they are at most twice as far apart as the
reference from a second run of itself (every run seeds torch's generators alike, so NVFP4's
stochastic rounding draws the same bits).

* ``fp8_equal[recipe]``: an empty plan == plain ``te.autocast(recipe)``, 3 training steps
  (outputs, losses, every gradient); fails on any larger difference.
* ``bf16_equal``: every unit recovered == the model without FP8, 2 steps.
* ``unit_bf16_equal`` / ``stronger_recovery[low->recovery]``: one recovered unit (block 0's
  ``Linear``) gives the output and parameter gradients of that module run alone, on the input
  and output gradient it had, in BF16 (or under plain ``recovery``), and its neighbour
  (block 0's ``LayerNormLinear``) those of that module alone under plain ``low``; the report's
  paths and ``fp8_ran`` agree; fails on any difference.
* ``switching[low->recovery]``: ``--steps`` steps with one or two units recovered, changing every
  step (none every 4th): each step == the same model run with plain TE regions nested by hand
  (forward hooks entering a disabled or a ``recovery`` region around the recovered modules; under
  delayed scaling TE's own ``reset_fp8_meta_tensors`` on a unit's way back), paths as planned,
  no inf/nan, and every unit's gradient within :data:`GRAD_LIMIT` of a BF16 twin's on the same
  weights (a lost or unscaled gradient is 1.0 away).
* ``delayed_state[reset|keep]``: around a unit's recovery under delayed scaling, its scale and
  amax history (forward input and weight, backward gradient) after every step == TE's update
  rule (``common/recipe/delayed_scaling.cu``: the history rolled, the newest amax last, scale
  ``max / max(history)``) applied to the state before the step and the amaxes of the tensors the
  module really had; frozen bit for bit while recovered; after the first step back, under
  ``reset`` from an empty history (``448 / amax`` of that step's input), under ``keep`` from the
  history it had before its recovery. The input shrinks 8x from that step on, so the two differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import LOW_COST, RECOVERY
from gnmr_dist.train.gpu_check.common import (
    CONTROL_FACTOR,
    Context,
    Region,
    Stack,
    StepResult,
    batch,
    bf16_kw,
    bitwise_or_control,
    build,
    copy_weights,
    diff,
    nonfinite,
    plain_region,
    randn,
    region,
    step,
    steps_diff,
    target,
    te_pytorch,
    wrapped,
)
from gnmr_dist.train.gpu_check.runner import Outcome

__all__ = [
    "GRAD_LIMIT",
    "check_bf16_equal",
    "check_delayed_state",
    "check_fp8_equal",
    "check_one_recovered",
    "check_switching",
    "plan_of",
]

GRAD_LIMIT = {"nvfp4": 0.8, "other": 0.5}
"""``switching``: largest ``||grad - grad_bf16|| / ||grad_bf16||`` of a unit (NVFP4's 4-bit
gradients are further from BF16's than FP8's)."""


def _control(d: float, control: float | None) -> str:
    tail = "" if control is None else f" (plain-vs-plain control {control:.3g})"
    return f"max |diff| {d:.3g}{tail}"


def check_fp8_equal(context: Context, name: str) -> Outcome:
    sizes = context.sizes
    base = build(sizes)
    ran: list[bool] = []

    def via_backend() -> list[StepResult]:
        model = build(sizes, like=base)
        backend = wrapped(model, low_cost={"recipe": name})
        out = []
        for s in range(1, 4):
            backend.apply(set(), s)
            out.append(step(model, batch(sizes, s), target(sizes, s), backend.autocast))
            ran.append(all(backend.fp8_ran(u) for u in backend.units))
        return out

    def plain() -> list[StepResult]:
        model, run = build(sizes, like=base), plain_region(name)
        return [step(model, batch(sizes, s), target(sizes, s), run) for s in range(1, 4)]

    ok, d, control = bitwise_or_control(via_backend, plain)
    ok = ok and all(ran)
    return Outcome(ok, f"{_control(d, control)}; every unit ran {name}: {all(ran)}")


def check_bf16_equal(context: Context) -> Outcome:
    sizes = context.sizes
    base = build(sizes)

    def via_backend() -> list[StepResult]:
        model = build(sizes, like=base)
        backend = wrapped(model)
        out = []
        for s in range(1, 3):
            backend.apply(backend.units, s)
            out.append(step(model, batch(sizes, s), target(sizes, s), backend.autocast))
        return out

    def plain() -> list[StepResult]:
        model = build(sizes, like=base)
        return [
            step(model, batch(sizes, s), target(sizes, s), contextlib.nullcontext)
            for s in range(1, 3)
        ]

    ok, d, control = bitwise_or_control(via_backend, plain)
    return Outcome(ok, f"every unit recovered vs no FP8: {_control(d, control)}")


# ---------------------------------------------------------------------- one recovered unit


def _capture(module: nn.Module, seen: dict[str, torch.Tensor]) -> Any:
    def hook(m: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
        seen["inp"] = inputs[0].detach().requires_grad_(inputs[0].requires_grad)
        seen["out"] = out.detach()
        out.register_hook(  # type: ignore[no-untyped-call]
            lambda dy: seen.__setitem__("dy", dy.detach())
        )

    return module.register_forward_hook(hook)


def _alone(
    module: nn.Module, seen: dict[str, torch.Tensor], run: Region, seed: int = 0
) -> list[torch.Tensor]:
    """``module`` alone under ``run()`` on the input (requiring a gradient where it did) and
    output gradient seen: output, then each parameter's gradient."""
    torch.manual_seed(seed)
    with run():
        out = module(seen["inp"])
    out.backward(seen["dy"])
    grads = _grads(module)
    module.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


def _grads(module: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads), "a parameter got no gradient"
    return [g for g in grads if g is not None]


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(diff(x, y) for x, y in zip(a, b, strict=True))


def _against_alone(
    got: list[torch.Tensor], module: nn.Module, seen: dict[str, torch.Tensor], run: Region
) -> tuple[float, float, float]:
    """``(output diff, gradient diff, gradient control)`` of a unit against ``module`` alone
    under ``run()``; the control (two lone runs on other random draws) only where the gradients
    differ (stochastic rounding draws other bits alone than inside the model)."""
    alone = _alone(module, seen, run)
    d_out, d_grad = diff(got[0], alone[0]), _worst(got[1:], alone[1:])
    control = 0.0 if d_grad == 0.0 else _worst(alone[1:], _alone(module, seen, run, 1)[1:])
    return d_out, d_grad, control


def check_one_recovered(context: Context, low: str, recovery: str) -> Outcome:
    """``unit_bf16_equal`` (``low`` delayed, ``recovery`` bf16) and ``stronger_recovery``."""
    sizes = context.sizes
    model = build(sizes)
    reference = build(sizes, like=model)
    backend = wrapped(model, low_cost={"recipe": low}, recovery={"recipe": recovery})
    unit, neighbour = 1, 0  # block 0's Linear (between two FP8 modules) and its LayerNormLinear
    mods, refs = model.units(), reference.units()
    seen: dict[int, dict[str, torch.Tensor]] = {unit: {}, neighbour: {}}
    handles = [_capture(mods[u], seen[u]) for u in seen]
    backend.apply({unit}, step=1)
    with backend.autocast():
        y = model(batch(sizes, 1))
    (y.float() * target(sizes, 1)).sum().backward()
    for h in handles:
        h.remove()
    got = {u: [seen[u]["out"], *_grads(mods[u])] for u in seen}
    ran = backend.report().ran
    paths = ran == {u: frozenset({RECOVERY if u == unit else LOW_COST}) for u in backend.units}
    fp8 = (backend.fp8_ran(unit), backend.fp8_ran(neighbour))
    d_unit = _against_alone(got[unit], refs[unit], seen[unit], plain_region(recovery))
    d_next = _against_alone(got[neighbour], refs[neighbour], seen[neighbour], plain_region(low))
    teeth = diff(got[unit][0], _alone(refs[unit], seen[unit], plain_region(low))[0])
    close = all(
        out == 0.0 and grad <= CONTROL_FACTOR * control for out, grad, control in (d_unit, d_next)
    )
    ok = close and teeth > 0.0 and paths and fp8 == (recovery != "bf16", True)
    return Outcome(
        ok,
        f"recovered unit vs alone under {recovery}: output {d_unit[0]:.3g}, gradients "
        f"{d_unit[1]:.3g} (control {d_unit[2]:.3g}; vs {low}: {teeth:.3g}); neighbour vs alone "
        f"under {low}: {d_next[0]:.3g}, {d_next[1]:.3g} (control {d_next[2]:.3g}); paths "
        f"{paths}, fp8_ran {fp8}",
    )


# ---------------------------------------------------------------------- switching


def plan_of(s: int, units: int) -> set[int]:
    """One or two units in recovery, changing every step, and an empty plan every 4th step."""
    return set() if s % 4 == 0 else {s % units, (7 * s) % units}


class HandNested:
    """The same nesting as ``te_fp8``, built by hand from TE's regions: the modules of
    :attr:`plan` run inside an inner region (disabled, or ``recovery``) entered by a forward
    pre-hook and left by a forward hook."""

    def __init__(self, model: Stack, recovery: str) -> None:
        self.plan: set[int] = set()
        self.recovery = recovery
        self._open: list[contextlib.AbstractContextManager[Any]] = []
        self.handles = []
        for u, module in enumerate(model.units()):
            self.handles.append(module.register_forward_pre_hook(self._enter(u)))
            self.handles.append(module.register_forward_hook(self._leave(u)))

    def _inner(self) -> contextlib.AbstractContextManager[Any]:
        if self.recovery == "bf16":
            return region(False)
        return plain_region(self.recovery)()

    def _enter(self, u: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any) -> None:
            if u in self.plan:
                inner = self._inner()
                inner.__enter__()
                self._open.append(inner)

        return hook

    def _leave(self, u: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            if u in self.plan:
                self._open.pop().__exit__(None, None, None)

        return hook


def _unit_slices(model: Stack) -> list[slice]:
    out, start = [], 0
    for module in model.units():
        n = len(list(module.parameters()))
        out.append(slice(start, start + n))
        start += n
    return out


def _grad_err(a: StepResult, b: StepResult, slices: list[slice]) -> float:
    """Largest per-unit ``||grad_a - grad_b|| / ||grad_b||`` over the units' parameters."""
    worst = 0.0
    for s in slices:
        pairs = zip(a.grads[s], b.grads[s], strict=True)
        num = sum(float((g.double() - h.double()).square().sum()) for g, h in pairs)
        den = sum(float(h.double().square().sum()) for h in b.grads[s])
        worst = max(worst, (num / den) ** 0.5 if den else float("inf"))
    return worst


def _seeded_step(
    seed: int, model: nn.Module, x: torch.Tensor, g: torch.Tensor, run: Region
) -> StepResult:
    torch.manual_seed(seed)
    return step(model, x, g, run)


def check_switching(context: Context, low: str, recovery: str) -> Outcome:
    sizes = context.sizes
    model = build(sizes)
    refs = [build(sizes, like=model) for _ in range(2)]  # the reference and its control
    twin = build(sizes, like=model)
    backend = wrapped(model, low_cost={"recipe": low}, recovery={"recipe": recovery})
    nested = [HandNested(r, recovery) for r in refs]
    units, slices = len(backend.units), _unit_slices(model)
    d = control = worst = 0.0
    bad_paths = bad = 0
    previous: set[int] = set()
    for s in range(1, sizes.steps + 1):
        plan = plan_of(s, units)
        backend.apply(plan, s)
        for r, n in zip(refs, nested, strict=True):
            if low == "delayed":  # TE's own reset of the units coming back (reseed "reset")
                for u in previous - plan:
                    reset = getattr(r.units()[u], "reset_fp8_meta_tensors")  # noqa: B009
                    reset()
            n.plan = set(plan)
        previous = plan
        x, g = batch(sizes, s), target(sizes, s)
        copy_weights(model, twin)
        torch.manual_seed(s)  # each run draws the same stochastic-rounding bits
        got = step(model, x, g, backend.autocast)
        bad_paths += sum(
            backend.fp8_ran(u) != (recovery != "bf16" or u not in plan) for u in range(units)
        )
        want, again = (_seeded_step(s, r, x, g, plain_region(low)) for r in refs)
        bf16 = step(twin, x, g, contextlib.nullcontext, lr=0.0)
        d, control = max(d, steps_diff([got], [want])), max(control, steps_diff([want], [again]))
        worst = max(worst, _grad_err(got, bf16, slices))
        bad += nonfinite([got])
    limit = GRAD_LIMIT["nvfp4" if low == "nvfp4" else "other"]
    ok = d <= CONTROL_FACTOR * control and bad_paths == 0 and bad == 0 and worst <= limit
    return Outcome(
        ok,
        f"{sizes.steps} steps vs TE regions nested by hand: max |diff| {d:.3g} (control "
        f"{control:.3g}); path errors {bad_paths}; non-finite {bad}; worst unit gradient vs BF16 "
        f"{worst:.3f} (limit {limit})",
        {"diff": d, "control": control, "grad_vs_bf16": worst},
    )


# ---------------------------------------------------------------------- delayed scaling state

_D, _TOKENS, _LAYERS, _HISTORY = 1024, 2048, 3, 16
_PLAN = [set(), set(), {1}, {1}, set(), set()]
_SHRINK_FROM = 5  # the first step back; the input is 8x smaller from here on
_SLOTS = {"scaling_fwd": (0, 1), "scaling_bwd": (0,)}
"""The state slots whose amax the check knows: forward GEMM input and weight, backward output
gradient (``FP8FwdTensorIdx`` / ``FP8BwdTensorIdx`` of ``pytorch/csrc/common.h``)."""
_MAX = {"scaling_fwd": 448.0, "scaling_bwd": 57344.0}
"""e4m3 forward, e5m2 backward (HYBRID), margin 0."""


class _LinearStack(Stack):
    def __init__(self) -> None:
        te = te_pytorch()
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(te.Linear(_D, _D, **bf16_kw()) for _ in range(_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x

    def units(self) -> list[nn.Module]:
        return list(self.layers)


State = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""``{"scaling_fwd": (scale, amax_history), "scaling_bwd": ...}``."""


def _state(module: nn.Module) -> State | None:
    meta = getattr(module, "fp8_meta", None) or {}
    if not all(k in meta for k in _SLOTS):
        return None
    return {
        k: (meta[k].scale.detach().clone(), meta[k].amax_history.detach().clone()) for k in _SLOTS
    }


def _fresh(like: State) -> State:
    """TE's initial state: scale 1, empty history."""
    return {k: (torch.ones_like(s), torch.zeros_like(h)) for k, (s, h) in like.items()}


def te_update(before: State, amax: dict[str, dict[int, torch.Tensor]]) -> State:
    """TE's delayed-scaling update (``kernel_bulk``, ``amax_compute_algo="max"``, margin 0) of
    the slots in ``amax``: a slot whose new amax is non-zero rolls its history (row 0 zeroed,
    rows shift up, the new amax last) and takes ``max / max(rows 1.., new amax)``; a zero amax
    leaves both as they were."""
    out = {}
    for key, (scale, hist) in before.items():
        scale, hist = scale.clone(), hist.clone()
        for slot, last in amax.get(key, {}).items():
            last = last.float().reshape(())
            if float(last) == 0.0:
                continue
            column = hist[:, slot]
            a = torch.maximum(column[1:].max(), last) if len(column) > 1 else last
            rolled = torch.cat([column[1:], last.reshape(1)])
            rolled[0] = 0.0
            hist[:, slot] = rolled
            if bool(torch.isfinite(a)) and float(a) > 0:
                value = torch.tensor(_MAX[key], dtype=torch.float32, device=a.device) / a
                scale[slot] = torch.where(torch.isinf(value), torch.finfo(torch.float32).max, value)
        out[key] = (scale, hist)
    return out


def _same(a: State, b: State) -> bool:
    return all(
        torch.equal(a[k][0][slot], b[k][0][slot])
        and torch.equal(a[k][1][:, slot], b[k][1][:, slot])
        for k, slots in _SLOTS.items()
        for slot in slots
    )


def check_delayed_state(context: Context, reseed: str) -> Outcome:
    del context
    torch.manual_seed(0)
    model = _LinearStack()
    low = {"recipe": "delayed", "amax_history_len": _HISTORY, "reseed": reseed}
    backend = wrapped(model, low_cost=low)
    mods = model.units()
    amax: dict[int, dict[str, dict[int, torch.Tensor]]] = {}

    def watch(u: int, module: nn.Module) -> Any:
        def hook(m: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            x, w = inputs[0].detach(), cast(torch.Tensor, m.weight).detach()
            amax[u] = {"scaling_fwd": {0: x.abs().amax(), 1: w.abs().amax()}}

            def grad(dy: torch.Tensor) -> None:
                amax[u]["scaling_bwd"] = {0: dy.detach().abs().amax()}

            out.register_hook(grad)  # type: ignore[no-untyped-call]

        return module.register_forward_hook(hook)

    handles = [watch(u, m) for u, m in enumerate(mods)]
    problems: list[str] = []
    frozen: State | None = None
    after: dict[int, State] = {}
    try:
        for s, plan in enumerate(_PLAN, start=1):
            backend.apply(plan, s)
            before = {u: _state(m) for u, m in enumerate(mods)}
            amax.clear()
            scale = 0.125 if s >= _SHRINK_FROM else 1.0
            x = randn((_TOKENS, _D), s, scale)
            g = randn((_TOKENS, _D), 100 + s).float()
            step(model, x, g, backend.autocast, lr=0.0)
            for u, m in enumerate(mods):
                now = _state(m)
                if now is None:
                    problems.append(f"step {s}: unit {u} has no delayed-scaling state")
                    continue
                if backend.fp8_ran(u) == (u in plan):
                    problems.append(f"step {s}: unit {u} ran {'FP8' if u in plan else 'BF16'}")
                if u in plan:  # recovered: frozen bit for bit
                    if not _same(now, after[u]):
                        problems.append(f"step {s}: recovered unit {u}'s scale or history moved")
                    continue
                base = before[u] or _fresh(now)
                if u == 1 and s == _SHRINK_FROM:  # the first step back
                    assert frozen is not None
                    base = _fresh(now) if reseed == "reset" else frozen
                if not _same(now, te_update(base, amax.get(u, {}))):
                    problems.append(f"step {s}: unit {u}'s scale or history is not TE's update")
                after[u] = now
            if s == 2:
                frozen = after[1]
    finally:
        for h in handles:
            h.remove()
    scale1 = float(after[1]["scaling_fwd"][0][0])
    if problems:
        return Outcome(False, "; ".join(problems[:4]), {"problems": problems})
    return Outcome(
        True,
        f"reseed {reseed}: {len(_PLAN)} steps, unit 1 recovered on steps 3-4: frozen while "
        f"recovered, every state TE's update of the one before (from "
        f"{'an empty history' if reseed == 'reset' else 'its pre-recovery history'} on the "
        f"first step back); final input scale {scale1:.6g}",
        {"final_scale": scale1},
    )
