"""GNMR as a torchtitan 0.3 model converter: one name in the converters list.

    config.model_spec = model_registry("8B", converters=[
        GNMRConverter.Config(gnmr={"backend": "torchao_fp8", "max_active": 4, "gamma": 0.03}),
    ])

torchtitan 0.3 has no ``ModelConverter`` / ``register_model_converter`` (0.2.x had them): a
converter is a ``ModelConfigConverter`` (``torchtitan/protocols/model.py``) whose
``convert(model_config)`` rewrites the config tree before the model is built. As torchtitan's LoRA
converter replaces configs by subclasses of their own classes, :meth:`GNMRConverter.convert`
returns the model's config as a subclass of its class (the same fields, so torchtitan sees the
model it expects) whose ``build`` attaches a :class:`TorchtitanSession`: the backend wraps the
units at build time (before ``parallelize_fn`` shards the model), a forward pre-hook applies the
plan at each step's first training forward, and torch's global optimizer step pre-hook takes the
decision (one all-reduce) once per step for the optimizer that holds the model: torchtitan's
``OptimizersContainer`` is a torch ``Optimizer``, and a converter, which sees only the config,
cannot reach it through ``ModelSpec.post_optimizer_build_fn``. GNMR thus sees the gradient after
torchtitan's clipping. Refused by name: an FP8 linear already in the config, pipeline, tensor,
expert or replicated data parallelism, and the block keys it does not run. Importable without
torchtitan (the converter then refuses to build). docs/backends.md#torchao_fp8.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.session import error_source

try:
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module

    TORCHTITAN_ERROR: ImportError | None = None
except ImportError as err:  # the module imports without torchtitan; the converter refuses
    TORCHTITAN_ERROR = err
    Module = None

    class ModelConfigConverter:  # type: ignore[no-redef]
        """Stand-in for torchtitan's base class where torchtitan does not import."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config:
            pass


__all__ = ["DEFAULT_INCLUDE", "GNMRConverter", "TorchtitanSession", "session_of"]

DEFAULT_INCLUDE = ("layers.*",)
"""The units when the block names none: every linear inside torchtitan's ``layers``."""

UNSUPPORTED_KEYS = ("probe", "log", "attribution", "on_missing_state", "on_corrupt_state")
"""``"gnmr"`` block keys the torchtitan integration does not run (refused by name)."""

FP8_OWNERS = ("Float8Linear", "MXFP8Linear", "NVFP4Linear")
"""torchtitan's quantized linear classes, whose configs a quantization converter leaves."""

_SESSIONS: weakref.WeakKeyDictionary[nn.Module, TorchtitanSession] = weakref.WeakKeyDictionary()


def session_of(model: nn.Module) -> TorchtitanSession | None:
    """The GNMR session attached to ``model`` when the converted config built it."""
    return _SESSIONS.get(model)


def parse_block(given: Mapping[str, Any]) -> GNMRBlock:
    """The converter's ``gnmr`` block parsed as every integration parses it, the keys this one
    does not run refused by name."""
    unsupported = [k for k in UNSUPPORTED_KEYS if k in given]
    if unsupported:
        raise ValueError(
            f"GNMRConverter: gnmr.{unsupported[0]} is not run by the torchtitan integration "
            f"(it runs the controller, the backend and the damage term); drop "
            f"{', '.join('gnmr.' + k for k in unsupported)}"
        )
    block = GNMRBlock.from_dict(dict(given), path="gnmr")
    if not block.enabled:
        raise ValueError("GNMRConverter: gnmr.enabled is false; drop the converter instead")
    return block


