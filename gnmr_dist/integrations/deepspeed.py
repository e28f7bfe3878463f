"""DeepSpeed integration: ``gnmr_dist.deepspeed.initialize`` reads the ``"gnmr"`` config block.

Same arguments and return value as ``deepspeed.initialize``. With a ``"gnmr"`` block (and
``"enabled"`` not false) it:

1. validates the block before anything else (unknown keys, values, backend options);
2. finds the model's units, agrees their ids over the world (one all-gather at start) and wraps
   them with the configured backend, before DeepSpeed builds its optimizer;
3. hooks ``engine._take_model_step``, which DeepSpeed runs once per gradient-accumulation
   boundary after reducing the gradients: there it reads each rank's piece of every gradient
   where the ZeRO stage keeps it (:mod:`gnmr_dist.integrations.deepspeed_grads`), all-reduces the
   small per-unit vector once over the data-parallel group, lets the optimizer step, and, if the
   step was applied (no overflow skip), feeds the controller and applies its plan to the next
   step. A skipped step leaves the controller's history untouched;
4. enters the backend's step context around every forward (TE's FP8 region; no-op otherwise);
5. with ``"gamma"`` in the block (DESIGN.md section 2.1), turns on the backend's error sums and
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
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnmr_dist.backends import PrecisionBackend, registered_operator_types
from gnmr_dist.core import Decision
from gnmr_dist.distributed import GNMRRuntime, UnitNorms, UnitRegistry
from gnmr_dist.distributed.probe import ProbeResult, RecoveryProbe
from gnmr_dist.distributed.units import check_selection
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.deepspeed_grads import grad_piece_fn
from gnmr_dist.integrations.session import (
    IntegrationSession,
    check_error_source,
    error_source,
    open_trace,
    telemetry_scalars,
)
from gnmr_dist.integrations.state_file import read_state, restore_or_refuse, write_atomic
from gnmr_dist.telemetry import TraceWriter
from gnmr_dist.telemetry.selection import top_k
from gnmr_dist.telemetry.trace import ProbeRecord

__all__ = [
    "STATE_FILE",
    "DeepSpeedGNMR",
    "disable",
    "enable",
    "enabled",
    "initialize",
    "load_ds_config",
    "probe_loss",
]

logger = logging.getLogger(__name__)

STATE_FILE = "gnmr_state.pt"


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


_ORIGINAL_INITIALIZE: list[Any] = []
"""``deepspeed.initialize`` as DeepSpeed defines it, while :func:`enable` has replaced it."""
_WARNED_NO_BLOCK: list[bool] = []


def _deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (never the patched one: no recursion)."""
    import deepspeed

    return _ORIGINAL_INITIALIZE[0] if _ORIGINAL_INITIALIZE else deepspeed.initialize


