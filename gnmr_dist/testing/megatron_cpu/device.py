"""CPU stand-ins for ``torch.cuda`` and for CUDA tensor placement inside megatron-core.

What is patched (by :func:`~gnmr_dist.testing.megatron_cpu.enable_cpu_compat`), and why:

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
* The name ``torch`` inside four megatron modules -> a stand-in module that forwards every
  attribute to ``torch`` except the factories ``empty/full/ones/tensor/zeros``, which turn
  ``device="cuda"`` into the CPU. ``pipeline_parallel.schedules`` creates ``total_num_tokens``
  with ``device="cuda"``; ``transformer.utils.get_default_causal_mask`` builds the attention
  mask that way; ``optimizer.clip_grads`` (``get_grad_norm_fp32``, ``count_zeros_fp32``) and
  ``optimizer.optimizer`` (``MixedPrecisionOptimizer``'s ``found_inf`` / unit loss scale,
  ``FP32Optimizer``'s loss scale, and from 0.19 ``has_grad_norm_group``'s flag) create their
  scalars that way. These are literals inside function bodies, so the module's ``torch`` name
  is the narrowest hook that keeps megatron's own function bodies running.
* ``LanguageModule.setup_embeddings_and_output_layer`` -> the original, run with
  ``torch.Tensor.cuda`` made the identity for its duration: with tied embeddings and pipeline
  parallelism it moves the shared weight with ``weight.data.cuda()`` before all-reducing it over
  the embedding group.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch


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
