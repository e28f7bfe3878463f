"""DeepSpeed integration: ``gnmr_dist.deepspeed.initialize`` reads the ``"gnmr"`` config block.

Same arguments and return value as ``deepspeed.initialize``. With a ``"gnmr"`` block (and
``"enabled"`` not false) it:

1. validates the block before anything else (unknown keys, values, backend options);
2. finds the model's units, agrees their ids over the world (one all-gather at start) and wraps
   them with the configured backend, before DeepSpeed builds its optimizer;
3. hooks ``engine._take_model_step``, which DeepSpeed runs once per gradient-accumulation
   boundary after reducing the gradients: there it reads each rank's piece of every gradient
   where the ZeRO stage keeps it (:mod:`gnmr_dist.integrations.deepspeed.grads`), all-reduces the
   small per-unit vector once over the data-parallel group, lets the optimizer step, and, if the
   step was applied (no overflow skip), feeds the controller and applies its plan to the next
   step. A skipped step leaves the controller's history untouched;
4. enters the backend's step context around every forward (TE's FP8 region; no-op otherwise);
5. with ``"gamma"`` in the block (docs/algorithm.md#damage-term), turns on the backend's error sums
and
   reduces them in the same all-reduce, scaled by ``1/dp`` (DeepSpeed averages the gradients
   over the data-parallel ranks, so the error bounds of each rank's micro-batches are averaged
   the same way); the controller gets ``e = B / G`` (``G``: the global gradient norm). A
   backend that reports none (``te_fp8``) or no backend is refused with ``"gamma"`` set, before
   DeepSpeed starts;
6. saves the controller state next to every DeepSpeed checkpoint (``<dir>/<tag>/gnmr_state.pt``,
   plain tensors sealed with a per-field checksum) and restores it in ``load_checkpoint`` with
   ``torch.load(weights_only=True)``, after its checksum and invariants are checked. The state
   is written atomically (:func:`~gnmr_dist.integrations.state_file.write_atomic`) *before*
   DeepSpeed's own files and its ``latest`` tag, so a job killed at any instant of a save
   (preemption, node failure) restarts from a checkpoint that is complete, GNMR state included:
   the new one if ``latest`` names it, else the one before. (A fixed tag saved over in place is
   not kill-safe for DeepSpeed's own files either; use per-step tags, DeepSpeed's default.);
7. with ``"probe": {"every": N, "k": 3}``, runs the recovery-gap probe
   (:class:`gnmr_dist.distributed.probe.RecoveryProbe`) on every optimizer step ``t`` with
   ``t % N == 0`` (GNMR's step numbers: the step whose plan is applied), inside the wrapped
   ``engine.forward`` at the first training forward of the step's gradient-accumulation cycle,
   before that forward and with its arguments: two extra forward/backward passes of
   ``engine.module`` (inside the backend's ``step_context()`` and DeepSpeed's autocast, as the
   real forward), every unit on the low-cost and then on the recovery path, differentiated with
   ``torch.autograd.grad`` (``.grad`` and DeepSpeed's gradient hooks are untouched; the step's
   RNG, plan, gradients and decisions are those of a run without the probe). The decision
   record of step ``t`` in the trace gains a ``"probe"`` object (:class:`ProbeRecord`);
   ``engine.gnmr.last_probe`` holds the last one on every rank.

The probe's loss is what the forward returns: a scalar tensor, an output with ``.loss`` or a
mapping with ``"loss"`` (a Hugging Face model given ``labels=``); anything else is a
``RuntimeError`` naming ``gnmr.probe``. Each rank's loss is divided by the data-parallel size and
the probe sums the two passes' gradients over the data-parallel group, which gives the gradient
of the global batch's mean loss when the ranks' micro-batches have equal sizes (DeepSpeed's
``train_micro_batch_size_per_gpu``). With gradient accumulation the probe measures the first
micro-batch of the step only: the gaps of one micro-batch's gradient, a noisier estimate of the
step's. Forwards in eval mode or under ``no_grad`` are never probed. The update gap needs Adam's
per-parameter second moments keyed by the module's own parameters: DeepSpeed 0.19 keeps them so
only at ZeRO stage 0 with fp32 weights and a torch ``Adam``/``AdamW`` (``"torch_adam": true``;
``engine.optimizer`` is then the torch optimizer itself). Under bf16 (``FP16_UnfusedOptimizer``
or ``BF16_Optimizer``: fp32 master copies) and ZeRO 1-2 (flat fp32 partitions) there is no such
state: the update gap is not recorded (``null`` in the trace, ``n/a`` in ``gnmr-report``).
Refused before DeepSpeed starts: ZeRO stage 3 (the parameters are partitioned and exist whole
only inside DeepSpeed's own forward/backward hooks, so ``autograd.grad`` on them is not
available) and fp16 loss scaling (``fp16``, ``amp``, fp16 ``torch_autocast``: the probe
differentiates the unscaled loss, whose fp16 gradients would underflow where the step's do not).

``engine.gnmr`` is the :class:`DeepSpeedGNMR` runtime (controller, registry, backend, last
decision, telemetry). Without the block, or with ``"enabled": false``, the result is plain
DeepSpeed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gnmr_dist.backends import PrecisionBackend, registered_operator_types
from gnmr_dist.distributed import UnitRegistry
from gnmr_dist.distributed.units import check_selection
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.deepspeed.session import (
    STATE_FILE,
    DeepSpeedGNMR,
    probe_loss,
)
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.session import (
    check_error_source,
)

__all__ = [
    "STATE_FILE",
    "DeepSpeedGNMR",
    "disable",
    "enable",
    "enabled",
    "engines_with_gnmr",
    "initialize",
    "load_ds_config",
    "probe_loss",
]

logger = logging.getLogger(__name__)


def load_ds_config(config: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON/HJSON file path, as a dict."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {config!r} does not exist")
    text = path.read_text()
    try:
        return dict(json.loads(text))
    except json.JSONDecodeError:
        import hjson  # DeepSpeed's own config reader, installed with it

        return dict(hjson.loads(text))


_PATCHES = Patches("gnmr_dist.deepspeed.enable")
"""``deepspeed.initialize`` replaced by :func:`enable` (and, through it, ``Trainer.log``)."""
_WARNED_NO_BLOCK: list[bool] = []
_BUILT = [0]
"""How many engines :func:`initialize` has given GNMR in this process (read by
:class:`~gnmr_dist.integrations.deepspeed.trainer.GNMRCallback`: an engine built without it is
warned of)."""


def engines_with_gnmr() -> int:
    """How many DeepSpeed engines this process has built with GNMR so far."""
    return _BUILT[0]


def _deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (never the patched one: no recursion)."""
    import deepspeed

    return _PATCHES.original(deepspeed, "initialize") or deepspeed.initialize


