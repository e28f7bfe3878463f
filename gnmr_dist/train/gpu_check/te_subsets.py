"""``gemm_subset[...]`` and ``nvfp4_refused``: the GEMM subsets and the NVFP4 refusal.

``gemm_subset``: one ``te.Linear`` (``--hidden`` square, bias, BF16) recovered with a subset of
its GEMMs (docs/gemms.md), BF16 recovery, low-cost ``blockwise`` (``tensorwise`` where
blockwise does not run), on ``--tokens`` tokens with a fixed output gradient ``g``. Each
result is compared with an fp32 reference computed by torch (``y = x W^T + b``, ``dx = g W``,
``dW = g^T x``) and with plain TE FP8, through relative errors ``e(a, b) = ||a - b|| / ||b||``:

* ``[dgrad+wgrad]`` (route ``backward_override``): the output is FP8's (``e(y, y_fp8) <=
  0.1 e(y_fp8, y_ref)``) and both gradients are high precision (``e(dx, dx_ref) <= 0.25
  e(dx_fp8, dx_ref)``, the same for ``dW``);
* ``[fprop]`` (route ``custom_recipe``): the output is high precision (``e(y, y_ref) <= 0.25
  e(y_fp8, y_ref)``) and both gradients FP8's (``e(dx, dx_fp8) <= 0.1 e(dx_fp8, dx_ref)``).

A subset the installed TE, or this GPU, has no route for is skipped with the reason.

``nvfp4_refused`` (a GPU without FP4 GEMMs): ``te_fp8`` with recipe ``nvfp4`` raises before
any region, outside one and inside a plain FP8 region the user entered, naming the device and
its compute capability; TE's autocast state (``FP8GlobalStateManager.get_autocast_state()``)
is the same before and after, the user's region still runs its own recipe, and a plain FP8
training step after the refusals equals, bit for bit, the same step before them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.backends.te_gemms import CUSTOM, OVERRIDE, te_features
from gnmr_dist.train.gpu_check.common import (
    Context,
    Region,
    Sizes,
    batch,
    bf16_kw,
    build,
    fp8_state,
    plain_recipe,
    plain_region,
    region,
    rel_err,
    step,
    steps_diff,
    target,
    te_pytorch,
    te_recipe,
)
from gnmr_dist.train.gpu_check.runner import Outcome, Skip

__all__ = ["check_gemm_subset", "check_nvfp4_refused", "device_without_fp4", "fp8_state_snapshot"]

SAME, HIGH = 0.1, 0.25
"""``e(got, FP8's) <= SAME x FP8's own error`` (the same numerics as FP8), ``e(got, ref) <=
HIGH x FP8's error`` (high precision)."""


def _low_cost() -> str:
    """``blockwise`` where it runs here, else ``tensorwise``."""
    try:
        TEFp8Backend(low_cost={"recipe": "blockwise"})
        return "blockwise"
    except RuntimeError:
        return "tensorwise"


def _te_lacks(te_version: str, gemms: list[str], low: str) -> str | None:
    """Why the installed TE has no route for ``gemms``, or ``None``."""
    features, xy = te_features(te_recipe(), low), ".".join(te_version.split(".")[:2])
    if gemms == ["dgrad", "wgrad"] and not features.backward_override:
        return f"TE {xy} lacks backward_override on its recipes (TE >= 2.15)"
    if gemms != ["dgrad", "wgrad"] and not features.hybrid:
        return f"TE {xy} lacks CustomRecipe with HybridQuantizer and IdentityQuantizer (TE >= 2.19)"
    return None


def _subset_backend(module: nn.Module, low: str, gemms: list[str]) -> TEFp8Backend:
    backend = TEFp8Backend(low_cost={"recipe": low}, recovery={"recipe": "bf16"})
    lacks = _te_lacks(backend.te_version, gemms, low)
    if lacks is not None:
        raise Skip(lacks)
    try:
        backend.set_gemms(gemms)
    except (ImportError, RuntimeError, ValueError) as err:
        raise Skip(str(err).splitlines()[0][:300]) from None
    backend.wrap({0: module})
    return backend


def _pass(module: nn.Module, x: torch.Tensor, g: torch.Tensor, run: Region) -> list[torch.Tensor]:
    """``[y, dx, dW]`` of one forward and backward."""
    xx = x.clone().requires_grad_(True)
    with run():
        y = module(xx)
    (y.float() * g).sum().backward()
    weight = module.weight
    assert xx.grad is not None and isinstance(weight, torch.Tensor) and weight.grad is not None
    out = [y.detach(), xx.grad, weight.grad]
    module.zero_grad(set_to_none=True)
    return out


def check_gemm_subset(context: Context, part: str) -> Outcome:
    """``part``: ``"dgrad+wgrad"`` or ``"fprop"`` (module docstring)."""
    sizes, low = context.sizes, _low_cost()
    gemms = part.split("+")
    te = te_pytorch()
    torch.manual_seed(0)
    module = te.Linear(sizes.hidden, sizes.hidden, **bf16_kw())
    plain = te.Linear(sizes.hidden, sizes.hidden, **bf16_kw())
    with torch.no_grad():
        for p, q in zip(module.parameters(), plain.parameters(), strict=True):
            q.copy_(p)
    backend = _subset_backend(module, low, gemms)
    backend.apply({0}, step=1)
    x, g = batch(sizes, 1), target(sizes, 1)
    got = _pass(module, x, g, backend.autocast)
    route = backend.route
    backend.unwrap()
    fp8 = _pass(plain, x, g, plain_region(low))
    w, b, dy = module.weight.float(), module.bias.float(), g.to(torch.bfloat16).float()
    ref = [x.float() @ w.t() + b, dy @ w, dy.t() @ x.float()]
    names = ("y", "dx", "dW")
    fp8_err = {n: rel_err(f, r) for n, f, r in zip(names, fp8, ref, strict=True)}
    to_ref = {n: rel_err(a, r) for n, a, r in zip(names, got, ref, strict=True)}
    to_fp8 = {n: rel_err(a, f) for n, a, f in zip(names, got, fp8, strict=True)}
    high = ("dx", "dW") if part == "dgrad+wgrad" else ("y",)
    want_route = OVERRIDE if part == "dgrad+wgrad" else CUSTOM
    ok = route == want_route and all(
        to_ref[n] <= HIGH * fp8_err[n] if n in high else to_fp8[n] <= SAME * fp8_err[n]
        for n in names
    )
    detail = ", ".join(
        f"{n}: e(ref) {to_ref[n]:.2e} e(fp8) {to_fp8[n]:.2e} [fp8's own {fp8_err[n]:.2e}; "
        f"{'high' if n in high else 'fp8'}]"
        for n in names
    )
    data = {"route": route, "low": low, "to_ref": to_ref, "to_fp8": to_fp8, "fp8_err": fp8_err}
    return Outcome(ok, f"route {route}, low-cost {low}: {detail}", data)


# ---------------------------------------------------------------------- NVFP4 refused


def fp8_state_snapshot() -> tuple[Any, ...]:
    """TE's process-global autocast state (``get_autocast_state()`` where TE has it)."""
    manager = fp8_state()
    getter = getattr(manager, "get_autocast_state", None)
    if getter is not None:
        return tuple(getter())
    return (manager.is_fp8_enabled(), manager.is_fp8_calibration())


def device_without_fp4(skip_because: str) -> tuple[str, str]:
    """This GPU's name and compute capability (``"major.minor"``), both of which an FP4 refusal
    must name; a GPU with FP4 GEMMs (10.0 and up) refuses nothing, so the check is skipped there
    with ``skip_because`` (what is not refused)."""
    major, minor = torch.cuda.get_device_capability()
    device = torch.cuda.get_device_name()
    if (major, minor) >= (10, 0):
        raise Skip(f"{device} ({major}.{minor}) has FP4 GEMMs: {skip_because}")
    return device, f"{major}.{minor}"


def _refusal() -> str:
    try:
        TEFp8Backend(low_cost={"recipe": "nvfp4"})
    except RuntimeError as err:
        return str(err)
    return "ACCEPTED: te_fp8 built recipe 'nvfp4'"


def check_nvfp4_refused(context: Context) -> Outcome:
    del context
    device, capability = device_without_fp4("recipe nvfp4 is not refused here")
    sizes = Sizes(hidden=1024, layers=1, tokens=2048)
    first = build(sizes)
    second = build(sizes, like=first)
    x, g = batch(sizes, 1), target(sizes, 1)
    before = step(first, x, g, plain_region("delayed"))
    state = fp8_state_snapshot()
    messages = [_refusal()]
    mine = plain_recipe("delayed")
    manager = fp8_state()
    with region(True, mine):
        inside = (manager.is_fp8_enabled(), manager.get_fp8_recipe() is mine)
        messages.append(_refusal())
        still = (manager.is_fp8_enabled(), manager.get_fp8_recipe() is mine)
    after = step(second, x, g, plain_region("delayed"))
    same_state = fp8_state_snapshot() == state
    d = steps_diff([before], [after])
    named = all(device in m and capability in m for m in messages)
    ok = named and same_state and inside == still == (True, True) and d == 0.0
    return Outcome(
        ok,
        f"{device} ({capability}): refused naming the device {named} (outside and inside a "
        f"region), TE's autocast state unchanged {same_state}, the user's region intact "
        f"{still == (True, True)}, an FP8 step after vs before max |diff| {d:.3g}; te_fp8 said: "
        f"{messages[0][:160]}",
        {"messages": messages},
    )
