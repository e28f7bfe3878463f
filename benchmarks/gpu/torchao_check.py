"""The torchao_fp8 check for a GPU machine: one command, one line per check, JSON under ``--out``.

    python -m benchmarks.gpu.torchao_check --out "$OUT"     # on the GPU machine (about 3 min)
    python -m benchmarks.gpu.torchao_check --dry             # anywhere: tiny sizes, on the CPU

(a) ``bitwise``: the backend's low-cost path against torchao's own ``Float8Linear`` (each recipe)
and its BF16 recovery against a plain BF16 ``nn.Linear``, forward and both gradients, on the
device. (b) ``throughput``: a Llama (default about 400M parameters) trained side by side,
interleaved step by step: BF16, static FP8 (torchao tensorwise), GNMR on ``torchao_fp8`` with
``gamma`` measured every step (tokens/s, units recovered per step) and GNMR's own work timed
apart (the controller step; the measuring is the rest of the difference to static FP8).
(c) ``outlier``: the three arms with one down_proj input channel rising x4 per step to 2^20
(function-preserving: ``x D`` and ``W D^-1``), their losses and the units GNMR recovered.
(d) ``torchtitan``: where torchtitan 0.3 imports, GNMR's converter
(:mod:`gnmr_dist.integrations.torchtitan`) on torchtitan's Llama 3 debug model: with nothing
recovered, bit for bit torchtitan's own ``Float8LinearConverter`` (``rowwise`` on a GPU, emulated
``tensorwise`` on a CPU), then a run that recovers (one decision per step, units recovered).
Each part is caught, printed and recorded; without CUDA (``--dry``) (b) and (c) run at tiny
sizes on the CPU to exercise the code and say so. What travels: docs/backends.md#torchao_fp8.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

FULL = {
    "hidden": 1024,
    "ffn": 2816,
    "layers": 24,
    "heads": 16,
    "vocab": 32768,
    "seq": 1024,
    "batch": 4,
    "steps": 60,
}
DRY = {
    "hidden": 64,
    "ffn": 128,
    "layers": 2,
    "heads": 4,
    "vocab": 256,
    "seq": 32,
    "batch": 2,
    "steps": 8,
}


class Block(nn.Module):
    """One Llama layer: RMSNorm, attention (q/k/v/o), RMSNorm, SwiGLU (gate/up/down)."""

    def __init__(self, h: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.self_attn = nn.ModuleDict({n: nn.Linear(h, h, bias=False) for n in "qkvo"})
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, ffn, bias=False),
                "up_proj": nn.Linear(h, ffn, bias=False),
                "down_proj": nn.Linear(ffn, h, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        a = self.norm1(x)
        q, k, v = (self.self_attn[n](a).view(b, t, self.heads, -1).transpose(1, 2) for n in "qkv")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.self_attn["o"](o)
        m = self.norm2(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](m)) * self.mlp["up_proj"](m))


class Llama(nn.Module):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.layers = nn.ModuleList(
            Block(s["hidden"], s["ffn"], s["heads"]) for _ in range(s["layers"])
        )
        self.norm, self.head = (
            nn.RMSNorm(s["hidden"]),
            nn.Linear(s["hidden"], s["vocab"], bias=False),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def build(s: dict[str, int], device: torch.device) -> Llama:
    torch.manual_seed(0)
    return Llama(s).to(device=device, dtype=torch.bfloat16)


def batch(s: dict[str, int], step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)


def projections(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    names = {
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{n}"
    }
    return lambda _m, fqn: fqn in names


class Arm:
    """One training run: ``kind`` in bf16, fp8 (static torchao tensorwise), gnmr."""

    def __init__(self, kind: str, s: dict[str, int], device: torch.device, budget: int) -> None:
        from torchao.float8 import convert_to_float8_training

        from gnmr_dist import GNMRConfig
        from gnmr_dist.backends import get_backend
        from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

        self.kind, self.s, self.device = kind, s, device
        self.model = build(s, device)
        self.runtime: Any = None
        if kind == "fp8":
            convert_to_float8_training(self.model, module_filter_fn=projections(self.model))
        if kind == "gnmr":
            registry = UnitRegistry.from_model(self.model)
            self.backend = get_backend("torchao_fp8")
            self.backend.wrap(registry.local_modules)
            self.backend.track_errors(registry.num_units)
            policy = GNMRConfig(
                max_active=budget, lock_steps=4, window=8, warmup_steps=5, gamma=0.02
            )
            self.runtime = GNMRRuntime(registry, policy, error_fn=self.backend.error_sums)
            self.units = registry.num_units
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.losses: list[float] = []
        self.recovered: list[list[int]] = []
        self.own = 0.0

    def step(self, step: int) -> float:
        if self.runtime is not None:
            self.backend.apply(self.runtime.plan.active, step)
        loss = self.model(batch(self.s, step, self.device))
        loss.backward()
        if self.runtime is not None:
            self.recovered.append(sorted(self.backend.report().recovered))
            sync(self.device)
            t0 = time.perf_counter()
            self.runtime.step(lr=3e-4)
            sync(self.device)
            self.own += time.perf_counter() - t0
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        self.losses.append(value)
        return value


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_bitwise(device: torch.device) -> dict[str, Any]:
    """Each recipe's low-cost path == Float8Linear, the BF16 path == nn.Linear (y, dx, dW)."""
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from gnmr_dist.backends import get_backend

    out: dict[str, bool] = {}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        torch.manual_seed(0)
        lin = nn.Linear(512, 256, bias=False, device=device, dtype=torch.bfloat16)
        ref_f8 = nn.Sequential(copy.deepcopy(lin))
        convert_to_float8_training(ref_f8, config=Float8LinearConfig.from_recipe_name(recipe))
        ref_bf16 = copy.deepcopy(lin)
        backend = get_backend("torchao_fp8", low_cost={"recipe": recipe})
        backend.wrap({0: lin})
        for plan, ref in (((), ref_f8), ((0,), ref_bf16)):
            backend.apply(plan, 1)
            got, want = _grads(lin, device), _grads(ref, device)
            out[f"{recipe}/{'bf16' if plan else 'low_cost'}"] = all(
                torch.equal(a, b) for a, b in zip(got, want, strict=True)
            )
    return {"ok": all(out.values()), "equal": out}