def enable() -> None:
    """Make ``deepspeed.initialize`` itself read the ``"gnmr"`` block (idempotent).

    For code that calls DeepSpeed on its own: Hugging Face ``Trainer`` and TRL trainers (through
    accelerate, which looks ``deepspeed.initialize`` up when it prepares the model) and plain
    ``accelerate`` with a DeepSpeed plugin. Call it once before the trainer or accelerator
    prepares the model; the block is read from the same DeepSpeed config they pass
    (``config_params``). While enabled, an engine built from a config without an enabled
    ``"gnmr"`` block logs that once, and ``transformers.Trainer.log`` adds GNMR's counts to
    Trainer's training logs (:mod:`gnmr_dist.integrations.trainer`). :func:`disable` restores
    both.
    """
    import deepspeed

    if _ORIGINAL_INITIALIZE:
        return
    original = deepspeed.initialize
    _ORIGINAL_INITIALIZE.append(original)

    @functools.wraps(original)
    def gnmr_initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        return initialize(*args, **kwargs)

    deepspeed.initialize = gnmr_initialize
    with contextlib.suppress(ImportError):  # no transformers: nothing to log into
        from gnmr_dist.integrations import trainer

        trainer.patch()
    logger.info('gnmr: deepspeed.initialize now reads the config\'s "gnmr" block')


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled)."""
    import deepspeed

    if _ORIGINAL_INITIALIZE:
        deepspeed.initialize = _ORIGINAL_INITIALIZE.pop()
        _WARNED_NO_BLOCK.clear()
        with contextlib.suppress(ImportError):
            from gnmr_dist.integrations import trainer

            trainer.unpatch()


@contextlib.contextmanager
def enabled() -> Any:
    """:func:`enable` for the duration of a ``with`` block (restored after, if it enabled)."""
    was = bool(_ORIGINAL_INITIALIZE)
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
        if _ORIGINAL_INITIALIZE and not _WARNED_NO_BLOCK:
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


def probe_loss(output: Any) -> torch.Tensor:
    """The loss in a forward's ``output``: a scalar tensor, ``output.loss`` or ``output["loss"]``.

    Raises ``RuntimeError`` naming ``gnmr.probe``, what the forward returned and the fix.
    """
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = output if torch.is_tensor(output) else getattr(output, "loss", None)
    if torch.is_tensor(loss) and loss.numel() == 1 and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.reshape(())
    raise RuntimeError(
        f"gnmr.probe: the model's forward returned {_describe(output)}, not a loss. The probe "
        "differentiates the loss the forward returns: a scalar tensor, or an output with .loss "
        "or a mapping with 'loss' (a Hugging Face model given labels=). Return the loss from "
        "forward, or drop the gnmr.probe key"
    )


def _describe(output: Any) -> str:
    name = type(output).__name__
    if torch.is_tensor(output):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {name} with keys {list(output)} (no tensor 'loss')"
    if hasattr(output, "loss"):
        return f"a {name} with loss={type(output.loss).__name__}"
    return f"a {name}"


def _adam_state(engine: Any, registry: UnitRegistry) -> torch.optim.Optimizer | None:
    """``engine.optimizer`` when it is a torch Adam/AdamW whose state is keyed by the module's
    own parameters (ZeRO 0, fp32), so the probe can read ``exp_avg_sq``; else ``None``."""
    opt = engine.optimizer
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return None
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    return opt if all(id(p) in held for p in registry.params if p.requires_grad) else None


def _autocast(engine: Any) -> Any:
    """DeepSpeed's ``torch_autocast`` region of ``engine.forward`` (0.19)."""
    from deepspeed.runtime.torch_autocast import autocast_if_enabled

    return autocast_if_enabled(engine)


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


