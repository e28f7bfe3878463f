"""Opt-in CPU compatibility for megatron-core, for tests and CPU-only hosts.

megatron-core assumes a GPU. On a host without CUDA the code paths that tests need (building a
``GPTModel`` from the local layer spec, tensor and pipeline parallelism over gloo, the
``get_forward_backward_func()`` schedules, megatron's ``DistributedDataParallel`` and the
fp32 grad-norm / clipping helpers) fail on a handful of hard-wired CUDA calls. This module
redirects exactly those, reversibly, and refuses to do anything when CUDA is available: it is
never active on a GPU.

What is patched, and why (megatron-core 0.16.x):

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``. Megatron calls it at run time
  (``device=torch.cuda.current_device()``) for the attention scratch buffer
  (``utils.GlobalMemoryBuffer``), the pipeline receive buffers (``p2p_communication``) and the
  DDP grad buffers (``distributed.param_and_grad_buffer``). Megatron resolves it through the
  ``torch.cuda`` module at every call, so this is the one place to patch. Without CUDA the
  original can only raise, so replacing it changes nothing that worked before.
* ``torch.cuda.synchronize`` -> no-op. ``p2p_communication`` calls it after batched
  send/recv (``batch_p2p_sync``); CPU ops are synchronous, and without CUDA the original
  can only raise.
* The CUDA RNG in ``tensor_parallel.random``: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
  read and write the CPU default generator; ``CudaRNGStatesTracker.add`` seeds its named states
  on a private CPU generator, and ``CudaRNGStatesTracker.fork`` swaps them in and out of the CPU
  default generator; ``model_parallel_cuda_manual_seed`` (also re-exported by
  ``tensor_parallel``) runs the original and then seeds the CPU default generator with the
  data-parallel seed. Dropout on CPU tensors draws from the CPU default generator, so this is
  the generator the tracker must fork. Consequence: unlike on a GPU,
  ``model_parallel_cuda_manual_seed(seed)`` also reseeds ``torch``'s CPU generator, and the
  tracker's "CPU RNG state changed within GPU RNG context" check is dropped (the CPU generator
  *is* the forked one here).
* The name ``torch`` inside four megatron modules -> a stand-in module that forwards every
  attribute to ``torch`` except the factories ``empty/full/ones/tensor/zeros``, which turn
  ``device="cuda"`` into the CPU. ``pipeline_parallel.schedules`` creates ``total_num_tokens``
  with ``device="cuda"``; ``transformer.utils.get_default_causal_mask`` builds the attention
  mask that way; ``optimizer.clip_grads`` (``get_grad_norm_fp32``, ``count_zeros_fp32``) and
  ``optimizer.optimizer`` (``FP32Optimizer``'s loss scale) create their scalars that way. These
  are literals inside function bodies, so the module's ``torch`` name is the narrowest hook that
  keeps megatron's own function bodies running.
* ``optimizer.clip_grads.{multi_tensor_applier, l2_norm_impl, multi_tensor_scale_impl}`` -> CPU
  versions built on ``torch._foreach_norm`` / ``torch._foreach_mul_``. The apex/TE kernels do
  not exist on CPU, and megatron's own fallback (``utils.local_multi_tensor_l2_norm``) builds
  its result with ``device="cuda"``.
* ``clip_grads.clip_grad_by_total_norm_fp32`` (and the name ``optimizer.optimizer`` imported)
  -> a CPU twin: the original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
* ``LanguageModule.setup_embeddings_and_output_layer`` -> the original, run with
  ``torch.Tensor.cuda`` made the identity for its duration: with tied embeddings and pipeline
  parallelism it moves the shared weight with ``weight.data.cuda()`` before all-reducing it over
  the embedding group.

Not patched (not needed on the paths above, so unverified on CPU): ``tensor_parallel.data.
broadcast_data``, ``torch.autocast("cuda")`` in the schedules (only with
``config.enable_autocast``), the fp16/bf16 ``MixedPrecisionOptimizer`` (checks
``'torch.cuda.HalfTensor'`` type strings), the distributed optimizer, sequence parallelism (needs
TE/apex norms), CUDA graphs, FSDP, the inference engines, the NCCL allocator, Transformer Engine.

The patches are process-wide while enabled (module attributes, not thread- or scope-local).

``cpu_transformer_config(**fields)`` builds a ``TransformerConfig`` for which
``GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), ...)`` builds and trains on
CPU in fp32: CPU initialisation and every fused kernel off.

Megatron is imported lazily, inside the functions: importing this module needs torch only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

__all__ = [
    "SUPPORTED_MEGATRON_VERSIONS",
    "cpu_compat",
    "cpu_transformer_config",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
]

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSIONS: tuple[str, ...] = ("0.16",)
"""megatron-core ``major.minor`` series whose sources these patches were checked against."""

_MISSING = object()
_LOCK = threading.Lock()


class _Patch(NamedTuple):
    owner: Any
    name: str
    original: Any


_APPLIED: list[_Patch] = []


# --------------------------------------------------------------------------- device redirects


def _cpu_current_device() -> torch.device:
    """CPU stand-in for ``torch.cuda.current_device``: the current device is the CPU."""
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """CPU stand-in for ``torch.cuda.synchronize``: CPU ops are already synchronous."""


def _cpu_device_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return ``kwargs`` with a CUDA ``device`` (``"cuda"``, ``"cuda:N"``, an index) set to CPU."""
    device = kwargs.get("device")
    if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    return kwargs