def _grads(module: nn.Module, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, 512, generator=g).to(device, torch.bfloat16).requires_grad_()
    y = module(x)
    y.backward(torch.randn(y.shape, generator=g).to(device, torch.bfloat16))
    weight = next(module.parameters())
    out = [y.detach(), x.grad, weight.grad.clone()]
    weight.grad = None
    return out


def check_throughput(s: dict[str, int], device: torch.device, budget: int) -> dict[str, Any]:
    """The three arms interleaved step by step; the first 5 steps of each are not timed."""
    arms = [Arm(k, s, device, budget) for k in ("bf16", "fp8", "gnmr")]
    times = {a.kind: 0.0 for a in arms}
    warm = 5
    for step in range(1, s["steps"] + 1):
        for arm in arms:
            sync(device)
            t0 = time.perf_counter()
            arm.step(step)
            sync(device)
            if step > warm:
                times[arm.kind] += time.perf_counter() - t0
    timed = s["steps"] - warm
    tokens = s["batch"] * s["seq"] * timed
    gnmr = arms[2]
    rate = {k: tokens / v for k, v in times.items()}
    return {
        "ok": all(math.isfinite(x) for a in arms for x in a.losses),
        "params": sum(p.numel() for p in arms[0].model.parameters()),
        "tokens_per_s": rate,
        "vs_bf16": {k: rate[k] / rate["bf16"] for k in rate},
        "gnmr_vs_fp8": rate["gnmr"] / rate["fp8"],
        "gnmr_controller_s_per_step": gnmr.own / s["steps"],
        "recovered_per_step": sum(map(len, gnmr.recovered)) / len(gnmr.recovered),
        "units": gnmr.units,
    }