class DeepSpeedGNMR(IntegrationSession):
    """GNMR attached to a DeepSpeed engine (``engine.gnmr``)."""

    def __init__(
        self,
        engine: Any,
        registry: UnitRegistry,
        backend: PrecisionBackend | None,
        block: GNMRBlock,
    ) -> None:
        self.engine, self.registry, self.backend, self.block = engine, registry, backend, block
        dp = dist.get_world_size(engine.data_parallel_group)
        self.runtime = GNMRRuntime(
            registry,
            block.policy,
            group=engine.data_parallel_group,
            grad_fn=grad_piece_fn(engine),
            check_group=dist.group.WORLD,
            check_consistency=block.check_consistency,
            error_fn=error_source(block, backend, registry.num_units),
            error_scale=1.0 / dp,
            error_every=block.error_every,
        )
        self.skipped = 0
        self._trace: TraceWriter | None = None
        self._notes: dict[str, float] = {}
        self.probe: RecoveryProbe | None = None
        """The recovery-gap probe (``gnmr.probe``; ``None``: off)."""
        self.last_probe: ProbeRecord | None = None
        """The last probe step's measurements and graded sets (identical on every rank)."""
        self._dp = dp
        self._probe_due = False  # the next training forward opens a cycle whose plan is fresh
        self._measured: tuple[ProbeResult, float] | None = None
        adam = _adam_state(engine, registry)
        self._has_update_gap = adam is not None
        if block.probe is not None and backend is not None:
            self.probe = RecoveryProbe(registry, backend, adam, dp_group=engine.data_parallel_group)
        self._install_hooks()
        self._apply_plan()

    # ------------------------------------------------------------------ public view

    def note(self, **values: float) -> None:
        """Attach numbers (e.g. ``loss=...``) to the next decision's trace record."""
        self._notes.update({k: float(v) for k, v in values.items()})

    def telemetry(self) -> dict[str, float]:
        """The last decision's counts plus the global gradient norm and skipped steps."""
        d, n = self.runtime.last_decision, self.runtime.last_norms
        out = dict(d.telemetry.as_dict()) if d is not None else {}
        if n is not None:
            out["global_grad_norm"] = n.global_norm
        out["skipped_steps"] = float(self.skipped)
        return out

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        engine = self.engine
        take_step, forward = engine._take_model_step, engine.forward
        save, load = engine.save_checkpoint, engine.load_checkpoint

        def take_model_step(*args: Any, **kwargs: Any) -> Any:
            # local sums now (gradients final, not yet unscaled/clipped/consumed); the one
            # all-reduce runs while the optimizer steps
            finish = self.runtime.monitor.start(
                grad_scale=self._grad_scale(), with_errors=self.runtime.errors_due()
            )
            result = take_step(*args, **kwargs)
            self._after_step(finish())
            return result

        def gnmr_forward(*args: Any, **kwargs: Any) -> Any:
            self._maybe_probe(args, kwargs)
            if self.backend is None:
                return forward(*args, **kwargs)
            with self.backend.step_context():
                return forward(*args, **kwargs)

        engine._take_model_step = take_model_step
        engine.forward = gnmr_forward
        engine.save_checkpoint = lambda *a, **kw: self._save(save, *a, **kw)
        engine.load_checkpoint = lambda *a, **kw: self._load(load, *a, **kw)

    def _apply_plan(self) -> None:
        super()._apply_plan()
        self._probe_due = True  # a fresh plan: the next training forward opens the cycle

    def _maybe_probe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The probe, on a probe step's first training forward of the cycle, before it runs."""
        if self.probe is None or self.block.probe is None or not self._probe_due:
            return
        if not (self.engine.module.training and torch.is_grad_enabled()):
            return  # an evaluation forward: the cycle has not started
        self._probe_due = False
        if not self.block.probe.due(self.runtime.plan.step):
            return
        if self.backend is not None and self.backend.report().ran:
            super()._apply_plan()  # evaluation forwards ran since the plan: a fresh report
        t0 = time.perf_counter()
        result = self.probe.measure(lambda: self._probe_loss(args, kwargs))
        self._measured = (result, 1e3 * (time.perf_counter() - t0))

    def _probe_loss(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The forward as ``engine.forward`` runs it, its loss over the data-parallel size."""
        context = self.backend.step_context() if self.backend else contextlib.nullcontext()
        with context, _autocast(self.engine):
            output = self.engine.module(*args, **kwargs)
        return probe_loss(output) / self._dp

    def _take_probe(self, decision: Decision, ran: frozenset[int]) -> ProbeRecord | None:
        """This step's probe as a trace record (``ran``: the plan the step ran), or ``None``."""
        measured, self._measured = self._measured, None
        if measured is None or measured[0].step != decision.step or self.block.probe is None:
            return None
        r, ms = measured
        k = self.block.probe.k
        sets = {
            "risk_topk": top_k(decision.risk, k),
            "active": ran,
            "decided": frozenset(decision.active),
        }
        self.last_probe = ProbeRecord(
            step=decision.step,
            k=k,
            grad_gap=r.grad_gap,
            update_gap=r.update_gap if self._has_update_gap else None,
            grad_low_norm=r.grad_low_norm,
            grad_high_norm=r.grad_high_norm,
            loss_low=r.loss_low,
            loss_high=r.loss_high,
            sets=sets,
            probe_ms=ms,
        )
        return self.last_probe

    def _grad_scale(self) -> float:
        """The fp16 loss scale the gradients still carry at the hook (1 for fp32/bf16)."""
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)

    def _after_step(self, norms: UnitNorms) -> None:
        if not self.engine.was_step_applied():
            self.skipped += 1
            logger.warning(
                "gnmr: optimizer step skipped (overflow); controller history left untouched, "
                "plan kept: %s",
                sorted(self.runtime.plan.active),
            )
            self._measured = None  # the retried step is probed again, on its own batch
            self._apply_plan()
            return
        ran = self.runtime.plan.active
        decision = self.runtime.observe(norms)
        probe = self._take_probe(decision, ran)
        self._apply_plan()
        self._log(norms, decision, probe)

    # ------------------------------------------------------------------ logging

    def _log(self, norms: UnitNorms, decision: Decision, probe: ProbeRecord | None) -> None:
        if dist.get_rank() != 0:
            return
        trace = self._trace_writer()
        samples = int(self.engine.global_samples)  # DeepSpeed's own monitor axis
        extra = {
            "global_norm": norms.global_norm,
            "engine_step": int(self.engine.global_steps),
            "engine_samples": samples,
        }
        extra.update(self._notes)
        self._notes = {}
        if trace is not None:
            trace.write(norms.norms, decision, extra, probe=probe)
        monitor = getattr(self.engine, "monitor", None)
        log = self.block.log
        if decision.step % log.every:
            return
        _console(decision, norms, self.registry.names, samples)
        if log.monitor and monitor is not None and monitor.enabled:
            tele = telemetry_scalars(decision, norms.global_norm)
            monitor.write_events([(f"gnmr/{k}", v, samples) for k, v in tele.items()])

    def _trace_writer(self) -> TraceWriter | None:
        if self._trace is None:
            done = self.runtime.controller.step_count - 1  # decided before this run's first record
            self._trace = open_trace(self.block, self.registry, done)
        return self._trace

    # ------------------------------------------------------------------ checkpoints

    def _save(self, save: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Write the GNMR state atomically into the tag's directory, then let DeepSpeed write
        its files and its ``latest`` tag: a kill at any instant leaves ``latest`` naming a
        checkpoint whose GNMR state is complete (module docstring, item 6)."""
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        path = Path(save_dir, tag, STATE_FILE)
        failed: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                write_atomic(self.state_dict(), path)
            except OSError as err:  # a full disk, a read-only mount: every rank stops with it
                failed[0] = f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(failed, src=0)
        if failed[0] is not None:
            raise OSError(f"gnmr: cannot write {path} ({failed[0]}); the checkpoint was not saved")
        return save(save_dir, tag, *args, **kwargs)

    def _load(self, load: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = tag if tag is not None else _latest_tag(load_dir)
        result = load(load_dir, tag, *args, **kwargs)
        if result[0] is None:
            return result  # DeepSpeed found nothing to load and said so
        self._restore(Path(load_dir, str(tag), STATE_FILE))
        return result

    def _restore(self, path: Path) -> None:
        """Rank 0 reads the state and hands it to every rank, so all ranks restore the same."""
        found: list[Any] = [read_state(path) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if restore_or_refuse(self.block, str(path), found[0], self):
            logger.info(
                "gnmr: restored controller at step %d from %s",
                self.runtime.controller.step_count,
                path,
            )


def console_logger() -> logging.Logger:
    """``gnmr_dist.console``: the per-step line. Like DeepSpeed's own logger it prints to stdout
    by itself (INFO, ``[gnmr]`` prefix) when the program has configured no logging; once the
    root logger has a handler it propagates there instead, under the program's settings."""
    log = logging.getLogger("gnmr_dist.console")
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[gnmr] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def _console(decision: Decision, norms: UnitNorms, names: Sequence[str], samples: int) -> None:
    """One line per logged decision (rank 0 calls it), in any DeepSpeed script."""
    t = decision.telemetry
    console_logger().info(
        "gnmr | step %d | samples %d | exceed %d | active %d %s | max risk %.3g | grad norm %.4g",
        decision.step,
        samples,
        t.num_exceed,
        len(decision.active),
        [names[u] for u in decision.active],
        t.max_risk,
        norms.global_norm,
    )


def _latest_tag(load_dir: str) -> str | None:
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()
