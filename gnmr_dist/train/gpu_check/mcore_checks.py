"""The megatron-core checks: ``te_fp8`` on megatron's own TE linears, one GPU, TP1 x PP1.

A ``GPTModel`` with ``get_gpt_layer_with_transformer_engine_spec()`` (2 layers, width 512, 8
heads, sequence 256, batch 4, vocabulary 1024, BF16 with ``Float16Module``) in a one-rank NCCL
group on a free port: fixed sizes, the checks are about paths and numbers.

* ``megatron_operator[recovery]`` (and ``[nvfp4->bf16]``): layer 0's ``linear_proj`` recovered
  through its ``te_quant_params`` under megatron's FP8 (FP4) context, ``linear_fc2`` its
  neighbour: each against the module run alone on the input it got (in BF16 or the stronger
  recipe; under plain low-cost TE), paths, gradients, ``te_quant_params`` restored. Each
  "alone" run first sets megatron's ``is_first_microbatch``, so TE quantizes the weight afresh
  instead of reusing the FP8 weight cached in the training pass.
* ``megatron_fp4_refused``: ``megatron_patches.enable`` on megatron's FP4 config refused on a GPU
  without FP4 GEMMs, naming it, TE's autocast state unchanged.
* ``megatron_gamma[tensorwise]``: megatron's training step (DDP, its Adam,
  ``get_forward_backward_func``) with ``megatron_patches.enable``, ``te_fp8`` tensorwise,
  ``gamma`` every step, budget 1, the norm thresholds out of reach, the trace written by
  ``megatron_patches.Reporter``. From step 5 one input channel of layer 1's ``linear_fc2`` grows
  4x a step to ``2^10``, function-preserving (``x D`` into the GEMM, the weight parametrized as
  ``W D^-1``; gradient accumulation fusion off). Four runs of 12 steps: plain FP8 twice (the
  second the control), GNMR with ``gamma`` out of reach (the pilot), GNMR with ``gamma`` twice
  the largest ``e`` the pilot saw before the outlier. Passes when every record carries ``e``,
  the faulted unit's ``e`` rises :data:`RISE` x, the pilot's losses are plain FP8's (within the
  control), GNMR recovers nothing before the outlier and the faulted unit first and on at least
  half the steps after, its losses are plain FP8's up to its first recovery and at most
  :data:`LOSS_RTOL` above them after.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnmr_dist.backends import LOW_COST, RECOVERY
from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.train.gpu_check.common import DEVICE, Context, diff, plain_region
from gnmr_dist.train.gpu_check.runner import Outcome
from gnmr_dist.train.gpu_check.te_subsets import device_without_fp4, fp8_state_snapshot

__all__ = [
    "check_megatron_fp4_refused",
    "check_megatron_gamma",
    "check_megatron_operator",
    "parallel_state",
]

HIDDEN, HEADS, SEQ, BATCH, VOCAB, LAYERS = 512, 8, 256, 4, 1024, 2
STEPS, OUTLIER_FROM, CHANNEL, FAULT_LAYER = 12, 5, 7, 1
RISE = 4.0
"""The faulted unit's ``e`` must grow at least this much."""
LOSS_RTOL = 0.02
"""GNMR's loss may exceed plain FP8's by this share once it recovers a unit."""
NEVER = 1e30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def parallel_state() -> Iterator[None]:
    """A one-rank NCCL group (unless one exists) and megatron's TP1 x PP1 state, undone on
    exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _config(recipe: str, **extra: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    precision = (
        {"fp4": "e2m1", "fp4_recipe": "nvfp4"}
        if recipe == "nvfp4"
        else {"fp8": "hybrid", "fp8_recipe": recipe}
    )
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False,
        **precision,
        **extra,
    )


def megatron_gpt(recipe: str) -> tuple[Any, nn.Module]:
    """(``GPTModel`` with the TE spec under ``recipe``, its BF16 ``Float16Module``)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.module import Float16Module

    config = _config(recipe)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    spec = get_gpt_layer_with_transformer_engine_spec()
    gpt = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    return gpt, Float16Module(config, gpt)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(DEVICE)
    positions = torch.arange(SEQ, device=DEVICE).expand(BATCH, -1)
    return tokens[:, :-1], tokens[:, 1:], positions