def _inject(arm: Arm, layer: int, channel: int, size: Callable[[], float]) -> None:
    """Scale ``down_proj``'s input channel ``channel`` by ``size()`` each forward and its weight
    column by the inverse (``x D``, ``W D^-1``): the model's function is unchanged."""
    from torch.nn.utils import parametrize

    from gnmr_dist.train.gpu_check.mcore_checks import ColumnScale

    op = arm.model.layers[layer].mlp["down_proj"]
    d = torch.ones(op.in_features, device=arm.device, dtype=torch.float32)
    parametrize.register_parametrization(op, "weight", ColumnScale(d))

    def pre(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        d[channel] = size()
        return (args[0] * d.to(args[0].dtype),)

    op.register_forward_pre_hook(pre)


def check_outlier(s: dict[str, int], device: torch.device, budget: int) -> dict[str, Any]:
    """Losses of the three arms with the rising outlier; GNMR's recovered units per step."""
    start = max(3, s["steps"] // 3)
    step_now = [0]

    def size() -> float:
        t = step_now[0] - start
        return 1.0 if t < 0 else 4.0 ** min(t + 1, 10)

    arms = [Arm(k, s, device, budget) for k in ("bf16", "fp8", "gnmr")]
    layer = s["layers"] // 2
    for arm in arms:
        _inject(arm, layer, channel=7, size=size)
    for step in range(1, s["steps"] + 1):
        step_now[0] = step
        for arm in arms:
            arm.step(step)
    gnmr = arms[2]
    faulted = f"layers.{layer}.mlp.down_proj"
    names = list(gnmr.runtime.registry.names)
    hit = [i for i, n in enumerate(names) if n.endswith(faulted)]
    return {
        "ok": all(math.isfinite(x) for x in arms[0].losses + arms[2].losses),
        "losses": {a.kind: a.losses for a in arms},
        "final_gap_fp8_minus_bf16": arms[1].losses[-1] - arms[0].losses[-1],
        "final_gap_gnmr_minus_bf16": arms[2].losses[-1] - arms[0].losses[-1],
        "recovered": {step: [names[u] for u in r] for step, r in enumerate(gnmr.recovered, 1) if r},
        "faulted_unit_recovered_steps": sum(any(u in r for u in hit) for r in gnmr.recovered),
        "outlier_from_step": start,
    }


def _titan_model(converters: list[Any], device: torch.device, layers: int) -> nn.Module:
    """torchtitan's Llama 3 debug model (``layers`` layers, its attention switched to
    torchtitan's SDPA module: flex attention has no CPU backward), built on the meta device
    and initialized on ``device`` as ``Trainer`` does."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel", attn_backend="flex", converters=converters).model
    cfg.layers = cfg.layers[:layers]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model  # type: ignore[no-any-return]


def _titan_train(
    model: nn.Module, steps: int, device: torch.device, seen: Callable[[], None] | None = None
) -> list[float]:
    """``Trainer.train_step``'s order with torchtitan's optimizer container and clip; ``seen``
    runs before each optimizer step."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed import utils as dist_utils

    optimizers = default_adamw(lr=1e-3, foreach=True).build(model_parts=[model])
    losses = []
    for s in range(steps):
        optimizers.zero_grad()
        gen = torch.Generator().manual_seed(s)
        tok = torch.randint(0, 2048, (4, 65), generator=gen).to(device)
        pred = model(tok[:, :-1])
        loss = F.cross_entropy(pred.flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        if seen is not None:
            seen()
        optimizers.step()
        losses.append(float(loss.detach()))
    return losses


def check_torchtitan(device: torch.device) -> dict[str, Any]:
    try:
        from torchtitan.components.quantization import Float8LinearConverter

        from gnmr_dist.integrations.torchtitan import GNMRConverter, session_of
    except ImportError as err:
        return {"ok": None, "skipped": f"torchtitan 0.3 not importable here ({err})"}
    cuda = device.type == "cuda"
    low = {"recipe": "rowwise"} if cuda else {"recipe": "tensorwise", "emulate": True}
    theirs = Float8LinearConverter.Config(
        recipe_name="rowwise", emulate=not cuda, filter_fqns=["lm_head"]
    )
    layers, steps = (6, 6) if cuda else (1, 3)
    ours = _titan_model(
        [GNMRConverter.Config(gnmr={"backend": "torchao_fp8", "low_cost": low})], device, layers
    )
    ref = _titan_model([theirs], device, layers)
    ref.load_state_dict(ours.state_dict())
    a, b = _titan_train(ours, steps, device), _titan_train(ref, steps, device)
    policy = {"max_active": 2, "warmup_steps": 0, "alpha": 1.0, "beta": 1.0, "gamma": 1e-6}
    block = {"backend": "torchao_fp8", "low_cost": {"recipe": "tensorwise"}, **policy}
    acting = _titan_model([GNMRConverter.Config(gnmr=block)], device, layers)
    session = session_of(acting)
    backend = None if session is None else session.backend
    assert session is not None and backend is not None
    recovered: list[int] = []
    losses = _titan_train(
        acting, steps, device, lambda: recovered.append(len(backend.report().recovered))
    )
    return {
        "ok": a == b and session.decisions == steps and session.step == steps,
        "equal": a == b,
        "losses_gnmr_none_recovered": a,
        "losses_torchtitan_float8": b,
        "decisions": session.decisions,
        "recovered_per_step": recovered,
        "losses_gnmr_acting": losses,
    }


def run(name: str, fn: Callable[[], dict[str, Any]], dry_note: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # every part is caught: the others still run
        result = {
            "ok": False,
            "error": f"{type(err).__name__}: {err}",
            "trace": traceback.format_exc(),
        }
    result["seconds"] = round(time.perf_counter() - t0, 2)
    if dry_note and result.get("ok") is not None:
        result["dry"] = dry_note
    status = {True: "PASS", False: "FAIL", None: "SKIP"}[result.get("ok")]
    if dry_note and status == "PASS":
        status = "DRY"
    brief = {
        k: v
        for k, v in result.items()
        if k
        in (
            "error",
            "skipped",
            "vs_bf16",
            "gnmr_vs_fp8",
            "recovered_per_step",
            "final_gap_fp8_minus_bf16",
            "final_gap_gnmr_minus_bf16",
            "faulted_unit_recovered_steps",
            "equal",
            "dry",
        )
    }
    print(f"{name}: {status} ({result['seconds']} s) {json.dumps(brief, default=str)}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/torchao_check"))
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--steps", type=int, default=None, help="training steps of (b) and (c)")
    parser.add_argument("--budget", type=int, default=4, help="GNMR's max_active")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda" if cuda else "cpu")
    sizes = dict(FULL if cuda else DRY)
    sizes["steps"] = args.steps or sizes["steps"]
    note = None if cuda else "no CUDA: tiny model on the CPU, the code path only, not a figure"
    print(f"torchao_check: {device} torch {torch.__version__} sizes {sizes}", flush=True)
    results = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "sizes": sizes,
        "bitwise": run("bitwise", lambda: check_bitwise(device), None),
        "throughput": run("throughput", lambda: check_throughput(sizes, device, args.budget), note),
        "outlier": run("outlier", lambda: check_outlier(sizes, device, args.budget), note),
        "torchtitan": run("torchtitan", lambda: check_torchtitan(device), None),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torchao_check.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False]
    verdict = "FAIL " + ", ".join(failed) if failed else "done"
    print(f"torchao_check: {verdict}; {out}/torchao_check.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
