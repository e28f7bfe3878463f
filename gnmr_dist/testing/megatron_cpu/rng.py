"""The CUDA RNG of megatron-core's ``tensor_parallel.random``, on the CPU generator.

What is patched, and why:

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
  (:mod:`gnmr_dist.testing.megatron_cpu.training`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


class CudaRng:
    """The "CUDA default generator" of a CPU host.

    Dropout on CPU tensors draws from torch's CPU default generator, so that is where the CUDA
    state must be while the model computes. With megatron-core alone (``separate`` false) the
    two are one generator. Megatron-LM's loop (:mod:`gnmr_dist.testing.megatron_cpu.training`)
    makes them two, as on a GPU (``separate`` true): the CUDA state is kept here, swapped into the
    CPU generator for each training step and evaluation (:meth:`swapped_in`) and out after, so the
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


def _cpu_manual_seed(original: Any) -> Any:
    """Wrap ``model_parallel_cuda_manual_seed``: also seed the CPU generator (the default state)."""

    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        original(seed, *args, **kwargs)
        CUDA_RNG.seed(seed)  # data-parallel ("default") state = `seed`

    return model_parallel_cuda_manual_seed
