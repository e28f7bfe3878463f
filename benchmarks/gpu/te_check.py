"""One-command GPU check of the ``te_fp8`` backend against plain Transformer Engine.

    python -m benchmarks.gpu.te_check [--hidden 2048] [--layers 4] [--tokens 8192] [--steps 12]

Needs one NVIDIA GPU with FP8 (compute capability >= 8.9) and Transformer Engine; about a
minute on one H200. NVFP4 (TE >= 2.8) runs where the GPU has FP4 GEMMs (compute capability
>= 10.0, Blackwell); elsewhere the check that it is refused, naming the device, runs instead.
It is independent of pytest: ``pytest -m gpu tests/gpu -q`` is the separate,
finer-grained suite (bitwise checks on a stack of ``te.Linear``), this script is the
transformer-ish end-to-end check with numbers. On a machine without CUDA or TE it prints why and
exits with status 2, without a traceback.

The checks (``fp8_equal``, ``switching``, ``bf16_equal``, ``unit_bf16_equal``,
``stronger_recovery``, ``gemm_subset``, ``overhead``, ``megatron_operator``, ``nvfp4_refused``)
and what each compares are listed in docs/backends.md#the-gpu-check-check-by-check.

Exit status: 0 every check passed, 1 a check failed, 2 cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import LOW_COST, RECOVERY
from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.backends.te_gemms import CUSTOM, OVERRIDE, te_features

DEVICE = "cuda"
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")
OVERHEAD_LIMIT = 1.25
MCORE_HIDDEN, MCORE_HEADS, MCORE_SEQ, MCORE_BATCH, MCORE_VOCAB = 512, 8, 256, 4, 1024
Region = Callable[[], contextlib.AbstractContextManager[Any]]
Step = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False


# ---------------------------------------------------------------------- model


class Block(nn.Module):
    """``x + proj(gelu(qkv(x)))``, then ``h + mlp(h)``: three TE modules, three units."""

    def __init__(self, te: Any, d: int) -> None:
        super().__init__()
        kw = {"params_dtype": torch.bfloat16, "device": DEVICE}
        self.qkv = te.LayerNormLinear(d, d, **kw)
        self.proj = te.Linear(d, d, **kw)
        self.mlp = te.LayerNormMLP(d, 4 * d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(F.gelu(self.qkv(x)))
        return h + self.mlp(h)


def build(te: Any, args: argparse.Namespace, like: nn.Module | None = None) -> nn.Sequential:
    """A fresh model (fresh FP8 state); with ``like``, a copy of its weights."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(te, args.hidden) for _ in range(args.layers)))
    if like is not None:
        with torch.no_grad():
            for p, q in zip(like.parameters(), model.parameters(), strict=True):
                q.copy_(p)
    return model


def te_modules(model: nn.Module) -> list[nn.Module]:
    return [m for block in model for m in (block.qkv, block.proj, block.mlp)]


def batch(args: argparse.Namespace, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (args.tokens, args.hidden)
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=g)


def train_step(model: nn.Module, x: torch.Tensor, region: Region, lr: float = 1e-2) -> Step:
    """Forward inside ``region()``; backward and SGD outside. (output, loss, gradients)."""
    with region():
        y = model(x)
    loss = y.float().square().mean()
    loss.backward()
    return y.detach(), loss.detach(), sgd_step(model, lr)


def sgd_step(model: nn.Module, lr: float) -> list[torch.Tensor]:
    """``p -= lr * p.grad`` on every parameter, gradients then dropped; returns their copies."""
    grads = []
    with torch.no_grad():
        for p in model.parameters():
            grads.append(p.grad.clone())
            p -= lr * p.grad
            p.grad = None
    return grads


# ---------------------------------------------------------------------- helpers


