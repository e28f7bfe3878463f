"""DeepSpeed integration: ``gnmr_dist.deepspeed.initialize`` reads the ``"gnmr"`` config block.

Same arguments and return value as ``deepspeed.initialize``. With a ``"gnmr"`` block (and
``"enabled"`` not false) it:

1. validates the block before anything else (unknown keys, values, backend options), and refuses
   the settings GNMR cannot run under (pipeline engine, ZeRO 3 offload; the probe's limits);
2. finds the model's units, agrees their ids over the world (one all-gather at start) and wraps
   them with the configured backend, before DeepSpeed builds its optimizer;
3. gives the engine a :class:`DeepSpeedGNMR` (``engine.gnmr``,
   :mod:`~gnmr_dist.integrations.deepspeed.session`), which hooks ``engine._take_model_step``:
   each rank's piece of every gradient (:mod:`~gnmr_dist.integrations.deepspeed.grads`), one
   all-reduce of the per-unit vector (with ``"gamma"``: the backend's error sums, scaled by
   ``1/dp`` as DeepSpeed averages the gradients, in the same vector; ``e = B / G``), the
   optimizer step, and, if it was applied, the controller's plan for the next step. A skipped
   step leaves the controller's history untouched. ``engine.forward`` enters the backend's step
   context and, with ``"probe"``, runs the recovery-gap probe first;
4. saves the controller state next to every DeepSpeed checkpoint (``<dir>/<tag>/gnmr_state.pt``,
   written atomically before DeepSpeed's own files and its ``latest`` tag) and restores it in
   ``load_checkpoint`` after its checksum and invariants are checked.

Without the block, or with ``"enabled": false``, the result is plain DeepSpeed. :func:`enable`
makes ``deepspeed.initialize`` itself do this (Hugging Face Trainer, accelerate). Details: the
step, the ZeRO stages, checkpoints and the probe's passes and limits in docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gnmr_dist.backends import PrecisionBackend, registered_operator_types
from gnmr_dist.distributed import UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock, check_block_name
from gnmr_dist.integrations.deepspeed.session import (
    STATE_FILE,
    DeepSpeedGNMR,
    probe_loss,
)
from gnmr_dist.integrations.deepspeed.trainer_log import with_gnmr_entries
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.session import (
    check_error_source,
)
from gnmr_dist.integrations.switch import Enabled, deprecated

__all__ = [
    "STATE_FILE",
    "DeepSpeedGNMR",
    "built_sessions",
    "disable",
    "enable",
    "enabled",
    "engines_with_gnmr",
    "initialize",
    "is_enabled",
    "load_ds_config",
    "no_block_warned",
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
"""What :func:`enable` replaced: ``deepspeed.initialize`` and ``transformers.Trainer.log``."""
_WARNED_NO_BLOCK: list[bool] = []
_BUILT = [0]
"""How many engines :func:`initialize` has given GNMR in this process (read by
:class:`~gnmr_dist.integrations.deepspeed.trainer.GNMRCallback`: an engine built without it is
warned of)."""
_SESSIONS: list[weakref.ref[DeepSpeedGNMR]] = []
"""The sessions :func:`initialize` built, in order (weakly: an engine dropped is gone)."""


def no_block_warned() -> None:
    """The caller (the Trainer callback) has warned that the config has no ``"gnmr"`` block:
    an engine built from it while enabled does not warn a second time."""
    if not _WARNED_NO_BLOCK:
        _WARNED_NO_BLOCK.append(True)


def engines_with_gnmr() -> int:
    """How many DeepSpeed engines this process has built with GNMR so far."""
    return _BUILT[0]


def built_sessions(since: int = 0) -> list[DeepSpeedGNMR]:
    """The GNMR sessions of the engines built after the first ``since`` (a count of
    :func:`engines_with_gnmr`) that are still alive."""
    alive = (ref() for ref in _SESSIONS[since:])
    return [s for s in alive if s is not None]


def _deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (never the patched one: no recursion)."""
    import deepspeed

    return _PATCHES.original(deepspeed, "initialize") or deepspeed.initialize


def enable() -> Enabled:
    """Make ``deepspeed.initialize`` itself read the ``"gnmr"`` block (idempotent); also a
    context manager: ``with enable():`` restores at the end of the block if this call enabled.

    For code that calls DeepSpeed on its own: Hugging Face ``Trainer`` and TRL trainers (through
    accelerate, which looks ``deepspeed.initialize`` up when it prepares the model) and plain
    ``accelerate`` with a DeepSpeed plugin. Call it once before the trainer or accelerator
    prepares the model; the block is read from the same DeepSpeed config they pass
    (``config_params``). While enabled, an engine built from a config without an enabled
    ``"gnmr"`` block logs that once, and ``transformers.Trainer.log`` adds GNMR's counts to
    Trainer's training logs (:mod:`gnmr_dist.integrations.deepspeed.trainer_log`). Both
    replacements are this function's; :func:`disable` restores both.
    """
    import deepspeed

    if _PATCHES:
        return Enabled(disable, owned=False)  # on already: a with-block leaves it on

    @functools.wraps(deepspeed.initialize)
    def gnmr_initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        return initialize(*args, **kwargs)

    # accelerate looks deepspeed.initialize up when it prepares the model: replace the
    # module attribute, so every caller that looks it up then gets GNMR's
    _PATCHES.set(deepspeed, "initialize", gnmr_initialize)
    with contextlib.suppress(ImportError):  # no transformers: nothing to log into
        from transformers import Trainer

        _PATCHES.set(Trainer, "log", with_gnmr_entries(Trainer.log))
    logger.info('gnmr: deepspeed.initialize now reads the config\'s "gnmr" block')
    return Enabled(disable, owned=True)


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    _PATCHES.restore()
    _WARNED_NO_BLOCK.clear()


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect in this process."""
    return bool(_PATCHES)


enabled = deprecated("gnmr_dist.deepspeed.enabled()", "gnmr_dist.deepspeed.enable()", enable)
"""Deprecated alias of :func:`enable` (which is a context manager itself), for one release."""


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` plus GNMR, driven by the config's ``"gnmr"`` block."""
    ds_initialize = _deepspeed_initialize()
    params = dict(inspect.signature(ds_initialize).bind(*args, **kwargs).arguments)
    ds_config = load_ds_config(
        params.pop("config", None)
        or params.pop("config_params", None)
        or getattr(params.get("args"), "deepspeed_config", None)
    )
    check_block_name(ds_config, "gnmr_dist.deepspeed.initialize: the DeepSpeed config")
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
    block.check_units(model)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed()
    registry = _registry(model, block, backend)
    if block.probe is not None:
        block.probe.check_units(registry.num_units)
    engine, optimizer, loader, scheduler = ds_initialize(**params)
    engine.gnmr = DeepSpeedGNMR(engine, registry, backend, block)
    _BUILT[0] += 1
    _SESSIONS.append(weakref.ref(engine.gnmr))
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