_FACTORIES = frozenset({"empty", "full", "ones", "tensor", "zeros"})


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by one megatron module: its factories turn ``device='cuda'`` into CPU."""

    def __init__(self) -> None:
        super().__init__("torch", "torch, with CUDA tensor creation redirected to the CPU")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr
        return lambda *args, **kwargs: attr(*args, **_cpu_device_kwargs(kwargs))


# --------------------------------------------------------------------------- RNG


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """CPU stand-in for ``random._get_cuda_rng_state``: the CPU default generator's state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``random._set_cuda_rng_state``: set the CPU default generator."""
    torch.set_rng_state(new_state)


_MODEL_PARALLEL_RNG = "model-parallel-rng"  # random._MODEL_PARALLEL_RNG_TRACKER_NAME


def _cpu_tracker_add(self: Any, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on CPU: the named state is a fresh CPU generator's state."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self: Any, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
    """``CudaRNGStatesTracker.fork`` on CPU: swap the named state into the CPU generator."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state, orig_name = torch.get_rng_state(), self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(
                f"current state name {self._current_state_name} is not the same as the desired "
                f"state name {name}."
            )
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """Within the block, ``Tensor.cuda()`` returns the tensor itself (it can only raise here)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _cpu_setup_embeddings(original: Any) -> Any:
    """Run ``LanguageModule.setup_embeddings_and_output_layer`` with ``Tensor.cuda`` a no-op."""

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensor_cuda_is_identity():
            original(self)

    return setup_embeddings_and_output_layer


def _cpu_manual_seed(original: Any) -> Any:
    """Wrap ``model_parallel_cuda_manual_seed``: also seed the CPU generator (the default state)."""

    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        original(seed, *args, **kwargs)
        torch.default_generator.manual_seed(seed)  # data-parallel ("default") state = `seed`

    return model_parallel_cuda_manual_seed


# --------------------------------------------------------------------------- grad norm / clip


def _cpu_multi_tensor_applier(op: Any, noop_flag: Any, tensor_lists: Any, *args: Any) -> Any:
    """CPU stand-in for apex's ``multi_tensor_applier``: call ``op`` on the whole lists."""
    return op(2048 * 32, noop_flag, tensor_lists, *args)


def _cpu_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU ``multi_tensor_l2norm``: ``(tensor([global L2 norm]), per-tensor norms or None)``."""
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]], 2.0)
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def _cpu_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: float) -> None:
    """CPU ``multi_tensor_scale``: ``dst = src * scale`` for each pair of tensors."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _cpu_clip_grad_by_total_norm(original: Any) -> Any:
    """CPU twin of ``clip_grad_by_total_norm_fp32`` (the original asserts CUDA float grads)."""
    from megatron.core.utils import to_local_if_dtensor

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        present = [g for g in (getattr(p, attr, None) for p in parameters) if g is not None]
        grads = [to_local_if_dtensor(g).detach() for g in present]
        if any(g.dtype not in (torch.float32, torch.bfloat16) for g in grads):
            raise TypeError("clip_grad_by_total_norm_fp32 expects fp32 (or bf16) gradients")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    return clip_grad_by_total_norm_fp32


# --------------------------------------------------------------------------- patch plan


def _megatron_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def _check_version(version: str) -> None:
    """Raise unless ``version`` belongs to a series listed in ``SUPPORTED_MEGATRON_VERSIONS``."""
    series = ".".join(version.split(".")[:2])
    if series not in SUPPORTED_MEGATRON_VERSIONS:
        raise RuntimeError(
            f"megatron_patches.cpu was checked against megatron-core "
            f"{', '.join(v + '.x' for v in SUPPORTED_MEGATRON_VERSIONS)}; found {version}. "
            f"Verify the patched call sites against its sources, then add {series!r} to "
            f"SUPPORTED_MEGATRON_VERSIONS."
        )


def _patch_plan() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for every patch, in application order."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as transformer_utils

    cpu_torch = _CpuTorch()
    seed = _cpu_manual_seed(mrandom.model_parallel_cuda_manual_seed)
    clip = _cpu_clip_grad_by_total_norm(clip_grads.clip_grad_by_total_norm_fp32)
    setup = _cpu_setup_embeddings(LanguageModule.setup_embeddings_and_output_layer)
    return [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        (mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add),
        (mrandom.CudaRNGStatesTracker, "fork", _cpu_tracker_fork),
        (mrandom, "model_parallel_cuda_manual_seed", seed),
        (tensor_parallel, "model_parallel_cuda_manual_seed", seed),
        (schedules, "torch", cpu_torch),
        (transformer_utils, "torch", cpu_torch),
        (clip_grads, "torch", cpu_torch),
        (mcore_optimizer, "torch", cpu_torch),
        (clip_grads, "multi_tensor_applier", _cpu_multi_tensor_applier),
        (clip_grads, "l2_norm_impl", _cpu_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", _cpu_scale),
        (clip_grads, "clip_grad_by_total_norm_fp32", clip),
        (mcore_optimizer, "clip_grad_by_total_norm_fp32", clip),
        (LanguageModule, "setup_embeddings_and_output_layer", setup),
    ]


def _apply(owner: Any, name: str, replacement: Any) -> None:
    _APPLIED.append(_Patch(owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, replacement)
    logger.debug("cpu compat: patched %s.%s", getattr(owner, "__name__", owner), name)


def _restore_all() -> None:
    while _APPLIED:
        patch = _APPLIED.pop()
        if patch.original is _MISSING:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)


# --------------------------------------------------------------------------- public API


def is_cpu_compat_enabled() -> bool:
    """Whether the CPU patches are currently applied."""
    return bool(_APPLIED)


def enable_cpu_compat() -> None:
    """Apply the CPU patches to megatron-core (idempotent).

    Raises:
        RuntimeError: CUDA is available (this module is never active on a GPU), or the
            installed megatron-core is not in ``SUPPORTED_MEGATRON_VERSIONS``.
        ImportError: megatron-core is not installed.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_patches.cpu is never active on a GPU: torch.cuda.is_available() is True. "
            "Run megatron-core natively on CUDA instead."
        )
    with _LOCK:
        if _APPLIED:
            return
        version = _megatron_version()
        _check_version(version)
        try:
            for owner, name, replacement in _patch_plan():
                _apply(owner, name, replacement)
        except BaseException:
            _restore_all()
            raise
        logger.info("cpu compat enabled for megatron-core %s (%d patches)", version, len(_APPLIED))


def disable_cpu_compat() -> None:
    """Restore every patched attribute to its original object (no-op when not enabled)."""
    with _LOCK:
        if _APPLIED:
            _restore_all()
            logger.info("cpu compat disabled")


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Context manager: enable the CPU patches; on exit, disable them if this call enabled them."""
    was_enabled = is_cpu_compat_enabled()
    enable_cpu_compat()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_compat()


# --------------------------------------------------------------------------- config


_CPU_REQUIRED: dict[str, Any] = {
    "use_cpu_initialization": True,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "memory_efficient_layer_norm": False,
    "cross_entropy_loss_fusion": False,
    "tp_comm_overlap": False,
}
"""Fields a CPU run cannot change: each selects a CUDA-only kernel or GPU initialisation."""

_CPU_DEFAULTS: dict[str, Any] = {
    "params_dtype": torch.float32,
    "pipeline_dtype": torch.float32,
}
"""Fields a caller may override (bf16 also needs megatron's ``Float16Module``)."""


def cpu_transformer_config(**fields: Any) -> Any:
    """A megatron ``TransformerConfig`` that builds and trains on CPU.

    ``fields`` are ``TransformerConfig`` fields (``num_layers``, ``hidden_size``,
    ``num_attention_heads`` are required by megatron). The CPU-required settings in
    ``_CPU_REQUIRED`` are filled in; passing one of them with another value raises
    ``ValueError``. ``params_dtype`` and ``pipeline_dtype`` default to fp32.

    Pass ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` equal to the sizes given
    to ``parallel_state.initialize_model_parallel``: megatron reads the number of layers per
    pipeline stage from the config, so a stale ``pipeline_model_parallel_size=1`` silently builds
    every layer on every stage.
    """
    from megatron.core.transformer import TransformerConfig

    for key, value in fields.items():
        if key in _CPU_REQUIRED and value != _CPU_REQUIRED[key]:
            raise ValueError(
                f"cpu_transformer_config: {key}={value!r} is not supported on CPU "
                f"(must be {_CPU_REQUIRED[key]!r})"
            )
    return TransformerConfig(**{**_CPU_DEFAULTS, **fields, **_CPU_REQUIRED})
