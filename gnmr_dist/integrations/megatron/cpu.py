"""Opt-in CPU compatibility for megatron-core, for tests and CPU-only hosts.

megatron-core assumes a GPU. On a host without CUDA the code paths that tests need (building a
``GPTModel`` from the local layer spec, tensor, sequence, pipeline and interleaved (virtual)
pipeline parallelism over gloo, the ``get_forward_backward_func()`` schedules, megatron's
``DistributedDataParallel`` with fp32 or bf16 grad buffers, ``get_megatron_optimizer`` with the
plain, the bf16 (``Float16OptimizerWithFloat16Params``) and the distributed optimizer, and the
fp32 grad-norm / clipping helpers) fail on a handful of hard-wired CUDA calls. This module
redirects exactly those, reversibly, and refuses to do anything when CUDA is available: it is
never active on a GPU.

Checked against megatron-core 0.16.1, 0.17.1 and 0.19.2 (the version table,
:data:`megatron_patches.versions.SERIES`; ``SUPPORTED_MEGATRON_VERSIONS`` is its keys). What
is patched, and why:

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``. Megatron calls it at run time
  (``device=torch.cuda.current_device()``) for the attention scratch buffer
  (``utils.GlobalMemoryBuffer``), the pipeline receive buffers (``p2p_communication``) and the
  DDP grad buffers (``distributed.param_and_grad_buffer``). Megatron resolves it through the
  ``torch.cuda`` module at every call, so this is the one place to patch. Without CUDA the
  original can only raise, so replacing it changes nothing that worked before.
* ``torch.cuda.synchronize`` -> no-op. ``p2p_communication`` calls it after batched
  send/recv (``batch_p2p_sync``); CPU ops are synchronous, and without CUDA the original
  can only raise.
* Where the table says ``grad_sync_current_stream`` (0.19): ``torch.cuda.current_stream`` -> a
  stream stand-in whose waits are no-ops. 0.19's ``start_grad_sync`` fetches the current stream
  on every grad sync, to wait for CUDA-graph weight-gradient events; without CUDA the original
  can only raise.
* The CUDA RNG in ``tensor_parallel.random``: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
  read and write the CPU default generator; ``CudaRNGStatesTracker.add`` seeds its named states
  on a private CPU generator, and ``CudaRNGStatesTracker.fork`` swaps them in and out of the CPU
  default generator; ``model_parallel_cuda_manual_seed`` (also re-exported by
  ``tensor_parallel``) runs the original and then seeds the CUDA stream with the data-parallel
  seed. Dropout on CPU tensors draws from the CPU default generator, so this is the generator
  the tracker must fork, and with megatron-core alone the CUDA stream *is* the CPU generator
  (:class:`CudaRng`): ``model_parallel_cuda_manual_seed(seed)`` also reseeds ``torch``'s CPU
  generator, and the tracker's "CPU RNG state changed within GPU RNG context" check is dropped.
  Megatron-LM's loop keeps the two streams apart, as on a GPU
  (:mod:`megatron_patches.cpu_training`).
* The name ``torch`` inside four megatron modules -> a stand-in module that forwards every
  attribute to ``torch`` except the factories ``empty/full/ones/tensor/zeros``, which turn
  ``device="cuda"`` into the CPU. ``pipeline_parallel.schedules`` creates ``total_num_tokens``
  with ``device="cuda"``; ``transformer.utils.get_default_causal_mask`` builds the attention
  mask that way; ``optimizer.clip_grads`` (``get_grad_norm_fp32``, ``count_zeros_fp32``) and
  ``optimizer.optimizer`` (``MixedPrecisionOptimizer``'s ``found_inf`` / unit loss scale,
  ``FP32Optimizer``'s loss scale, and from 0.19 ``has_grad_norm_group``'s flag) create their
  scalars that way. These are literals inside function bodies, so the module's ``torch`` name
  is the narrowest hook that keeps megatron's own function bodies running.
* ``optimizer.clip_grads.{multi_tensor_applier, l2_norm_impl, multi_tensor_scale_impl}`` -> CPU
  versions built on ``torch._foreach_norm`` / ``torch._foreach_mul_``. The apex/TE kernels do
  not exist on CPU, and megatron's own fallback (``utils.local_multi_tensor_l2_norm``) builds
  its result with ``device="cuda"``. (0.17+ also has ``multi_tensor_scale_tensor_impl``; it is
  None without TE, and megatron then returns the norm as a float, as 0.16 does.)
* ``clip_grads.clip_grad_by_total_norm_fp32`` (and the name ``optimizer.optimizer`` imported)
  -> a CPU twin: the original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
* ``LanguageModule.setup_embeddings_and_output_layer`` -> the original, run with
  ``torch.Tensor.cuda`` made the identity for its duration: with tied embeddings and pipeline
  parallelism it moves the shared weight with ``weight.data.cuda()`` before all-reducing it over
  the embedding group.
* ``Float16OptimizerWithFloat16Params.__init__`` and ``DistributedOptimizer.__init__`` -> the
  originals, run with ``Tensor.type()`` (no argument) reporting a CPU tensor's CUDA twin type
  (``torch.BFloat16Tensor`` reads ``torch.cuda.BFloat16Tensor``) for their duration: both sort
  parameters into fp16/bf16 and fp32 groups by comparing ``param.type()`` with the CUDA type
  strings and raise ``TypeError`` for anything else.
* ``transformer.torch_norm.WrappedTorchNorm.__new__`` -> the original, plus sequence
  parallelism: it builds the same ``torch.nn.LayerNorm``/``RMSNorm`` and marks its parameters
  ``sequence_parallel=config.sequence_parallel``, as apex's ``FusedLayerNorm`` and TE's norms
  do. The original asserts ``not config.sequence_parallel`` because unmarked norm weights would
  keep the partial gradients of their TP rank's sequence slice; marked, ``finalize_model_grads``
  all-reduces them over TP (``_allreduce_non_tensor_model_parallel_grads``). It is the only norm
  of the local layer spec without TE or apex (also the final norm and ``qk_layernorm``).
* ``DistributedOptimizer.{sharded_state_dict, load_state_dict,
  _set_main_param_and_optimizer_states}`` -> the originals, with what megatron's non-TE path
  (torch Adam) lacks for ``dist_checkpointing``: the optimizer state to load into is allocated
  with megatron's own ``init_state_fn`` (plus Adam's ``step``) before ``state_dict()`` asserts
  on it; ``tensor.cuda()`` is the identity and the load runs under ``no_grad``; the canonical
  checkpoint carries no per-parameter ``step`` (it is in the param groups), so the copy skips
  it; and the ONE ``step`` tensor megatron puts into every parameter's state is split into
  copies (torch Adam increments each in place: shared, it would advance once per parameter per
  step and corrupt every later bias correction -- the resumed run would silently diverge).
  Checked with ``fully_reshardable`` (DP2 -> DP1 and DP2 -> DP2 resumes).

Not patched (not needed on the paths above, so unverified on CPU): ``tensor_parallel.data.
broadcast_data``, ``torch.autocast("cuda")`` in the schedules (only with
``config.enable_autocast``), fp16 (``optimizer.grad_scaler`` builds its scales with
``device='cuda'``), overlapped grad reduce / param gather, several distributed-optimizer
instances, the other distributed-optimizer checkpoint formats, CUDA graphs, FSDP, the
inference engines, the NCCL allocator, Transformer Engine.

The patches are process-wide while enabled (module attributes, not thread- or scope-local).

``cpu_transformer_config(**fields)`` builds a ``TransformerConfig`` for which
``GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), ...)`` builds and trains on
CPU in fp32, or in bf16 (``bf16=True``, ``params_dtype=torch.bfloat16``, wrapped in megatron's
``Float16Module``): CPU initialisation and every fused kernel off.

Megatron is imported lazily, inside the functions: importing this module needs torch only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gnmr_dist.integrations.megatron.versions import (
    SERIES,
    SeriesInfo,
    installed_version,
    series_of,
)
from gnmr_dist.integrations.patching import Patches

__all__ = [
    "SUPPORTED_MEGATRON_VERSIONS",
    "cpu_compat",
    "cpu_transformer_config",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
]

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSIONS: tuple[str, ...] = tuple(SERIES)
"""megatron-core ``major.minor`` series whose sources these patches were checked against: the
keys of the version table (0.16.1, 0.17.1, 0.19.2; 0.18 was not checked)."""

_LOCK = threading.Lock()
_APPLIED = Patches("cpu compat")
_TRAINING_ON: list[bool] = []
"""Non-empty while :mod:`megatron_patches.cpu_training`'s patches are on."""