class GNMRConverter(ModelConfigConverter):  # type: ignore[misc]
    """torchtitan 0.3's converter of a model config into one whose model runs GNMR.

    ``Config(gnmr={...})`` takes the ``"gnmr"`` block of the DeepSpeed and Trainer integrations
    (docs/backends.md#torchao_fp8), checked when the converter is built."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):  # type: ignore[misc]
        gnmr: dict[str, Any] = dataclasses.field(default_factory=dict)
        """The ``"gnmr"`` block (``backend``, ``low_cost``, ``recovery``, ``max_active``,
        ``gamma``, ...)."""

    def __init__(self, config: GNMRConverter.Config) -> None:
        if TORCHTITAN_ERROR is not None:
            raise ImportError(
                f"GNMRConverter needs torchtitan 0.3 (import failed: {TORCHTITAN_ERROR}); "
                "install torchtitan==0.3.0 beside this package"
            ) from TORCHTITAN_ERROR
        self.config = config
        self.block = parse_block(config.gnmr)

    def convert(self, model_config: Any) -> Any:
        """``model_config`` as an instance of a subclass of its own class whose ``build``
        attaches GNMR to the model it builds (module docstring)."""
        converted = [
            fqn or "<root>"
            for fqn, cfg, _, _ in model_config.traverse(Module.Config, recurse=True)
            if getattr(type(cfg), "_owner", None) is not None
            and type(cfg)._owner.__name__ in FP8_OWNERS
        ]
        if converted:
            raise ValueError(
                f"GNMRConverter: {converted[0]} is already an FP8 linear (a quantization "
                "converter ran first); GNMR runs torchao's FP8 itself and switches it per step: "
                "remove Float8LinearConverter (or MXFP8/NVFP4) from the converters list"
            )
        cls = _gnmr_config_class(type(model_config), self.block)
        fields = dataclasses.fields(model_config)
        return cls(**{f.name: getattr(model_config, f.name) for f in fields if f.init})


def _gnmr_config_class(base: Any, block: GNMRBlock) -> type:
    """A subclass of the model config class ``base`` that builds the model with GNMR attached
    (a class per converter: a built config is copied with ``dataclasses.replace``, which keeps
    the class and drops anything set on the instance)."""

    def update_from_config(self: Any, *, config: Any, **kwargs: Any) -> None:
        check_parallelism(getattr(config, "parallelism", None))
        base.update_from_config(self, config=config, **kwargs)

    def build(self: Any, **kwargs: Any) -> Any:
        model = base.build(self, **kwargs)
        TorchtitanSession(model, block)
        return model

    body = {"update_from_config": update_from_config, "build": build}
    return type(f"GNMR{base.__name__}", (base,), body)


def check_parallelism(parallelism: Any) -> None:
    """Refuse, by name, the parallelisms this integration does not run (module docstring)."""
    if parallelism is None:
        return
    for key, why in (
        ("pipeline_parallel_degree", "the stages are built from the model after GNMR wrapped it"),
        ("tensor_parallel_degree", "the units' norms would need the tensor-parallel group"),
        ("expert_parallel_degree", "the experts are not GNMR units"),
        ("data_parallel_replicate_degree", "replicas would count each gradient once per replica"),
    ):
        degree = int(getattr(parallelism, key, 1))
        if degree > 1:
            raise ValueError(
                f"GNMRConverter: parallelism.{key}={degree} is not supported ({why}); run "
                "GNMR with FSDP over every rank (data_parallel_shard_degree) or drop the "
                "converter"
            )


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of ``p``'s gradient (a DTensor's local part under FSDP2)."""
    g = p.grad
    if g is None:
        return None
    to_local = getattr(g, "to_local", None)
    return g if to_local is None else to_local()