def enable() -> None:
    """Make ``deepspeed.initialize`` itself read the ``"gnmr"`` block (idempotent).

    For code that calls DeepSpeed on its own: Hugging Face ``Trainer`` and TRL trainers (through
    accelerate, which looks ``deepspeed.initialize`` up when it prepares the model) and plain
    ``accelerate`` with a DeepSpeed plugin. Call it once before the trainer or accelerator
    prepares the model; the block is read from the same DeepSpeed config they pass
    (``config_params``). While enabled, an engine built from a config without an enabled
    ``"gnmr"`` block logs that once, and ``transformers.Trainer.log`` adds GNMR's counts to
    Trainer's training logs (:mod:`gnmr_dist.integrations.deepspeed.trainer`). :func:`disable`
    restores both.
    """
    import deepspeed

    if _PATCHES:
        return

    @functools.wraps(deepspeed.initialize)
    def gnmr_initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        return initialize(*args, **kwargs)

    _PATCHES.set(deepspeed, "initialize", gnmr_initialize)
    with contextlib.suppress(ImportError):  # no transformers: nothing to log into
        from gnmr_dist.integrations.deepspeed import trainer

        trainer.patch()
    logger.info('gnmr: deepspeed.initialize now reads the config\'s "gnmr" block')


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    if _PATCHES:
        _PATCHES.restore()
        _WARNED_NO_BLOCK.clear()
        with contextlib.suppress(ImportError):
            from gnmr_dist.integrations.deepspeed import trainer

            trainer.unpatch()