# --------------------------------------------------------------------------- device redirects


def _cpu_current_device() -> torch.device:
    """CPU stand-in for ``torch.cuda.current_device``: the current device is the CPU."""
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """CPU stand-in for ``torch.cuda.synchronize``: CPU ops are already synchronous."""


class _CpuStream:
    """CPU stand-in for a CUDA stream: CPU ops run in program order, so waiting is a no-op."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: the CPU has no asynchronous stream."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: the CPU has no asynchronous stream."""

    def synchronize(self) -> None:
        """Nothing to wait for: the CPU has no asynchronous stream."""


def _cpu_current_stream(device: Any = None) -> _CpuStream:
    """CPU stand-in for ``torch.cuda.current_stream``."""
    return _CpuStream()


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


class CudaRng:
    """The "CUDA default generator" of a CPU host.

    Dropout on CPU tensors draws from torch's CPU default generator, so that is where the CUDA
    state must be while the model computes. With megatron-core alone (``separate`` false) the
    two are one generator. Megatron-LM's loop (:mod:`megatron_patches.cpu_training`) makes them
    two, as on a GPU (``separate`` true): the CUDA state is kept here, swapped into the CPU
    generator for each training step and evaluation (:meth:`swapped_in`) and out after, so the
    CPU stream (data loaders draw their base seed from it) and the CUDA stream (dropout) are
    saved in a checkpoint as the ``torch_rng_state`` / ``cuda_rng_state`` they are on a GPU, and
    a run resumed from it draws what the uninterrupted run drew.
    """

    def __init__(self) -> None:
        self.separate = False
        """Whether the CUDA stream is its own (Megatron-LM's loop), or the CPU generator's."""
        self._state = torch.Generator().get_state()  # torch's default seed until megatron seeds
        self._swapped = False

    def get_state(self) -> torch.Tensor:
        """The CUDA stream's state (a copy)."""
        if not self.separate or self._swapped:
            return torch.get_rng_state()
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        """Set the CUDA stream."""
        if not self.separate or self._swapped:
            torch.set_rng_state(state)
        else:
            self._state = state.clone()

    def seed(self, seed: int) -> None:
        """``torch.cuda.manual_seed``: the CUDA stream starts at ``seed``."""
        self.set_state(torch.Generator().manual_seed(seed).get_state())

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The CUDA stream in the CPU generator for the block (the CPU stream set aside)."""
        if not self.separate or self._swapped:
            yield
            return
        cpu = torch.get_rng_state()
        torch.set_rng_state(self._state)
        self._swapped = True
        try:
            yield
        finally:
            self._state, self._swapped = torch.get_rng_state(), False
            torch.set_rng_state(cpu)


CUDA_RNG = CudaRng()
"""The one CUDA stream of this process (:class:`CudaRng`)."""


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """CPU stand-in for ``random._get_cuda_rng_state`` (and ``torch.cuda.get_rng_state``)."""
    return CUDA_RNG.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``random._set_cuda_rng_state`` (and ``torch.cuda.set_rng_state``)."""
    CUDA_RNG.set_state(new_state)


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