# ---------------------------------------------------------------------- megatron_operator


def _capture(module: nn.Module, key: str, seen: dict[str, Any]) -> Any:
    """Keep ``(input, output)`` of ``module``'s forward (megatron returns ``(out, bias)``)."""

    def hook(m: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        seen[key] = (inputs[0].detach(), output[0].detach())

    return module.register_forward_hook(hook)


def _alone(module: nn.Module, x: torch.Tensor, run: Callable[[], Any]) -> torch.Tensor:
    """``module`` on ``x`` under ``run()``, its FP8 weight quantized afresh."""
    if hasattr(module, "is_first_microbatch"):
        setattr(module, "is_first_microbatch", True)  # noqa: B010 (typed as Module | Tensor)
    with torch.no_grad(), run():
        return module(x)[0]  # type: ignore[no-any-return]


def check_megatron_operator(context: Context, recovery: str, low: str) -> Outcome:
    del context
    with parallel_state():
        return _operator(recovery, low)


def _operator(recovery: str, low: str) -> Outcome:
    from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS

    gpt, model = megatron_gpt(low)
    layer = gpt.decoder.layers[0]
    proj, fc2 = layer.self_attention.linear_proj, layer.mlp.linear_fc2
    backend = TEFp8Backend(
        low_cost={"recipe": low}, recovery={"recipe": recovery}, operators=MEGATRON_OPERATORS
    )
    names = {0: "decoder.layers.0.self_attention.linear_proj", 1: "decoder.layers.0.mlp.linear_fc2"}
    backend.wrap({0: proj, 1: fc2}, names=names)
    original, seen = proj.te_quant_params, dict[str, Any]()
    hooks = [_capture(m, k, seen) for k, m in (("proj", proj), ("fc2", fc2))]
    tokens, _, positions = _tokens(0)
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
    (x_proj, y_proj), (x_fc2, y_fc2) = seen["proj"], seen["fc2"]
    plain = plain_region(low)
    d = {
        "recovered": diff(y_proj, _alone(proj, x_proj, plain_region(recovery))),
        "control": diff(_alone(fc2, x_fc2, plain), _alone(fc2, x_fc2, plain)),
        "neighbour_fp8": diff(y_fc2, _alone(fc2, x_fc2, plain)),
        "neighbour_vs_bf16": diff(y_fc2, _alone(fc2, x_fc2, contextlib.nullcontext)),
    }
    paths = ran1 == {0: {RECOVERY}, 1: {LOW_COST}} and ran2 == {0: {LOW_COST}, 1: {LOW_COST}}
    ok = (
        paths
        and restored
        and back_in_fp8
        and bad == 0
        and fp8_ran == (recovery != "bf16", True)
        and d["recovered"] == 0.0
        and d["neighbour_fp8"] <= d["control"]
        and d["neighbour_vs_bf16"] > 0.0
    )
    detail = ", ".join(f"{k} {v:.3g}" for k, v in d.items())
    return Outcome(
        ok, f"max |diff| {detail}; paths {paths}, restored {restored}, non-finite grads {bad}"
    )


def check_megatron_fp4_refused(context: Context) -> Outcome:
    del context
    import megatron_patches

    device, capability = device_without_fp4("megatron's FP4 is not refused")
    with parallel_state():
        gpt, _ = megatron_gpt("nvfp4")
        state = fp8_state_snapshot()
        try:
            megatron_patches.enable(gpt, {"max_active": 1})
            message = "ACCEPTED: megatron_patches.enable took an FP4 model"
        except RuntimeError as err:
            message = str(err)
        finally:
            megatron_patches.disable()
        same = fp8_state_snapshot() == state
    named = device in message and capability in message
    return Outcome(
        named and same,
        f"{device} ({capability}): refused naming the device {named}, TE's autocast state "
        f"unchanged {same}; megatron_patches said: {message[:160]}",
    )


# ---------------------------------------------------------------------- megatron_gamma


class ColumnScale(nn.Module):
    """``W D^-1`` (the GEMM's input gets ``x D``): the model's function is unchanged."""

    def __init__(self, d: torch.Tensor) -> None:
        super().__init__()
        self.d = d

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w / self.d.to(w.dtype)


def outlier_size(step: int) -> float:
    """The injected channel's factor at ``step``: 1 before :data:`OUTLIER_FROM`, then 4, 16,
    ... up to ``2^10``."""
    t = step - OUTLIER_FROM
    return 1.0 if t < 0 else 4.0 ** min(t + 1, 5)


def _inject(module: nn.Module, now: list[int]) -> None:
    from torch.nn.utils import parametrize

    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    d = torch.ones(weight.shape[1], device=DEVICE, dtype=torch.float32)
    parametrize.register_parametrization(module, "weight", ColumnScale(d))

    def pre(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        d[CHANNEL] = outlier_size(now[0])
        return (args[0] * d.to(args[0].dtype), *args[1:])

    module.register_forward_pre_hook(pre)


def gamma_block(gamma: float, trace: Path) -> dict[str, Any]:
    """The ``"gnmr"`` block of the GNMR runs (module docstring)."""
    return {
        "backend": "te_fp8",
        "units": "operator",
        "low_cost": {"recipe": "tensorwise"},
        "recovery": {"recipe": "bf16"},
        "gamma": gamma,
        "error_every": 1,
        "max_active": 1,
        "lock_steps": 2,
        "window": 4,
        "warmup_steps": 0,
        "alpha": NEVER,
        "beta": NEVER,
        "log": {"trace": str(trace), "console": 0},
    }


def _build() -> tuple[Any, Any, list[int]]:
    """(the DDP chunk of a ``GPTModel``, megatron's optimizer, the step the fault reads)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt, model = megatron_gpt("tensorwise")
    config = gpt.config
    now = [0]
    _inject(gpt.decoder.layers[FAULT_LAYER].mlp.linear_fc2, now)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=model,
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
        ),
        [ddp],
    )
    return ddp, opt, now


def _train_step(ddp: Any, step: int) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    for p in ddp.parameters():
        p.grad = None
    tokens, labels, positions = _tokens(step)

    def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        next(data)
        out = model(tokens, positions, None, labels=labels)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[ddp],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=False,
    )
    return float(losses[0]["lm loss"])


def _run(gamma: float | None, trace: Path) -> dict[str, Any]:
    """One run of :data:`STEPS` steps: plain FP8 (``gamma`` None) or GNMR; losses, and the
    trace's records, error scores and unit names."""
    import megatron_patches
    from gnmr_dist.telemetry.trace import read_errors, read_trace

    ddp, opt, now = _build()
    handle = reporter = None
    if gamma is not None:
        handle = megatron_patches.enable([ddp], gamma_block(gamma, trace), optimizer=opt)
        reporter = megatron_patches.Reporter(handle.block, handle, source="gnmr-gpu-check")
    losses = []
    try:
        for step in range(1, STEPS + 1):
            now[0] = step
            losses.append(_train_step(ddp, step))
            opt.step()
            if reporter is not None:
                reporter.record(handle, step, losses[-1])
        if reporter is not None:
            reporter.finish(handle)
    finally:
        if reporter is not None:
            reporter.close()
        if handle is not None:
            megatron_patches.disable()
    if gamma is None:
        return {"losses": losses}
    header, _, records = read_trace(trace)
    errors = read_errors(trace, records, len(header.units))
    return {"losses": losses, "records": records, "errors": errors, "units": header.units}


def _loss_gap(a: list[float], b: list[float], upto: int | None = None) -> float:
    pairs = list(zip(a, b, strict=True))[:upto]
    return max((abs(x - y) for x, y in pairs), default=0.0)


def check_megatron_gamma(context: Context) -> Outcome:
    with parallel_state():
        fp8 = _run(None, context.workdir / "unused.jsonl")
        control = _run(None, context.workdir / "unused.jsonl")
        pilot = _run(NEVER, context.workdir / "megatron_pilot.jsonl")
        errors = pilot["errors"]
        if errors is None:
            return Outcome(False, "the pilot's trace carries no error scores")
        before = errors[: OUTLIER_FROM - 1]
        gamma = 2.0 * float(before.max())
        if not gamma > 0:
            return Outcome(False, f"e is {float(before.max())!r} everywhere before the outlier")
        gnmr = _run(gamma, context.workdir / "megatron_gamma.jsonl")
    return _judge(fp8, control, pilot, gnmr, gamma)


def _judge(
    fp8: dict[str, Any],
    control: dict[str, Any],
    pilot: dict[str, Any],
    gnmr: dict[str, Any],
    gamma: float,
) -> Outcome:
    units = list(pilot["units"])
    suffix = f"layers.{FAULT_LAYER}.mlp.linear_fc2"
    faulted = next(i for i, n in enumerate(units) if n.endswith(suffix))
    e = pilot["errors"]
    problems = []
    if not bool(torch.isfinite(e).all()) or bool((e < 0).any()):
        problems.append("the pilot's e has negative or non-finite entries")
    rise = float(e[-1, faulted] / e[: OUTLIER_FROM - 1, faulted].max())
    if not rise >= RISE:
        problems.append(f"the faulted unit's e rose {rise:.3g}x (want >= {RISE})")
    noise = _loss_gap(control["losses"], fp8["losses"])
    pilot_gap = _loss_gap(pilot["losses"], fp8["losses"])
    if pilot_gap > noise:
        problems.append(
            f"the pilot's losses are {pilot_gap:.3g} off plain FP8's (control {noise:.3g})"
        )
    active = [list(r["active"]) for r in gnmr["records"]]
    chosen = [i for i, a in enumerate(active, start=1) if a]
    first = chosen[0] if chosen else None
    after = active[OUTLIER_FROM:]  # the decisions of steps OUTLIER_FROM + 1 ...
    hits = sum(faulted in a for a in after)
    if first is None or first < OUTLIER_FROM or active[first - 1] != [faulted]:
        problems.append(f"first recovery at step {first}: {active[first - 1] if first else []}")
    if hits * 2 < len(after):
        problems.append(
            f"the faulted unit was chosen on {hits} of {len(after)} steps after the outlier"
        )
    upto = first if first is not None else STEPS
    gap = _loss_gap(gnmr["losses"], fp8["losses"], upto)
    if gap > noise:
        problems.append(f"GNMR's losses up to its first recovery are {gap:.3g} off plain FP8's")
    worse = [
        s
        for s, (g, f) in enumerate(zip(gnmr["losses"], fp8["losses"], strict=True), start=1)
        if not (math.isfinite(g) and g <= f * (1 + LOSS_RTOL))
    ]
    if worse:
        problems.append(
            f"GNMR's loss above plain FP8's by more than {LOSS_RTOL:.0%} at steps {worse}"
        )
    data = {
        "gamma": gamma,
        "faulted": units[faulted],
        "e_faulted": [float(v) for v in e[:, faulted]],
        "active": active,
        "losses": {
            k: r["losses"]
            for k, r in (("fp8", fp8), ("control", control), ("pilot", pilot), ("gnmr", gnmr))
        },
    }
    detail = (
        f"e traced for {len(units)} units; {units[faulted]}'s e rose {rise:.3g}x with the outlier; "
        f"gamma {gamma:.3g}: first recovery at step {first} (that unit), chosen on {hits} of "
        f"{len(after)} steps after; losses: pilot == plain FP8 (max |diff| {pilot_gap:.3g}, "
        f"control {noise:.3g}), GNMR final {gnmr['losses'][-1]:.4g} vs plain FP8 "
        f"{fp8['losses'][-1]:.4g}"
    )
    return Outcome.judged(problems, detail, data)