class TorchtitanSession:
    """GNMR attached to one model that a converted config built: the backend wrapped on the
    units at build time, a forward pre-hook that applies the plan, a global optimizer step
    pre-hook that takes the decision (module docstring). The runtime starts at the first
    forward, after torchtitan has sharded the model and built the optimizer."""

    def __init__(self, model: nn.Module, block: GNMRBlock) -> None:
        self.block = block
        self._model = weakref.ref(model)
        self.backend: PrecisionBackend | None = block.build_backend()
        self.runtime: GNMRRuntime | None = None
        self.step = 0
        """The optimizer step whose plan runs now (1 at the first training forward)."""
        self.decisions = 0
        """Decisions taken (one per optimizer step after a training forward)."""
        self._pending = True  # a decision was taken and its plan is not applied yet
        if self.backend is not None:
            with torch.device("cpu"):  # the registry's own index tensors, not the model's
                units = self._registry(model, None).local_modules
            self.backend.wrap(units)
        self._forward = model.register_forward_pre_hook(self._before_forward)
        me = weakref.ref(self)

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            session = me()
            if session is not None:
                session._before_optimizer_step(opt)

        self._optimizer = register_optimizer_step_pre_hook(hook)
        _SESSIONS[model] = self

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("GNMR's torchtitan session outlived its model")
        return model

    def _registry(self, model: nn.Module, group: Any) -> UnitRegistry:
        b = self.block
        include = b.include or DEFAULT_INCLUDE
        return UnitRegistry.from_model(
            model, granularity=b.units, include=include, exclude=b.exclude, group=group
        )

    def _start(self) -> GNMRRuntime:
        """The runtime, on the parameters as torchtitan left them (sharded, initialized)."""
        # FSDP2 shards each parameter over the world: the norms are reduced over it
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        registry = self._registry(self.model, group)
        b, backend = self.block, self.backend
        error_fn = error_source(b, backend, registry.num_units)
        self.runtime = GNMRRuntime(
            registry,
            b.policy,
            group=group,
            grad_fn=_local_grad,
            check_group=group,
            check_consistency=b.check_consistency,
            error_fn=error_fn,
            error_every=b.error_every,
            gemms=b.gemms,
        )
        return self.runtime

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """The plan of the next step, applied once, at its first training forward."""
        # built lazily, at the first forward: torchtitan shards and initializes the
        # parameters after the converters ran, so the units are read from the final ones
        runtime = self.runtime or self._start()
        # once per step, at its first training forward: evaluation forwards keep the plan
        if not (self._pending and module.training and torch.is_grad_enabled()):
            return
        self.step += 1
        self._pending = False
        if self.backend is not None:
            self.backend.apply(runtime.plan.active, self.step)

    def _owns(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` steps this model: torchtitan's container by its ``model_parts``, a
        plain optimizer by its parameters."""
        model = self.model
        parts = getattr(opt, "model_parts", None)
        # torchtitan's OptimizersContainer holds one optimizer per model part
        if parts is not None:
            return any(m is model for m in parts)
        mine = {id(p) for p in model.parameters()}
        return any(id(p) in mine for g in opt.param_groups for p in g["params"])

    def _before_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """The decision, once per step: the container's hook runs first, the inner optimizers'
        find it taken."""
        if self.runtime is None or self._pending or self._model() is None or not self._owns(opt):
            return
        self.runtime.step(lr=_lr(opt))
        self.decisions += 1
        self._pending = True

    def disable(self) -> None:
        """Remove the hooks and the backend's forwards (the verb every integration uses)."""
        self._forward.remove()
        self._optimizer.remove()
        if self.backend is not None:
            self.backend.unwrap()
        model = self._model()
        if model is not None:
            _SESSIONS.pop(model, None)

    def detach(self) -> None:
        """Deprecated name of :meth:`disable`, for one release."""
        warnings.warn(
            "TorchtitanSession.detach() is deprecated: call disable() (one verb pair, enable / "
            "disable, for every integration); the alias goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        self.disable()


def _lr(opt: torch.optim.Optimizer) -> float | None:
    """The learning rate of the first parameter group that has one (torchtitan's container
    holds one group without; its inner optimizers hold the real ones)."""
    inner: list[Any] = list(getattr(opt, "optimizers", ())) or [opt]
    for o in inner:
        for g in o.param_groups:
            if "lr" in g:
                lr = g["lr"]
                return float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    return None