def _tensor_cuda_identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """CPU stand-in for ``Tensor.cuda``: the tensor itself (the original can only raise here)."""
    return self


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """Within the block, ``Tensor.cuda()`` returns the tensor itself (it can only raise here)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = _tensor_cuda_identity  # type: ignore[method-assign,assignment]
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
        CUDA_RNG.seed(seed)  # data-parallel ("default") state = `seed`

    return model_parallel_cuda_manual_seed


@contextlib.contextmanager
def _tensor_type_reports_cuda() -> Iterator[None]:
    """Within the block, ``Tensor.type()`` (no argument) names a CPU tensor's CUDA twin type.

    ``torch.BFloat16Tensor`` reads ``torch.cuda.BFloat16Tensor``, and so on: the strings megatron's
    mixed-precision optimizers compare parameters against. ``Tensor.type(dtype)`` is unchanged.
    """
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _cpu_distopt_sharded_state_dict(original: Any) -> Any:
    """``DistributedOptimizer.sharded_state_dict`` on CPU (torch Adam, no TE/apex).

    Two gaps of megatron's non-TE path: building the state to *load into* calls ``state_dict()``,
    which reads the Adam ``step`` of every parameter's state and asserts there is one, so a
    fresh optimizer fails; megatron's own ``init_state_fn`` allocates the moments, and the
    ``step`` is set to 0 here (the loaded value replaces it). The ``fully_reshardable`` format
    gathers buffers with ``tensor.cuda()``, the identity on CPU.
    """

    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and len(self.optimizer.state) == 0 and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    return sharded_state_dict


def _cpu_distopt_load_state_dict(original: Any) -> Any:
    """``DistributedOptimizer.load_state_dict`` on CPU (torch Adam, no TE/apex).

    ``tensor.cuda()`` is the identity, and it runs under ``no_grad`` (it copies into the main
    parameters, leaves that require grad). megatron's non-TE path restores torch Adam's
    ``step`` by putting ONE tensor into every parameter's state; torch Adam increments each
    state's ``step`` in place, so the shared tensor would advance once per parameter per step and
    every later bias correction would be wrong. Each state gets its own copy back.
    """

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        with torch.no_grad(), _tensor_cuda_is_identity():
            result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    return load_state_dict


def _cpu_set_main_param_states(original: Any) -> Any:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` for torch Adam.

    torch Adam keeps a per-parameter ``step`` in its state; megatron's canonical checkpoint
    keeps it in the param groups (restored into every state by ``load_state_dict`` before this
    runs) and has no per-parameter ``step`` tensor, so the copy is asked for a key it lacks.
    Keys the checkpoint's tensors do not carry are left as ``load_state_dict`` set them.
    """

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    return set_states


