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
   the same way); the controller gets ``e = B / n``. A backend that reports none (``te_fp8``)
   or no backend is refused with ``"gamma"`` set, before DeepSpeed starts;
6. saves the controller state next to every DeepSpeed checkpoint (``<dir>/<tag>/gnmr_state.pt``,
   plain tensors) and restores it in ``load_checkpoint`` with ``torch.load(weights_only=True)``.

``engine.gnmr`` is the :class:`DeepSpeedGNMR` runtime (controller, registry, backend, last
decision, telemetry). Without the block, or with ``"enabled": false``, the result is plain
DeepSpeed.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnmr_dist.backends import PrecisionBackend, get_backend
from gnmr_dist.core import Decision
from gnmr_dist.distributed import GNMRRuntime, UnitNorms, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.deepspeed_grads import grad_piece_fn
from gnmr_dist.integrations.session import IntegrationSession, check_error_source, error_source
from gnmr_dist.telemetry import TraceHeader, TraceWriter

__all__ = ["STATE_FILE", "DeepSpeedGNMR", "initialize", "load_ds_config"]

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


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` plus GNMR, driven by the config's ``"gnmr"`` block."""
    import deepspeed

    params = dict(inspect.signature(deepspeed.initialize).bind(*args, **kwargs).arguments)
    ds_config = load_ds_config(
        params.pop("config", None) or params.pop("config_params", None)
        or getattr(params.get("args"), "deepspeed_config", None)
    )  # fmt: skip
    block = GNMRBlock.from_dict(ds_config.pop("gnmr", None))
    params["config"] = ds_config  # DeepSpeed never sees the gnmr block
    if getattr(params.get("args"), "deepspeed_config", None):
        params["args"] = copy.copy(params["args"])  # the config now travels in config=
        params["args"].deepspeed_config = None
    if not block.enabled:
        return deepspeed.initialize(**params)  # type: ignore[no-any-return]
    model = params.get("model")
    if model is None:
        raise ValueError("gnmr_dist.deepspeed.initialize needs a model")
    _check_supported(model, params.get("mpu"), ds_config)
    backend = _build_backend(block)
    check_error_source(block, backend)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    registry = _registry(model, block, backend)
    engine, optimizer, loader, scheduler = deepspeed.initialize(**params)
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
    if offload not in (None, "none"):
        raise NotImplementedError(
            f"gnmr: zero_optimization.offload_optimizer.device={offload!r} keeps gradients in "
            "offload buffers the monitor does not read; set it to 'none' or disable the gnmr block"
        )


def _build_backend(block: GNMRBlock) -> PrecisionBackend | None:
    if block.backend is None:
        return None
    return get_backend(block.backend, low_cost=block.low_cost, recovery=block.recovery)


def _registry(model: Any, block: GNMRBlock, backend: PrecisionBackend | None) -> UnitRegistry:
    """Units agreed over the world, wrapped with the backend (before DeepSpeed sees the model).

    Without a backend every unit stays eligible: the controller decides as if it could recover
    them (so a trace can be replayed to tune the policy), but no plan is ever applied.
    """
    registry = UnitRegistry.from_model(
        model, granularity=block.units, include=block.include, exclude=block.exclude,
        group=dist.group.WORLD, eligible_fn=backend.is_eligible if backend else None,
    )  # fmt: skip
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
            registry, block.policy, group=engine.data_parallel_group,
            grad_fn=grad_piece_fn(engine), check_group=dist.group.WORLD,
            check_consistency=block.check_consistency,
            error_fn=error_source(block, backend, registry.num_units), error_scale=1.0 / dp,
        )  # fmt: skip
        self.skipped = 0
        self._trace: TraceWriter | None = None
        self._notes: dict[str, float] = {}
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
            finish = self.runtime.monitor.start(grad_scale=self._grad_scale())
            result = take_step(*args, **kwargs)
            self._after_step(finish())
            return result

        def gnmr_forward(*args: Any, **kwargs: Any) -> Any:
            if self.backend is None:
                return forward(*args, **kwargs)
            with self.backend.step_context():
                return forward(*args, **kwargs)

        engine._take_model_step = take_model_step
        engine.forward = gnmr_forward
        engine.save_checkpoint = lambda *a, **kw: self._save(save, *a, **kw)
        engine.load_checkpoint = lambda *a, **kw: self._load(load, *a, **kw)

    def _grad_scale(self) -> float:
        """The fp16 loss scale the gradients still carry at the hook (1 for fp32/bf16)."""
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)

    def _after_step(self, norms: UnitNorms) -> None:
        if not self.engine.was_step_applied():
            self.skipped += 1
            logger.warning(
                "gnmr: optimizer step skipped (overflow); controller history left untouched, "
                "plan kept: %s", sorted(self.runtime.plan.active),
            )  # fmt: skip
            self._apply_plan()
            return
        decision = self.runtime.observe(norms)
        self._apply_plan()
        self._log(norms, decision)

    # ------------------------------------------------------------------ logging

    def _log(self, norms: UnitNorms, decision: Decision) -> None:
        if dist.get_rank() != 0:
            return
        trace = self._trace_writer()
        extra = {"global_norm": norms.global_norm, "engine_step": int(self.engine.global_steps)}
        extra.update(self._notes)
        self._notes = {}
        if trace is not None:
            trace.write(norms.norms, decision, extra)
        monitor = getattr(self.engine, "monitor", None)
        log = self.block.log
        if (
            log.monitor
            and monitor is not None
            and monitor.enabled
            and decision.step % log.every == 0
        ):
            tele = {**decision.telemetry.as_dict(), "global_grad_norm": norms.global_norm}
            monitor.write_events([(f"gnmr/{k}", float(v), decision.step) for k, v in tele.items()])

    def _trace_writer(self) -> TraceWriter | None:
        if self.block.log.trace is None:
            return None
        if self._trace is None:
            header = TraceHeader(
                self.registry.names, tuple(self.registry.eligible.tolist()), self.block.policy,
                {"backend": self.block.backend, "units": self.block.units},
            )  # fmt: skip
            done = self.runtime.controller.step_count - 1  # decided before this run's first record
            self._trace = TraceWriter(self.block.log.trace, header, resume_after=done or None)
        return self._trace

    # ------------------------------------------------------------------ checkpoints

    def _save(self, save: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        result = save(save_dir, tag, *args, **kwargs)
        if dist.get_rank() == 0:
            path = Path(save_dir, tag, STATE_FILE)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.state_dict(), path)
        dist.barrier()
        return result

    def _load(self, load: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = tag if tag is not None else _latest_tag(load_dir)
        result = load(load_dir, tag, *args, **kwargs)
        if result[0] is None:
            return result  # DeepSpeed found nothing to load and said so
        self._restore(Path(load_dir, str(tag), STATE_FILE))
        return result

    def _restore(self, path: Path) -> None:
        """Rank 0 reads the state and hands it to every rank, so all ranks restore the same."""
        found: list[Any] = [_read_state(path) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        kind, payload = found[0]
        if kind == "missing":
            if self.block.on_missing_state == "fresh":
                logger.warning("gnmr: %s not found; starting the controller fresh "
                               "(on_missing_state='fresh')", path)  # fmt: skip
                return
            raise FileNotFoundError(
                f"gnmr: the checkpoint has no GNMR state ({path}). Resuming without it would "
                'silently reset the controller; set "on_missing_state": "fresh" in the gnmr '
                "block to start it fresh on purpose."
            )
        if kind == "corrupted":
            raise ValueError(f"gnmr: {path} is corrupted or not a GNMR state: {payload}")
        try:
            self.load_state_dict(payload)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"gnmr: cannot restore {path}: {err}") from err
        logger.info("gnmr: restored controller at step %d from %s",
                    self.runtime.controller.step_count, path)  # fmt: skip


def _read_state(path: Path) -> tuple[str, Any]:
    """``("ok", state)``, ``("missing", None)`` or ``("corrupted", reason)``."""
    if not path.is_file():
        return "missing", None
    try:
        return "ok", torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is reported the same way, with its reason
        return "corrupted", str(err)


def _latest_tag(load_dir: str) -> str | None:
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()