def plain_region(te: Any, recipe: Any) -> Region:
    """Plain TE FP8, with the argument names of the installed version."""
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=True, recipe=recipe)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def plain_recipe(name: str) -> Any:
    """The recipe plain TE users write (built here, not by the backend)."""
    from transformer_engine.common import recipe as r

    if name == "delayed":
        return r.DelayedScaling()
    if name == "nvfp4":
        return r.NVFP4BlockScaling()
    cls = {"tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling"}
    return getattr(r, cls.get(name, "MXFP8BlockScaling"))(fp8_format=r.Format.HYBRID)


def backend_for(model: nn.Module, **options: Any) -> TEFp8Backend:
    backend = TEFp8Backend(**options)
    backend.wrap(dict(enumerate(te_modules(model))))
    return backend


def max_diff(a: Iterable[Step], b: Iterable[Step]) -> float:
    """Largest absolute difference over outputs, losses and gradients of two runs."""
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        pairs = [(sa[0], sb[0]), (sa[1], sb[1]), *zip(sa[2], sb[2], strict=True)]
        for t, u in pairs:
            worst = max(worst, float((t.float() - u.float()).abs().max()))
    return worst


def bitwise(name: str, run: Callable[..., list[Step]], ref: Callable[..., list[Step]]) -> Check:
    """``run`` vs ``ref`` on copies of one model, with a ``ref`` vs ``ref`` control."""
    diff, control = max_diff(run(), ref()), max_diff(ref(), ref())
    ok = diff == 0.0 or diff <= control
    return Check(name, ok, f"max |diff| {diff:.3g} (plain-vs-plain control {control:.3g})")


def nonfinite(steps: Iterable[Step]) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for y, loss, g in steps for t in (y, loss, *g))


# ---------------------------------------------------------------------- checks


def check_fp8_equal(te: Any, args: argparse.Namespace, name: str) -> Check:
    base = build(te, args)

    def via_backend() -> list[Step]:
        model = build(te, args, like=base)
        backend = backend_for(model, low_cost={"recipe": name})
        steps = []
        for s in range(3):
            backend.apply(set(), s + 1)
            steps.append(train_step(model, batch(args, s), backend.autocast))
        return steps

    def plain() -> list[Step]:
        model, region = build(te, args, like=base), plain_region(te, plain_recipe(name))
        return [train_step(model, batch(args, s), region) for s in range(3)]

    return bitwise(f"fp8_equal[{name}]", via_backend, plain)


def check_bf16_equal(te: Any, args: argparse.Namespace) -> Check:
    base = build(te, args)

    def via_backend() -> list[Step]:
        model = build(te, args, like=base)
        backend = backend_for(model)
        backend.apply(backend.units, step=1)
        return [train_step(model, batch(args, s), backend.autocast) for s in range(2)]

    def plain() -> list[Step]:
        model = build(te, args, like=base)
        return [train_step(model, batch(args, s), contextlib.nullcontext) for s in range(2)]

    return bitwise("bf16_equal", via_backend, plain)


def check_unit_bf16_equal(te: Any, args: argparse.Namespace) -> Check:
    model = build(te, args)
    reference = build(te, args, like=model)
    backend = backend_for(model)
    unit = 1  # block 0's proj: between two FP8 modules
    seen: dict[str, torch.Tensor] = {}
    hook = te_modules(model)[unit].register_forward_hook(
        lambda m, inp, out: seen.update(inp=inp[0].detach(), out=out.detach())
    )
    backend.apply({unit}, step=1)
    train_step(model, batch(args, 0), backend.autocast)
    hook.remove()
    ref = te_modules(reference)[unit](seen["inp"]).detach()
    diff = float((ref.float() - seen["out"].float()).abs().max())
    ok = diff == 0.0 and not backend.fp8_ran(unit) and backend.fp8_ran(0)
    return Check("unit_bf16_equal", ok, f"max |diff| {diff:.3g} vs the module in BF16")


def plan_of(step: int, units: int) -> set[int]:
    """One to two units in recovery, changing every step, and an empty plan every 4th step."""
    return set() if step % 4 == 0 else {step % units, (7 * step) % units}