def _cpu_optimizer_init(original: Any) -> Any:
    """Run a mixed-precision optimizer's ``__init__`` with ``Tensor.type()`` naming CUDA types."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        with _tensor_type_reports_cuda():
            original(self, *args, **kwargs)

    return __init__


def _cpu_torch_norm_new(original: Any) -> Any:
    """``WrappedTorchNorm.__new__`` that supports sequence parallelism, as ``FusedLayerNorm`` does.

    The original asserts ``not config.sequence_parallel`` because a plain torch norm does not
    mark its weights; under sequence parallelism each TP rank sees a slice of the sequence, so
    the norm's weight gradients are partial sums that ``finalize_model_grads`` must all-reduce
    over TP, which it does for parameters marked ``sequence_parallel=True``. This builds the same
    torch norm and marks its parameters with ``config.sequence_parallel`` (like apex's
    ``FusedLayerNorm`` and TE's norms in megatron).
    """

    def __new__(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        sequence_parallel = bool(config.sequence_parallel)
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False  # its only objection; the marks below answer it
        norm = original(cls, config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    return staticmethod(functools.wraps(original)(__new__))


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


def _checked_series(version: str) -> SeriesInfo:
    """The version table's row of ``version``'s series; raises unless the table lists it."""
    series = series_of(version)
    info = SERIES.get(series)
    if info is None:
        raise RuntimeError(
            f"megatron_patches.cpu was checked against megatron-core "
            f"{', '.join(v + '.x' for v in SERIES)}; found {version}. "
            f"Verify the patched call sites against its sources, then add a {series!r} row to "
            f"megatron_patches.versions.SERIES."
        )
    return info


def _wrapping(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> tuple[Any, str, Any]:
    """The plan entry that replaces ``owner.name`` by ``wrapper`` of it (a CPU twin)."""
    return owner, name, wrapper(getattr(owner, name))


def _patch_plan(version: str | None = None) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for every patch, in application order.

    ``version``: the megatron-core version the plan is for (default: the installed one); the
    patches that only some series need are chosen by it. Raises ``RuntimeError`` when a target
    no longer exists, so a renamed call site fails loudly instead of being silently added.
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    version = installed_version() if version is None else version
    info = _checked_series(version)
    cpu_torch = _CpuTorch()
    seed = _cpu_manual_seed(mrandom.model_parallel_cuda_manual_seed)
    clip = _cpu_clip_grad_by_total_norm(clip_grads.clip_grad_by_total_norm_fp32)
    torch_users = (schedules, transformer_utils, clip_grads, mcore_optimizer)
    float16 = mcore_optimizer.Float16OptimizerWithFloat16Params
    plan: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        (mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add),
        (mrandom.CudaRNGStatesTracker, "fork", _cpu_tracker_fork),
        *((m, "model_parallel_cuda_manual_seed", seed) for m in (mrandom, tensor_parallel)),
        *((m, "torch", cpu_torch) for m in torch_users),
        (clip_grads, "multi_tensor_applier", _cpu_multi_tensor_applier),
        (clip_grads, "l2_norm_impl", _cpu_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", _cpu_scale),
        *((m, "clip_grad_by_total_norm_fp32", clip) for m in (clip_grads, mcore_optimizer)),
        _wrapping(LanguageModule, "setup_embeddings_and_output_layer", _cpu_setup_embeddings),
        _wrapping(float16, "__init__", _cpu_optimizer_init),
        _wrapping(DistributedOptimizer, "__init__", _cpu_optimizer_init),
        _wrapping(DistributedOptimizer, "sharded_state_dict", _cpu_distopt_sharded_state_dict),
        _wrapping(DistributedOptimizer, "load_state_dict", _cpu_distopt_load_state_dict),
        _wrapping(
            DistributedOptimizer, "_set_main_param_and_optimizer_states", _cpu_set_main_param_states
        ),
        _wrapping(WrappedTorchNorm, "__new__", _cpu_torch_norm_new),
    ]
    if info.grad_sync_current_stream:
        plan.append((torch.cuda, "current_stream", _cpu_current_stream))
    for owner, name, _ in plan:
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron_patches.cpu: {getattr(owner, '__name__', owner)}.{name} does not "
                f"exist in megatron-core {version}; re-check the patched call sites"
            )
    return plan


def _restore_all() -> None:
    _TRAINING_ON.clear()
    _APPLIED.restore()


# --------------------------------------------------------------------------- public API


def is_cpu_compat_enabled() -> bool:
    """Whether the CPU patches are currently applied."""
    return bool(_APPLIED)


def enable_cpu_compat(*, training: bool = False) -> None:
    """Apply the CPU patches to megatron-core (idempotent).

    ``training=True`` also applies :mod:`megatron_patches.cpu_training`, for Megatron-LM's own
    training loop (``megatron.training.pretrain``); it needs a series whose wheel ships
    ``megatron.training`` (the version table's ``has_training``: 0.17+). It may be asked for
    after the core patches are on.

    Raises:
        RuntimeError: CUDA is available (this module is never active on a GPU), the installed
            megatron-core is not in ``SUPPORTED_MEGATRON_VERSIONS``, or ``training`` is asked
            of a series without ``megatron.training``.
        ImportError: megatron-core is not installed.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_patches.cpu is never active on a GPU: torch.cuda.is_available() is True. "
            "Run megatron-core natively on CUDA instead."
        )
    with _LOCK:
        version = installed_version()
        info = _checked_series(version)
        if training and not info.has_training:
            raise RuntimeError(
                f"megatron_patches.cpu: training=True needs megatron.training, which "
                f"megatron-core {version} does not ship (0.17+ wheels do)"
            )
        plan = [] if _APPLIED else _patch_plan()
        add_training = training and not _TRAINING_ON
        if add_training:
            from gnmr_dist.integrations.megatron.cpu_training import training_patch_plan

            plan += training_patch_plan()
        try:
            for owner, name, replacement in plan:
                _APPLIED.set(owner, name, replacement)
        except BaseException:
            _restore_all()
            raise
        if add_training:
            _TRAINING_ON.append(True)
        if plan:
            logger.info(
                "cpu compat enabled for megatron-core %s (%d patches)", version, len(_APPLIED)
            )


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