@contextlib.contextmanager
def enabled() -> Any:
    """:func:`enable` for the duration of a ``with`` block (restored after, if it enabled)."""
    was = bool(_PATCHES)
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` plus GNMR, driven by the config's ``"gnmr"`` block."""
    ds_initialize = _deepspeed_initialize()
    params = dict(inspect.signature(ds_initialize).bind(*args, **kwargs).arguments)
    ds_config = load_ds_config(
        params.pop("config", None)
        or params.pop("config_params", None)
        or getattr(params.get("args"), "deepspeed_config", None)
    )
    block = GNMRBlock.of(ds_config.pop("gnmr", None))  # parsed once: a program's block passes
    params["config"] = ds_config  # DeepSpeed never sees the gnmr block
    if getattr(params.get("args"), "deepspeed_config", None):
        params["args"] = copy.copy(params["args"])  # the config now travels in config=
        params["args"].deepspeed_config = None
    if not block.enabled:
        if _PATCHES and not _WARNED_NO_BLOCK:
            _WARNED_NO_BLOCK.append(True)
            logger.warning(
                "gnmr: gnmr_dist.deepspeed.enable() is on, but this DeepSpeed config has no "
                'enabled "gnmr" block: the engine runs without GNMR'
            )
        return ds_initialize(**params)  # type: ignore[no-any-return]
    model = params.get("model")
    if model is None:
        raise ValueError("gnmr_dist.deepspeed.initialize needs a model")
    _check_supported(model, params.get("mpu"), ds_config)
    _check_probe(block, ds_config)
    backend = block.build_backend()
    check_error_source(block, backend)
    check_selection(
        model,
        granularity=block.units,
        include=block.include,
        exclude=block.exclude,
        operator_types=registered_operator_types(),
    )
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed()
    registry = _registry(model, block, backend)
    if block.probe is not None:
        block.probe.check_units(registry.num_units)
    engine, optimizer, loader, scheduler = ds_initialize(**params)
    engine.gnmr = DeepSpeedGNMR(engine, registry, backend, block)
    _BUILT[0] += 1
    return engine, optimizer, loader, scheduler


def _check_supported(model: Any, mpu: Any, ds_config: Mapping[str, Any]) -> None:
    """Refuse, before DeepSpeed starts, the set-ups whose gradients the monitor cannot read."""
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise NotImplementedError(
            "gnmr: DeepSpeed's pipeline engine (PipelineModule) is not supported; use ZeRO data "
            "parallelism, or megatron_patches for pipeline parallel training"
        )
    if mpu is not None and mpu.get_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "gnmr: DeepSpeed with a model-parallel mpu (tensor/pipeline parallel > 1) is not "
            "supported; use megatron_patches for tensor/pipeline parallel training"
        )
    zero = ds_config.get("zero_optimization", {}) or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    stage = int(zero.get("stage", 0) or 0)
    if offload not in (None, "none") and (offload != "cpu" or stage not in (1, 2)):
        raise NotImplementedError(
            f"gnmr: zero_optimization.offload_optimizer.device={offload!r} at ZeRO stage {stage} "
            "is not supported: GNMR reads offloaded gradients at stages 1-2 with device 'cpu' "
            "(the fp32 partition DeepSpeed copies them into); stage 3 and NVMe offload keep "
            "them in buffers it has not been checked against. Use stage 1-2 with 'cpu', or "
            "'none'"
        )


_FP16_NAMES = ("fp16", "float16", "half", "torch.float16")


def _check_probe(block: GNMRBlock, ds_config: Mapping[str, Any]) -> None:
    """Refuse, before DeepSpeed starts, the set-ups the recovery-gap probe cannot measure."""
    if block.probe is None:
        return
    zero = ds_config.get("zero_optimization", {}) or {}
    if zero.get("stage", 0) == 3:
        raise NotImplementedError(
            "gnmr.probe: ZeRO stage 3 partitions the parameters over the data-parallel ranks "
            "and gathers them only inside DeepSpeed's forward/backward hooks, so the probe's "
            "torch.autograd.grad passes cannot run on them; use ZeRO stage 0-2 or drop gnmr.probe"
        )
    autocast = ds_config.get("torch_autocast") or {}
    scaled = [key for key in ("fp16", "amp") if (ds_config.get(key) or {}).get("enabled")]
    if autocast.get("enabled") and str(autocast.get("dtype", "")).lower() in _FP16_NAMES:
        scaled.append("torch_autocast (dtype fp16)")
    if scaled:
        raise NotImplementedError(
            f"gnmr.probe with {scaled[0]}: the probe differentiates the unscaled loss, whose "
            "fp16 gradients underflow where the loss-scaled step's do not; train in bf16 or "
            "fp32, or drop gnmr.probe"
        )


def _registry(model: Any, block: GNMRBlock, backend: PrecisionBackend | None) -> UnitRegistry:
    """Units agreed over the world, wrapped with the backend (before DeepSpeed sees the model).

    Without a backend every unit stays eligible: the controller decides as if it could recover
    them (so a trace can be replayed to tune the policy), but no plan is ever applied.
    """
    registry = UnitRegistry.from_model(
        model,
        granularity=block.units,
        include=block.include,
        exclude=block.exclude,
        group=dist.group.WORLD,
        eligible_fn=backend.is_eligible if backend else None,
        operator_types=registered_operator_types(),
    )
    if backend is None:
        return registry
    backend.wrap(registry.local_modules)
    if not bool(registry.eligible.any()):
        raise ValueError(
            f"gnmr: the {block.backend!r} backend supports none of the {registry.num_units} units "
            f"(units={block.units!r}, include={list(block.include)}, exclude="
            f"{list(block.exclude)}); te_fp8 needs Transformer Engine modules, the others "
            "nn.Linear or megatron-core linears"
        )
    return registry