def check_switching(te: Any, args: argparse.Namespace, low: str, recovery: str = "bf16") -> Check:
    model = build(te, args)
    backend = backend_for(model, low_cost={"recipe": low}, recovery={"recipe": recovery})
    modules, steps, not_reset = te_modules(model), [], 0
    for s in range(1, args.steps + 1):
        returning = backend.report().planned - plan_of(s, len(modules))
        backend.apply(plan_of(s, len(modules)), s)
        if low == "delayed":
            not_reset += sum(not _is_reset(modules[u]) for u in returning)
        steps.append(train_step(model, batch(args, s), backend.autocast))
        planned = backend.report().planned
        expect = [recovery != "bf16" or u not in planned for u in range(len(modules))]
        not_reset += sum(backend.fp8_ran(u) != e for u, e in enumerate(expect))
    bad = nonfinite(steps)
    detail = f"{args.steps} steps, non-finite values {bad}, path/reset violations {not_reset}"
    return Check(f"switching[{low}->{recovery}]", bad == 0 and not_reset == 0, detail)


def _is_reset(module: nn.Module) -> bool:
    """Scale 1 and empty history (also true of a module that never ran FP8)."""
    states = [module.fp8_meta[k] for k in ("scaling_fwd", "scaling_bwd") if k in module.fp8_meta]
    return all(bool((s.scale == 1).all() and (s.amax_history == 0).all()) for s in states)


# ---------------------------------------------------------------------- gemms subsets


class LinearBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` of two ``te.Linear``: the model of ``gemm_subset`` (TE's
    ``LayerNormMLP`` has no ``backward_override``, so ``wrap`` refuses it on that route)."""

    def __init__(self, te: Any, d: int) -> None:
        super().__init__()
        kw = {"params_dtype": torch.bfloat16, "device": DEVICE}
        self.fc1 = te.Linear(d, d, **kw)
        self.fc2 = te.Linear(d, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def build_linears(
    te: Any, args: argparse.Namespace, like: nn.Module | None = None
) -> nn.Sequential:
    """``--layers`` :class:`LinearBlock`; with ``like``, a copy of its weights."""
    torch.manual_seed(0)
    model = nn.Sequential(*(LinearBlock(te, args.hidden) for _ in range(args.layers)))
    if like is not None:
        copy_weights(like, model)
    return model


def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for p, q in zip(src.parameters(), dst.parameters(), strict=True):
            q.copy_(p)


def linear_units(model: nn.Module) -> dict[int, nn.Module]:
    return dict(enumerate(m for block in model for m in (block.fc1, block.fc2)))


def weight_grads(model: nn.Module, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``model``'s weights (not biases) among ``grads`` (``parameters()``
    order)."""
    names = [n for n, _ in model.named_parameters()]
    return [g for n, g in zip(names, grads, strict=True) if n.endswith("weight")]


def _te_lacks(te_version: str, gemms: list[str], low: str) -> str | None:
    """``"skipped: TE x.y lacks ..."`` when the installed TE has no route for ``gemms``."""
    from transformer_engine.common import recipe as r

    features, xy = te_features(r, low), ".".join(te_version.split(".")[:2])
    if gemms == ["dgrad", "wgrad"] and not features.backward_override:
        return f"skipped: TE {xy} lacks backward_override on its recipes (TE >= 2.15)"
    if gemms != ["dgrad", "wgrad"] and not features.hybrid:
        return (
            f"skipped: TE {xy} lacks CustomRecipe with HybridQuantizer and IdentityQuantizer "
            "(TE >= 2.19)"
        )
    return None


def _subset_backend(model: nn.Module, low: str, gemms: list[str]) -> TEFp8Backend | str:
    """The backend on ``model`` recovering ``gemms`` in BF16, or why it is skipped here."""
    backend = TEFp8Backend(low_cost={"recipe": low}, recovery={"recipe": "bf16"})
    lacks = _te_lacks(backend.te_version, gemms, low)
    if lacks is not None:
        return lacks
    try:
        backend.set_gemms(gemms)
    except (ImportError, RuntimeError, ValueError) as err:
        return f"skipped: {str(err).splitlines()[0][:200]}"
    backend.wrap(linear_units(model))
    return backend


def check_gemm_subset(te: Any, args: argparse.Namespace, recipes: list[str]) -> Check:
    """Every unit of a ``te.Linear`` stack recovered with a subset of its GEMMs, BF16 recovery,
    low-cost ``blockwise`` (``tensorwise`` where blockwise does not run):

    * ``["dgrad", "wgrad"]`` == plain TE under the low-cost recipe with
      ``backward_override="high_precision"``, bitwise over three training steps (and its
      gradients != plain FP8's: the backward did leave FP8);
    * ``["fprop"]``: three steps with finite losses, each step's output == plain TE in BF16 on
      that step's weights (bitwise), and every weight gradient != that BF16 run's.

    A subset the installed TE (or GPU) has no route for is skipped with the reason."""
    low = next((r for r in ("blockwise", "tensorwise") if r in recipes), None)
    if low is None:
        return Check("gemm_subset", True, "skipped: neither blockwise nor tensorwise runs", True)
    parts = {
        "dgrad+wgrad": _dgrad_wgrad(te, args, low),
        "fprop": _fprop(te, args, low),
    }
    skipped = [k for k, (_, d) in parts.items() if d.startswith("skipped")]
    ok = all(ok for ok, _ in parts.values())
    detail = f"low-cost {low}; " + "; ".join(f"[{k}] {d}" for k, (_, d) in parts.items())
    return Check("gemm_subset", ok, detail, skipped=len(skipped) == len(parts))


def _dgrad_wgrad(te: Any, args: argparse.Namespace, low: str) -> tuple[bool, str]:
    base = build_linears(te, args)
    probe = _subset_backend(build_linears(te, args, like=base), low, ["dgrad", "wgrad"])
    if isinstance(probe, str):
        return True, probe
    probe.unwrap()
    route = probe.route

    def via_backend() -> list[Step]:
        model = build_linears(te, args, like=base)
        backend = _subset_backend(model, low, ["dgrad", "wgrad"])
        assert not isinstance(backend, str), backend
        steps = []
        for s in range(3):
            backend.apply(set(backend.units), s + 1)
            steps.append(train_step(model, batch(args, s), backend.autocast))
        backend.unwrap()
        return steps

    def plain(override: str | None = "high_precision") -> list[Step]:
        recipe = plain_recipe(low)
        if override is not None:
            recipe = type(recipe)(fp8_format=recipe.fp8_format, backward_override=override)
        model, region = build_linears(te, args, like=base), plain_region(te, recipe)
        return [train_step(model, batch(args, s), region) for s in range(3)]

    check = bitwise("", via_backend, plain)
    fp8 = max_diff(plain(), plain(None))
    ok = check.ok and route == OVERRIDE and fp8 > 0.0
    return ok, f"route {route}, vs plain backward_override {check.detail}, vs plain FP8 {fp8:.3g}"


def _fprop(te: Any, args: argparse.Namespace, low: str) -> tuple[bool, str]:
    model = build_linears(te, args)
    backend = _subset_backend(model, low, ["fprop"])
    if isinstance(backend, str):
        return True, backend
    reference = build_linears(te, args, like=model)
    steps, y_diff, same_grads = [], 0.0, 0
    for s in range(3):
        copy_weights(model, reference)
        ref = train_step(reference, batch(args, s), contextlib.nullcontext, lr=0.0)
        backend.apply(set(backend.units), s + 1)
        steps.append(train_step(model, batch(args, s), backend.autocast))
        y_diff = max(y_diff, _diff(steps[-1][0], ref[0]))
        got, want = weight_grads(model, steps[-1][2]), weight_grads(reference, ref[2])
        same_grads += sum(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    route = backend.route
    backend.unwrap()
    bad = nonfinite(steps)
    ok = route == CUSTOM and bad == 0 and y_diff == 0.0 and same_grads == 0
    return ok, (
        f"route {route}, non-finite {bad}, output vs plain BF16 max |diff| {y_diff:.3g}, "
        f"weight gradients equal to BF16's {same_grads} (want 0)"
    )


def median_ms(step: Callable[[], object], iters: int) -> float:
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


def check_overhead(te: Any, args: argparse.Namespace) -> Check:
    model = build(te, args)
    plain = build(te, args, like=model)
    backend = backend_for(model)
    x, units, counter = batch(args, 0), len(backend.units), iter(range(1, 10**9))

    def planned_step(plan: Callable[[int], set[int]]) -> object:
        """A training step (lr 0) of the backend's model under ``plan(step)``."""
        s = next(counter)
        backend.apply(plan(s), s)
        return train_step(model, x, backend.autocast, lr=0.0)

    fp8 = plain_region(te, plain_recipe("delayed"))
    ms = {
        "plain_fp8": median_ms(lambda: train_step(plain, x, fp8, lr=0.0), args.iters),
        "gnmr_empty": median_ms(lambda: planned_step(lambda s: set()), args.iters),
        "gnmr_switching": median_ms(lambda: planned_step(lambda s: {s % units}), args.iters),
        "plain_bf16": median_ms(
            lambda: train_step(plain, x, contextlib.nullcontext, lr=0.0), args.iters
        ),
    }
    ratio = {k: v / ms["plain_fp8"] for k, v in ms.items()}
    detail = ", ".join(f"{k} {ms[k]:.2f} ms ({ratio[k]:.3f}x)" for k in ms)
    return Check("overhead", ratio["gnmr_empty"] <= OVERHEAD_LIMIT, detail)


# ---------------------------------------------------------------------- megatron-core


@contextlib.contextmanager
def megatron_parallel_state() -> Iterator[None]:
    """A one-rank NCCL process group (if none) and megatron's TP1 x PP1 state; undone on exit."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def megatron_gpt(recipe: str) -> tuple[Any, nn.Module]:
    """(GPTModel with the TE layer spec and FP8 ``recipe``, hybrid, or ``"nvfp4"``: megatron's
    ``--fp4-format e2m1``; its BF16 Float16Module)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=2,
        hidden_size=MCORE_HIDDEN,
        num_attention_heads=MCORE_HEADS,
        ffn_hidden_size=4 * MCORE_HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        **({"fp4": "e2m1", "fp4_recipe": "nvfp4"} if recipe == "nvfp4" else {}),
        **({} if recipe == "nvfp4" else {"fp8": "hybrid", "fp8_recipe": recipe}),
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_with_transformer_engine_spec()
    gpt = GPTModel(config, spec, vocab_size=MCORE_VOCAB, max_sequence_length=MCORE_SEQ).cuda()
    return gpt, Float16Module(config, gpt)


def check_megatron_operator(
    te: Any, args: argparse.Namespace, recovery: str = "bf16", low: str = "tensorwise"
) -> Check:
    """One projection of a megatron GPT recovered through its ``te_quant_params`` (see above),
    under megatron's own ``low`` context (tensorwise FP8, or NVFP4).

    The model is fixed and tiny (``MCORE_*``, not ``args``): the check is about paths and numbers.
    """
    name = (
        f"megatron_operator[{recovery}]"
        if low == "tensorwise"
        else f"megatron_operator[{low}->{recovery}]"
    )
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        return Check(name, True, f"skipped: megatron-core is not importable ({err})", True)
    with megatron_parallel_state():
        return _megatron_operator(te, name, recovery, low)


def _megatron_operator(te: Any, name: str, recovery: str, low: str) -> Check:
    gpt, model = megatron_gpt(low)
    layer = gpt.decoder.layers[0]
    proj, fc2 = layer.self_attention.linear_proj, layer.mlp.linear_fc2
    from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS

    backend = TEFp8Backend(
        low_cost={"recipe": low}, recovery={"recipe": recovery}, operators=MEGATRON_OPERATORS
    )
    names = {0: "decoder.layers.0.self_attention.linear_proj", 1: "decoder.layers.0.mlp.linear_fc2"}
    backend.wrap({0: proj, 1: fc2}, names=names)
    original, seen = proj.te_quant_params, dict[str, Any]()
    hooks = [_capture(m, k, seen) for k, m in (("proj", proj), ("fc2", fc2))]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    tokens = torch.randint(0, MCORE_VOCAB, (MCORE_BATCH, MCORE_SEQ), device=DEVICE, generator=g)
    positions = torch.arange(MCORE_SEQ, device=DEVICE).expand(MCORE_BATCH, -1)
    backend.apply({0}, step=1)
    model(tokens, positions, None).float().square().mean().backward()
    ran1, fp8_ran = backend.report().ran, (backend.fp8_ran(0), backend.fp8_ran(1))
    grads = [p.grad for p in gpt.parameters() if p.grad is not None]
    bad = sum(int((~torch.isfinite(g)).sum()) for g in grads) + (not grads)
    for hook in hooks:
        hook.remove()
    backend.apply(set(), step=2)
    restored = proj.te_quant_params is original
    with torch.no_grad():
        model(tokens, positions, None)
    ran2, back_in_fp8 = backend.report().ran, backend.fp8_ran(0)
    backend.unwrap()

    def alone(module: nn.Module, x: torch.Tensor, region: Region) -> torch.Tensor:
        with torch.no_grad(), region():
            return module(x)[0]  # type: ignore[no-any-return]

    tensorwise = plain_region(te, plain_recipe(low))
    strong = (
        contextlib.nullcontext if recovery == "bf16" else plain_region(te, plain_recipe(recovery))
    )
    (x_proj, y_proj), (x_fc2, y_fc2) = seen["proj"], seen["fc2"]
    diff = {
        "recovered": _diff(y_proj, alone(proj, x_proj, strong)),
        "control": _diff(alone(fc2, x_fc2, tensorwise), alone(fc2, x_fc2, tensorwise)),
        "neighbour_fp8": _diff(y_fc2, alone(fc2, x_fc2, tensorwise)),
        "neighbour_vs_bf16": _diff(y_fc2, alone(fc2, x_fc2, contextlib.nullcontext)),
    }
    paths = ran1 == {0: {RECOVERY}, 1: {LOW_COST}} and ran2 == {0: {LOW_COST}, 1: {LOW_COST}}
    ok = (
        paths
        and restored
        and back_in_fp8
        and bad == 0
        and fp8_ran == (recovery != "bf16", True)
        and diff["recovered"] == 0.0
        and diff["neighbour_fp8"] <= diff["control"]
        and diff["neighbour_vs_bf16"] > 0.0
    )
    detail = ", ".join(f"{k} {v:.3g}" for k, v in diff.items())
    return Check(
        name, ok, f"max |diff| {detail}; paths {paths}, restored {restored}, non-finite grads {bad}"
    )


def _capture(module: nn.Module, key: str, seen: dict[str, Any]) -> Any:
    """Keep ``(input, output)`` of ``module``'s forwards (megatron returns ``(out, bias)``)."""

    def hook(m: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        seen[key] = (inputs[0].detach(), output[0].detach())

    return module.register_forward_hook(hook)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------- NVFP4 refused


def check_nvfp4_refused(te: Any, args: argparse.Namespace) -> Check:
    """On a GPU without FP4 GEMMs: ``te_fp8`` recipe ``nvfp4`` and megatron's FP4 config are
    refused before any region, naming the device; TE's state stays off; FP8 still trains."""
    name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    messages = []
    try:
        TEFp8Backend(low_cost={"recipe": "nvfp4"})
        messages.append("te_fp8 accepted recipe 'nvfp4'")
    except RuntimeError as err:
        messages.append(str(err))
    named = all(name in m and f"{major}.{minor}" in m for m in messages)
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    state_off = not FP8GlobalStateManager.is_fp8_enabled()
    steps = [train_step(build(te, args), batch(args, 0), plain_region(te, plain_recipe("delayed")))]
    trains = nonfinite(steps) == 0
    megatron = _megatron_fp4_refusal(name)
    ok = named and state_off and trains and megatron in ("refused", "skipped")
    detail = (
        f"{name} ({major}.{minor}): te_fp8 message names the device {named}, TE state off "
        f"{state_off}, FP8 still trains {trains}, megatron_patches.apply on --fp4-format "
        f"{megatron}; te_fp8 said: {messages[0][:160]}"
    )
    return Check("nvfp4_refused", ok, detail)


def _megatron_fp4_refusal(device: str) -> str:
    """``refused`` (naming ``device``), ``ACCEPTED`` or ``skipped`` (no megatron-core)."""
    try:
        import megatron_patches
    except ImportError:
        return "skipped"
    try:
        with megatron_parallel_state():
            gpt, _ = megatron_gpt("nvfp4")
            try:
                megatron_patches.apply(gpt, {"max_active": 1})
            except RuntimeError as err:
                return "refused" if device in str(err) else f"refused without the name: {err}"
            megatron_patches.remove()
            return "ACCEPTED"
    except ImportError:
        return "skipped"


# ---------------------------------------------------------------------- driver


def preflight() -> str | None:
    """Why this machine cannot run the check, or None."""
    if not torch.cuda.is_available():
        return (
            f"CUDA is not available (torch {torch.__version__}, no CUDA device). This check needs "
            "an NVIDIA GPU with FP8 and Transformer Engine; on CPU run "
            "`pytest tests/backends/test_te_fp8.py`, and train with backend 'fp8_emulated'."
        )
    try:
        TEFp8Backend()
    except (ImportError, RuntimeError) as err:
        return str(err)
    return None


def runnable_recipes() -> tuple[list[str], list[str]]:
    """(recipes this device runs, a line per recipe it does not)."""
    ok, skipped = [], []
    for name in RECIPES:
        try:
            TEFp8Backend(low_cost={"recipe": name})
            ok.append(name)
        except RuntimeError as err:
            skipped.append(f"{name}: {err}")
    return ok, skipped


def run_checks(te: Any, args: argparse.Namespace, recipes: list[str]) -> list[Check]:
    checks = [check_bf16_equal(te, args), check_unit_bf16_equal(te, args)]
    if "tensorwise" in recipes:  # megatron's own FP8 context runs the low-cost path
        checks.append(check_megatron_operator(te, args))
        if "blockwise" in recipes:
            checks.append(check_megatron_operator(te, args, "blockwise"))
    for name in recipes:
        checks += [check_fp8_equal(te, args, name), check_switching(te, args, name)]
    if {"tensorwise", "blockwise"} <= set(recipes):
        checks.append(check_switching(te, args, "tensorwise", "blockwise"))
    checks.append(check_gemm_subset(te, args, recipes))
    if "nvfp4" in recipes:
        if "mxfp8" in recipes:
            checks.append(check_switching(te, args, "nvfp4", "mxfp8"))
        checks.append(check_megatron_operator(te, args, "bf16", low="nvfp4"))
    else:
        checks.append(check_nvfp4_refused(te, args))
    checks.append(check_overhead(te, args))
    return checks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048, help="model width (multiple of 128)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (3 TE modules each)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (x128)")
    parser.add_argument("--steps", type=int, default=12, help="switching steps per recipe")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = preflight()
    if reason is not None:
        print(f"te_check: cannot run here: {reason}", file=sys.stderr)
        return 2
    import transformer_engine.pytorch as te

    recipes, skipped = runnable_recipes()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print(f"transformer_engine {TEFp8Backend().te_version}; FP8 recipes here: {recipes}")
    for line in skipped:
        print(f"  not here: {line}")
    start = time.perf_counter()
    checks = run_checks(te, args, recipes)
    for c in checks:
        print(f"{'SKIP' if c.skipped else 'PASS' if c.ok else 'FAIL'}  {c.name:32s} {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    n_skipped = sum(c.skipped for c in checks)
    took = time.perf_counter() - start
    passed = len(checks) - len(failed) - n_skipped
    print(f"{passed}/{len(checks)} checks passed ({n_skipped} skipped) in {took:.0f} s")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
